"""mode=eval end to end: a checkpoint of a real run evaluated for a few complete episodes, its success rate inside
its Wilson interval, videos from a camera env, and bad input that stops with one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.runs.evaluation import check_mode
from ebrl.telemetry.metrics import Z95, wilson_interval
from tests.conftest import compose_config
from tests.runs.test_run import SMALL, run_py


def train_one_iteration(run_dir: Path, *overrides: str) -> Path:
    proc = run_py(*SMALL, *overrides, "iterations=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_one_iteration(tmp_path_factory.mktemp("train") / "r", "policy.execute=5")


def test_eval_runs_complete_episodes_and_reports_an_interval(trained, tmp_path):
    checkpoint = trained / "checkpoints" / "last.pt"
    proc = run_py(
        *SMALL,
        "mode=eval",
        f"checkpoint={checkpoint}",
        "eval.episodes=3",
        "env.max_episode_steps=12",
        f"hydra.run.dir={tmp_path / 'e'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EBRL evaluation" in proc.stdout
    # the actions of each chunk the run trained with, not the whole chunk
    assert (
        f"policy.execute=5: 5 of each chunk's 8 actions run before the next chunk is sampled (what "
        f"checkpoint={checkpoint} trained with)" in " ".join(proc.stderr.split())
    )
    assert "no videos saved: env.cameras is empty (e.g. env.cameras=[agentview] records them)" in proc.stderr
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert result["episodes"] == 3 and result["iteration"] == 1
    # 2 envs share 3 episodes by index: env 0 runs episodes 0 and 2, env 1 episode 1
    assert [e["env"] for e in result["per_episode"]] == [0, 1, 0]
    assert [e["seed"] for e in result["per_episode"]] == [0, 1, 2]  # episode j from seed j whatever the envs
    assert all(1 <= e["length"] <= 12 for e in result["per_episode"])  # complete episodes, none past the limit
    assert result["successes"] == sum(e["success"] for e in result["per_episode"])
    low, high = result["success_ci95"]
    assert 0 <= low <= result["success_rate"] <= high <= 1
    assert result["success_rate"] == result["successes"] / 3 and result["videos"] == []
    assert math.isfinite(result["mean_return"])


def test_wilson_interval_known_values():
    n, z2 = 10, Z95**2
    # at 0/n and n/n the interval has a closed form: [0, z^2 / (n + z^2)] and [n / (n + z^2), 1]
    assert wilson_interval(0, n) == pytest.approx((0.0, z2 / (n + z2)), abs=1e-12)
    assert wilson_interval(n, n) == pytest.approx((n / (n + z2), 1.0), abs=1e-12)
    # scipy 1.17.1, binomtest(k, 10).proportion_ci(method="wilson")
    assert wilson_interval(5, n) == pytest.approx((0.236593090512564, 0.7634069094874361), abs=1e-12)
    assert wilson_interval(1, n) == pytest.approx((0.017876213095072896, 0.4041500267952385), abs=1e-12)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["mode=evaluate"], "mode='evaluate' is not available; accepted: train, eval"),
        (["mode=eval"], "mode=eval needs checkpoint=<run folder or its checkpoints/last.pt>"),
        (["mode=eval", "checkpoint=/no/such/run"], "checkpoint=/no/such/run does not exist"),
        (["mode=eval", "checkpoint=.", "eval.episodes=0"], "eval.episodes=0 must be at least 1"),
        (["mode=eval", "checkpoint=.", "eval.videos=-1"], "eval.videos=-1 must be >= 0"),
        (["checkpoint=."], "checkpoint=. is read by mode=eval only"),
    ],
)
def test_bad_mode_values_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as error:
        check_mode(compose_config(*overrides))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_eval_skips_the_training_only_checks():
    # one env and 4 minibatches cannot split a PPO rollout (10 chunks), but an evaluation runs no update
    with pytest.raises(ConfigError, match="does not divide the rollout batch"):
        validate(compose_config("env.num_envs=1", "algo.minibatches=4", "algo.rollout_chunks=10"))
    validate(
        compose_config("mode=eval", "checkpoint=.", "env.num_envs=1", "algo.minibatches=4", "algo.rollout_chunks=10")
    )


def test_eval_without_checkpoint_stops_with_one_line(tmp_path):
    proc = run_py("mode=eval", f"hydra.run.dir={tmp_path / 'never'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: mode=eval needs checkpoint=<run folder or its checkpoints/last.pt>, or "
        "policy.checkpoint=<a published checkpoint folder> to evaluate that one"
    )
    assert not (tmp_path / "never").exists()


@pytest.mark.slow  # about 35 s on 2 cores: a camera run to train, then one to evaluate
def test_eval_with_a_camera_saves_videos(tmp_path):
    camera = ["env.num_envs=1", "env.cameras=[agentview]", "env.image_size=64"]
    trained_with_camera = train_one_iteration(tmp_path / "r", *camera)
    proc = run_py(
        *SMALL,
        *camera,
        "mode=eval",
        f"checkpoint={trained_with_camera}",
        "eval.episodes=2",
        "env.max_episode_steps=10",
        f"hydra.run.dir={tmp_path / 'e'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert result["episodes"] == 2 and len(result["videos"]) == 2
    import imageio_ffmpeg

    for name, episode in zip(result["videos"], result["per_episode"]):
        video = tmp_path / "e" / name
        assert video.suffix == ".mp4" and video.stat().st_size > 0
        assert ("success" if episode["success"] else "failure") in video.name
        frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
        assert frames == episode["length"] + 1  # the first obs, then one frame per step


@pytest.mark.slow  # (the default suite's time)
def test_a_multi_task_run_logs_and_evaluates_each_task(tmp_path):
    tasks = ["env.tasks=[Lift,Stack]", "env.max_episode_steps=8"]
    trained = train_one_iteration(tmp_path / "t", *tasks, "scheduler=ebrl")
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert {"env/Lift/success", "env/Stack/success", "env/Lift/return", "env/Stack/return"} <= set(rows[-1])
    assert rows[-1]["env/Lift/episodes"] + rows[-1]["env/Stack/episodes"] == rows[-1]["env/episodes"]
    proc = run_py(
        *SMALL, *tasks, "mode=eval", f"checkpoint={trained}", "eval.episodes=4", f"hydra.run.dir={tmp_path / 'e'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert [e["task"] for e in result["per_episode"]] == ["Lift", "Stack", "Lift", "Stack"]  # env i runs task i
    for task in ("Lift", "Stack"):
        t = result["per_task"][task]
        assert t["episodes"] == 2 and t["success_ci95"][0] <= t["success_rate"] <= t["success_ci95"][1]
    assert "Stack (2 episodes)" in proc.stdout


def test_an_evaluations_envs_start_each_episode_from_its_index_seed():
    """env i of n with episode_seeds first takes first + i, first + i + n, ...: the resets an evaluation's simulators
    do themselves start episode j from seed first + j, as an explicit reset from that seed would."""
    import numpy as np
    from omegaconf import OmegaConf

    from ebrl.envs.process import build_adapter

    env = OmegaConf.to_container(compose_config("env.task=Lift").env, resolve=True)
    scheduled = build_adapter({**env, "episode_seeds": [5, 3]}, seed=0)  # env 0 of 3 from seed 5 on
    explicit = build_adapter(env, seed=0)
    try:
        for seed in (5, 8, 11):
            assert np.array_equal(scheduled.begin_episode()["state"], explicit.begin_episode(seed)["state"])
    finally:
        scheduled.close()
        explicit.close()
