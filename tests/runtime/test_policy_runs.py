"""Every policy family trains end to end through run.py: real simulator workers, a rollout of a few hundred env
steps, PPO updates, a checkpoint."""

from __future__ import annotations

import pytest

from tests.conftest import group_options
from tests.runs.test_run import SMALL, metrics, run_py

RUNS = [[f"policy={name}"] for name in group_options("policy")] + [["policy=openpi", "policy.variant=pi05"]]


@pytest.mark.parametrize("overrides", RUNS, ids=[" ".join(o) for o in RUNS])
def test_every_family_trains_end_to_end(tmp_path, overrides):
    run_dir = tmp_path / "r"
    proc = run_py(*SMALL, "algo.rollout_chunks=8", "iterations=2", *overrides, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[-1]["env_steps"] >= 200  # 2 envs x 8 chunks x 2 iterations x (chunk of 8 or more, fewer at an end)
    for row in rows:
        assert "losses/policy" in row and row["train/approx_kl"] == row["train/approx_kl"]  # finite, not NaN
    assert (run_dir / "checkpoints" / "last.pt").is_file()
