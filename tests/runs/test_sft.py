"""algo=sft on recorded demonstrations, and RL from its checkpoint: the held-out loss falls, the statistics travel with
the weights, and the critic's warm-up leaves the policy as SFT made it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from ebrl.demos.record import record
from ebrl.runs.evaluation import Evaluation
from ebrl.runs.experiment import Experiment
from ebrl.runs.sft import SupervisedRun
from ebrl.runtime.checkpoint import load_checkpoint
from tests.conftest import CONF, compose_config
from tests.runs.test_run import SMALL, metrics


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sft")
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("record", overrides=["episodes=10", f"out={folder}/demos", "progress=false"])
    record(cfg)
    run = SupervisedRun.from_config(
        compose_config(
            "algo=sft", f"demos.path={folder}/demos", "iterations=4", "algo.steps_per_iteration=40", "progress=false"
        ),
        run_dir=folder / "run",
    )
    run.train()
    return folder / "run"


def test_sft_lowers_its_held_out_loss_and_writes_what_rl_starts_from(sft_run):
    rows = metrics(sft_run)
    held = [r["losses/sft_valid"] for r in rows]
    assert len(held) == 4 and held[-1] < held[0], held  # (10 demos, 2 held out: 0.24 -> 0.09 when measured)
    assert rows[-1]["samples"] == 4 * 40 * 64
    ckpt = load_checkpoint(sft_run / "checkpoints" / "last.pt")
    assert ckpt["config"]["algo"]["name"] == "sft" and ckpt["iteration"] == 4
    stats = json.loads((sft_run / "norm_stats.json").read_text())["norm_stats"]
    assert len(stats["state"]["mean"]) == 60 and len(stats["actions"]["std"]) == 7
    assert ckpt["norm_stats"] == json.loads((sft_run / "norm_stats.json").read_text())  # they travel with it
    assert (sft_run / "sft_loss.png").is_file()


def test_rl_from_the_sft_run_warms_its_critic_up_with_the_policy_as_sft_left_it(sft_run, tmp_path):
    cfg = compose_config(*SMALL, f"init={sft_run}", "iterations=2", "checkpoint_every=1", "algo.critic_warmup=1")
    run = Experiment.from_config(cfg, run_dir=tmp_path / "rl")
    run.train()
    sft = load_checkpoint(sft_run / "checkpoints" / "last.pt")["model"]
    saved = (tmp_path / "rl" / "config.yaml").read_text()
    assert f"init: {sft_run / 'checkpoints' / 'last.pt'}" in saved and "norm_stats.json" in saved
    assert (tmp_path / "rl" / "norm_stats.json").read_text() == (sft_run / "norm_stats.json").read_text()
    rows = metrics(tmp_path / "rl")
    assert [r["train/critic_only"] for r in rows] == [1.0, 0.0]
    after = load_checkpoint(tmp_path / "rl" / "checkpoints" / "previous.pt")  # after update 1: the warm-up's
    assert after["iteration"] == 1
    moved = {k for k, v in sft.items() if not torch.equal(v, after["model"][k])}
    assert moved and all(k.startswith("value_head.") for k in moved), sorted(moved)[:5]
    last = load_checkpoint(tmp_path / "rl" / "checkpoints" / "last.pt")["model"]
    assert any(not torch.equal(sft[k], last[k]) for k in sft if not k.startswith("value_head."))  # then it learns


def test_an_sft_checkpoint_evaluates_with_the_statistics_it_was_trained_with(sft_run, tmp_path):
    cfg = compose_config("mode=eval", f"checkpoint={sft_run}", "eval.episodes=2", "env.num_envs=2", "progress=false")
    summary = Evaluation.from_config(cfg, run_dir=tmp_path / "eval").run()
    assert summary.episodes == 2
    assert (tmp_path / "eval" / "norm_stats.json").read_text() == (sft_run / "norm_stats.json").read_text()


@pytest.mark.parametrize(
    "overrides, shipped",
    [
        ((), True),  # the default run fine-tunes the shipped checkpoint
        (("env.task=Stack",), False),  # no checkpoint for this task
        (("policy.chunk=4",), False),  # a policy built otherwise than the shipped one
        (("algo=sft",), False),  # SFT starts from the family's initialisation
    ],
)
def test_init_auto_takes_the_shipped_checkpoint_only_for_the_policy_and_env_it_was_made_for(overrides, shipped):
    from ebrl.runs.init import SHIPPED, init_file

    found = init_file(compose_config(*overrides))
    assert (found is not None) == shipped
    if shipped:
        assert str(found).endswith(SHIPPED["openpi", "tiny", "pi0", "robosuite", "Lift"])
        assert load_checkpoint(found)["config"]["algo"]["name"] == "sft"


def test_demos_of_the_state_dims_a_policy_reads_train_the_env_it_runs():
    """A LeRobot LIBERO dataset's state is openpi's 8 dims; our adapter's is those and the objects'. With
    policy.state_dims naming them, the demos' state is laid into the env's at those dims, and the statistics are of
    the dims the policy reads."""
    import numpy as np
    from omegaconf import OmegaConf

    from ebrl.demos.episodes import Demos, Episode, statistics
    from ebrl.envs.base import ArraySpec, EnvSpec
    from ebrl.runs.sft import fit_demos

    rng = np.random.default_rng(0)
    episodes = [
        Episode(
            {"state": rng.normal(size=(5, 3)).astype(np.float32)}, np.zeros((5, 7), np.float32), np.zeros(5, np.float32)
        )
        for _ in range(2)
    ]
    demos = Demos(episodes, train=[0, 1], valid=[], files=["d"])
    own = [e.obs["state"].copy() for e in episodes]
    spec = EnvSpec(obs={"state": ArraySpec((6,), "float32")}, action_dim=7, instruction="x", max_episode_steps=5)
    env = OmegaConf.create({"name": "libero", "task": "0"})
    with pytest.raises(Exception, match=r"its state has 3 dims and env=libero env.task=0's 6; record"):
        fit_demos(
            Demos([Episode({"state": own[0]}, episodes[0].actions, episodes[0].rewards)], [0], [], ["d"]), spec, env
        )
    fit_demos(demos, spec, env, state_dims=[4, 0, 2])
    assert demos.episodes[0].obs["state"].shape == (5, 6)
    assert np.array_equal(demos.episodes[0].obs["state"][:, [4, 0, 2]], own[0])
    assert not demos.episodes[0].obs["state"][:, [1, 3, 5]].any()
    mean = statistics(demos, [0, 1], [4, 0, 2])["norm_stats"]["state"]["mean"]
    assert np.allclose(mean, np.concatenate(own).mean(0))


def test_init_beside_the_checkpoint_its_run_was_made_from(tmp_path):
    """RL from an SFT run of a published checkpoint names both: the folder describes the model, the run gives the
    weights; a run made from another checkpoint (or none) still competes with it."""
    from ebrl.config import ConfigError
    from ebrl.runs.init import init_file

    run = tmp_path / "sft"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    (run / "config.yaml").write_text(f"policy:\n  checkpoint: {tmp_path / 'pi0'}\n")
    cfg = compose_config(f"init={run}", f"policy.checkpoint={tmp_path / 'pi0'}")
    assert init_file(cfg) == run / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match="both give the first weights"):
        init_file(compose_config(f"init={run}", f"policy.checkpoint={tmp_path / 'other'}"))
