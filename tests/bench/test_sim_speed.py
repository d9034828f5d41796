"""The simulation-speed benchmark on one task: the stock and the fast control step, the physics inside it and a
reset, measured in the benchmark's own process (no timings asserted)."""
from __future__ import annotations

import pytest

from ebrl.bench.sim_speed import main


@pytest.mark.parametrize("suite, task, substeps", [
    ("robosuite", "Lift", 25),  # robosuite's 500 Hz physics under a 20 Hz control step
    ("maniskill", "PushCube-v1", 5),  # PhysX at 100 Hz, timed inside the stock steps
])
def test_sim_speed_measures_a_step_its_physics_and_a_reset(capsys, suite, task, substeps):
    rows = main(["--benchmarks", suite, "--tasks", task, "--steps", "10", "--repeats", "1", "--resets", "1"])
    assert [r["task"] for r in rows] == [task]
    row = rows[0]
    assert row["substeps"] == substeps
    assert row["step_ms"] > 0 and row["fast_ms"] > 0 and row["physics_ms"] > 0 and row["reset_ms"] > 0
    assert row["fast_off"] == ""  # the fast step covers the task
    assert f"| {suite} | {task} |" in capsys.readouterr().out
