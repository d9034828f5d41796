"""run.py end to end in a subprocess: a real run, resume, and bad input that leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebrl.envs.setup import benchmark_python
from ebrl.telemetry.trace import read_spans
from tests.conftest import REPO

SMALL = [
    "env.num_envs=2",
    "algo.rollout_chunks=4",
    "algo.minibatches=2",
    "algo.epochs=2",
    "env.max_episode_steps=24",
    "progress=false",
    "logger=none",
    "init=null",  # the mechanics from the family's initialisation: no shipped policy ends episodes mid-chunk
]
# algo=grpo's: every env runs one whole episode, so its schema has no algo.rollout_chunks
SMALL_GRPO = [o for o in SMALL if not o.startswith("algo.rollout_chunks=")]


def run_py(*overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "run.py", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


EXECUTE = "policy.execute=6"  # of tiny's 8 actions: the 24-step episodes end at a chunk boundary


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "r"
    # (progress on: stdout is a pipe here, as a batch job's log, so each iteration prints a plain line)
    proc = run_py(*(o for o in SMALL if o != "progress=false"), EXECUTE, "iterations=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EBRL run summary" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("train ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], proc.stdout
    assert lines[0].startswith("train 1/3  env steps 48  ") and "env steps/s" in lines[0] and "ETA" in lines[0]
    assert "policy.execute=6: 6 of each chunk's 8 actions run before the next chunk is sampled" in proc.stderr
    return run_dir


def test_run_writes_metrics_checkpoint_and_summary(finished_run):
    rows = metrics(finished_run)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # 2 envs x 4 chunks x the 6 executed actions per iteration: every chunk runs 6 steps, every episode 4 chunks
    steps = [b["env_steps"] - a["env_steps"] for a, b in zip([{"env_steps": 0}] + rows, rows)]
    assert steps == [48, 48, 48], steps
    chunks = [s for s in read_spans(finished_run / "trace.json") if s.name == "chunk"]
    assert chunks and {s.args["steps"] for s in chunks} == {6}
    for key in (
        "perf/env_steps_per_s",
        "time/simulate_s",
        "time/generate_s",
        "time/train_s",
        "perf/cpu_busy",
        "losses/policy",
        "losses/value",
        "train/approx_kl",
        "env/step_ms_mean",
    ):
        assert key in rows[-1], key
    assert any("env/return" in r for r in rows)  # 24-step episodes end inside the rollout
    assert (finished_run / "checkpoints" / "last.pt").is_file()
    assert (finished_run / "config.yaml").is_file()
    assert (finished_run / "cpu_busy.png").is_file() and (finished_run / "stage_busy.png").is_file()
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["env_steps"] == rows[-1]["env_steps"] and summary["rollout_steps_per_s"] > 0
    # the simulators' CPU time per env step over the steady iterations (neither the first nor the last of three):
    # what `python -m ebrl.bench.sim_speed` measures
    sim_cpu = rows[1]["perf/sim_cpu_s"]
    assert sim_cpu > 0 and summary["sim_cpu_ms_per_step"] == pytest.approx(1e3 * sim_cpu / 48)


@pytest.mark.parametrize(
    "overrides",
    [
        ["env=maniskill", "env.task=PushCube-v1"],
        ["env.cameras=[agentview]", "env.image_size=32"],  # images through shared memory into the ViT
    ],
    ids=["maniskill", "robosuite-camera"],
)
def test_other_envs_train_end_to_end(tmp_path, overrides):
    proc = run_py(*SMALL, *overrides, "iterations=1", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "r")
    assert rows[0]["env_steps"] > 0 and "losses/policy" in rows[0]


def test_resume_continues_the_run(finished_run):
    proc = run_py(*SMALL, EXECUTE, "iterations=4", f"resume={finished_run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(finished_run)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["env_steps"] > rows[2]["env_steps"]


def test_checkpoint_of_another_policy_is_refused(finished_run):
    before = snapshot(finished_run)
    proc = run_py(*SMALL, "iterations=9", "policy.chunk=4", f"resume={finished_run}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "another policy" in lines[0] and "policy.chunk=" in lines[0], proc.stderr
    assert snapshot(finished_run) == before


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["hw=a100x8"], "hw=a100x8 needs 8 CUDA GPUs and this machine has none"),
        (["env.num_envs=0"], "env.num_envs=0 must be a positive number"),
        (["env.task=Lfit"], "env.task='Lfit' is not a robosuite task"),
        (["algo=grpo", "env.num_envs=3", "algo.group_size=2"], "env.num_envs=3 is not a multiple of algo.group_size=2"),
        (["env=robocasa"], "robocasa"),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_folder(tmp_path, overrides, needle):
    run_dir = tmp_path / "never"
    proc = run_py(
        *(SMALL_GRPO if "algo=grpo" in overrides else SMALL), *overrides, "iterations=1", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not run_dir.exists()


def test_benchmark_without_its_interpreter_names_the_setup_command(tmp_path):
    env = {**os.environ, "EBRL_ENVS_DIR": str(tmp_path / "no-envs")}
    proc = subprocess.run(
        [sys.executable, "run.py", *SMALL, "env=libero", f"hydra.run.dir={tmp_path / 'never'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run `python -m ebrl.envs.setup libero`" in lines[0], proc.stderr


@pytest.mark.skipif(benchmark_python("libero") is None, reason="no LIBERO venv: run `python -m ebrl.envs.setup libero`")
def test_libero_trains_end_to_end_under_its_own_interpreter(tmp_path):
    proc = run_py(*SMALL, "env=libero", "iterations=1", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(tmp_path / "r")[0]["env_steps"] > 0


def test_typo_gets_hydras_short_message(tmp_path):
    proc = run_py("hw.gpu=8", f"hydra.run.dir={tmp_path / 'never'}")
    assert proc.returncode != 0
    assert "Could not override 'hw.gpu'" in proc.stderr and "Traceback" not in proc.stderr


def test_cfg_job_prints_the_config_without_a_gpu():
    proc = run_py("policy=openpi", "env=robocasa", "hw=a100x8", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "name: a100x8" in proc.stdout and "name: robocasa" in proc.stdout


def test_wandb_logger_offline(tmp_path):
    run_dir = tmp_path / "w"
    proc = run_py(*SMALL, "iterations=1", "logger=wandb", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline, "no offline W&B run written"
    records = b"".join(f.read_bytes() for f in offline[0].glob("*.wandb"))
    for logged in (b"time/stages", b"summary/rollout_steps_per_s", b"plots/stage_busy"):  # the table, totals, plots
        assert logged in records, logged
