"""The simulation-speed benchmark on one task: the stock and the fast control step, the raw physics inside it and a
reset, measured in the benchmark's own process (no timings asserted)."""
from __future__ import annotations

from ebrl.bench.sim_speed import main


def test_sim_speed_measures_a_step_its_physics_and_a_reset(capsys):
    rows = main(["--benchmarks", "robosuite", "--tasks", "Lift", "--steps", "10", "--repeats", "1", "--resets", "1"])
    assert [r["task"] for r in rows] == ["Lift"]
    row = rows[0]
    assert row["substeps"] == 25  # robosuite's 500 Hz physics under a 20 Hz control step
    assert row["step_ms"] > 0 and row["fast_ms"] > 0 and row["physics_ms"] > 0 and row["reset_ms"] > 0
    assert row["fast_off"] == ""  # the fast step covers Lift
    assert "| robosuite | Lift |" in capsys.readouterr().out
