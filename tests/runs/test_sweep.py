"""sweep.py end to end in subprocesses: two Optuna trials write a stage profile and Optuna's results; run.py finds
the profile by policy x env x hw and plans from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from ebrl.alloc.profile import STAGES, StageProfile
from ebrl.runs.sweep import sweep_progress

REPO = Path(__file__).resolve().parents[2]
TINY = ["env.num_envs=2", "algo.rollout_chunks=2"]


def test_two_sweep_trials_write_a_profile_that_run_py_then_loads(tmp_path):
    profiles, sweep_dir = tmp_path / "profiles", tmp_path / "sweep"
    out = subprocess.run(
        # as docs/internals/allocation.md types it
        [
            sys.executable,
            "sweep.py",
            "-m",
            *TINY,
            "iterations=3",
            "hydra.sweeper.n_trials=2",
            "scheduler.groups=choice(1,2)",  # replaces the sweep's choice(1,2,4): 4 groups of 2 envs cannot be
            f"allocator.profiles_dir={profiles}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    written = list(profiles.glob("*.yaml"))
    assert [p.name for p in written] == ["openpi-tiny_robosuite-Lift_cpu.yaml"], out.stdout[-2000:]
    assert f"stage profile from 2 trials written to {written[0]}" in out.stdout
    assert "sweep [##########----------] trial 1/2: " in out.stdout and "trial 2/2: " in out.stdout  # progress
    profile = StageProfile.load(written[0])
    assert set(profile.stages) == set(STAGES) and profile.key["num_envs"] == 2
    assert all(p.rate > 0 for p in profile.points)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] > 0 and set(results["best_params"]) >= {"sweep.simulate", "scheduler.groups"}

    run = subprocess.run(
        [
            sys.executable,
            "run.py",
            "scheduler=ebrl",
            *TINY,
            "iterations=2",
            "progress=false",
            f"allocator.profiles_dir={profiles}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stderr
    assert f"stage profile: {written[0]}" in said and "allocator: plan simulate" in said


def test_sweep_progress_line():
    line = "sweep [#####---------------] trial 3/12: 180.2 env steps/s (best 205.8)"
    assert sweep_progress(3, 12, 180.24, 205.8) == line
    assert sweep_progress(1, None, None, None) == "sweep: trial 1: failed (its job folder has the error)"
