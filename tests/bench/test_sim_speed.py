"""The simulation-speed benchmark on one task: the stock and the fast control step on the run's path, the physics
inside it, each part's share, one simulator process's CPU time and the run's processes' at once, measured in the
benchmark's own processes (no timings asserted)."""

from __future__ import annotations

import pytest

from ebrl.bench.sim_parts import PARTS
from ebrl.bench.sim_speed import main


@pytest.mark.parametrize(
    "suite, task, substeps, envs",
    [
        ("robosuite", "Lift", 25, 2),  # robosuite's 500 Hz physics under a 20 Hz control step
        ("maniskill", "PushCube-v1", 5, 1),  # PhysX at 100 Hz, timed inside the stock steps
    ],
)
def test_sim_speed_measures_the_runs_step_its_physics_and_its_parts(capsys, suite, task, substeps, envs):
    rows = main(
        [
            "--benchmarks",
            suite,
            "--tasks",
            task,
            "--steps",
            "48",
            "--repeats",
            "1",
            "policy.execute=4",
            "env.max_episode_steps=20",
            f"env.num_envs={envs}",
        ]
    )
    assert [r["task"] for r in rows] == [task]
    row = rows[0]
    assert row["substeps"] == substeps and row["execute"] == 4  # (the run's override)
    assert row["step_ms"] > 0 and row["fast_ms"] > 0 and row["physics_ms"] > 0 and row["process_ms"] > 0
    assert row["num_envs"] == envs and row["run_ms"] > 0  # (the run's simulators at once: env.num_envs of them)
    if envs == 1:
        assert row["run_ms"] == row["process_ms"]  # (one simulator: the one-process figure, not measured twice)
    assert row["fast_off"] == ""  # the fast step covers the task
    out = capsys.readouterr().out
    assert f"| {suite} | {task} | 4 |" in out
    if suite == "robosuite":  # parts: the robosuite family's seams
        for way, total in (("stock", row["step_ms"]), ("fast", row["fast_ms"])):
            parts = row["parts"][way]
            assert set(parts) == set(PARTS) and sum(parts.values()) == pytest.approx(total)
            assert parts["controller"] > 0 and parts["physics"] > 0 and parts["observables"] > 0
            assert parts["reset"] > 0  # (48 steps: two resets at the 20-step limit, inside the timing)
        assert f"| {suite} | {task} | fast |" in out
    else:
        assert row["parts"] == {}
