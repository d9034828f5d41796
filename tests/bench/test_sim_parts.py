"""The per-part timer of the simulation benchmark: a call inside another is charged to the inner part while it runs,
everything inside a reset to the reset, and the originals come back (a clock that moves only when told)."""

from __future__ import annotations

import pytest

from ebrl.bench.sim_parts import PARTS, Parts


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sim:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def step(self) -> None:
        self.clock.now += 1.0

    def control(self) -> str:
        self.clock.now += 2.0
        self.step()
        self.clock.now += 0.5
        return "torques"

    def reset(self) -> None:
        self.clock.now += 3.0
        self.step()
        self.control()


def test_a_call_inside_another_is_the_inner_parts_and_a_reset_owns_what_it_runs():
    clock = Clock()
    sim, parts = Sim(clock), Parts(clock)
    parts.wrap(sim, "step", "physics")
    parts.wrap(sim, "control", "controller")
    parts.wrap(sim, "reset", "reset")
    assert sim.control() == "torques"  # (the result passes through)
    sim.step()
    sim.reset()
    clock.now += 0.5  # outside every part: the rest
    assert parts.spent["controller"] == 2.5 and parts.spent["physics"] == 2.0 and parts.spent["reset"] == 7.5
    shares = parts.shares(clock.now)
    assert set(shares) == set(PARTS) and shares["the rest"] == pytest.approx(0.5 / 12.5)
    assert sum(shares.values()) == pytest.approx(1.0)
    parts.remove()
    assert "step" not in vars(sim) and "control" not in vars(sim)  # the class's own methods again
    parts.clear()
    sim.control()
    assert not any(parts.spent.values())


def test_the_compiled_substeps_physics_moves_to_physics_except_inside_a_reset():
    clock = Clock()
    sim, parts = Sim(clock), Parts(clock)

    def substeps() -> None:  # 4 s, of which 3 in the physics it reports (as the fast step's compiled call does)
        clock.now += 4.0
        parts.compiled_physics[0] += 3.0

    compiled = parts.compiled(substeps)
    parts.wrap(sim, "reset", "reset", timed=lambda reset: parts.timed("reset", lambda: (reset(), compiled())))
    compiled()
    assert parts.spent["controller"] == 1.0 and parts.spent["physics"] == 3.0
    sim.reset()  # 3 + 1 (its step) + 3.5 (its control) + 4 (the substeps inside it)
    assert parts.spent["controller"] == 1.0 and parts.spent["physics"] == 3.0 and parts.spent["reset"] == 11.5
