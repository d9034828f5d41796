"""Where a simulator's control step goes, part by part, as a run drives it (`python -m ebrl.bench.sim_speed`).

`Parts` replaces the callables each part runs with timed ones: methods of the adapter's own simulator objects, and
the fast step's module functions and worker classes (ebrl/envs/fast_step.py). The time inside a call is charged to
its part (a wall clock: a CPU clock is a system call, whose cost would swamp the parts); a call inside another
part's call is charged to the inner part while it runs, and everything inside a reset to the reset. What no part
claims (run_chunk, the fast step's own loop, the adapter's obs dict) is "the rest". The robosuite family only
(robosuite, LIBERO, RoboCasa): ManiSkill's step has no such seams. This module imports numpy and the simulator only:
it runs under each benchmark's interpreter.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

PARTS = ("controller", "physics", "observables", "reward and success", "reset", "the rest")


class Parts:
    """Seconds spent in each of PARTS since the last `clear`, for the adapter given to `install`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.spent = dict.fromkeys(PARTS, 0.0)
        self._stack: list[list[Any]] = []  # [part, since] of the calls running now, innermost last
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self.compiled_physics = np.zeros(1)  # what the fast step's compiled substeps spent on physics, per call

    def clear(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def shares(self, total_s: float) -> dict[str, float]:
        """Each part's share of `total_s` (the timed stretch, on the same clock); "the rest": what the others leave."""
        out = {part: s / total_s for part, s in self.spent.items() if part != "the rest"}
        out["the rest"] = 1.0 - sum(out.values())
        return out

    def timed(self, part: str, fn: Callable) -> Callable:
        stack, clock = self._stack, self.clock

        def call(*args: Any, **kwargs: Any) -> Any:
            if stack and stack[-1][0] == "reset":  # (a reset's physics and observables are the reset's)
                return fn(*args, **kwargs)
            now = clock()
            if stack:
                outer = stack[-1]
                self.spent[outer[0]] += now - outer[1]
            entry = [part, now]
            stack.append(entry)
            try:
                return fn(*args, **kwargs)
            finally:
                now = clock()
                self.spent[part] += now - entry[1]
                stack.pop()
                if stack:
                    stack[-1][1] = now

        return call

    def compiled(self, fn: Callable) -> Callable:
        """`timed("controller", fn)` for the fast step's compiled substeps, whose physics (`FastStep.physics_s`, which
        they fill) moves to the physics part."""
        timed, physics = self.timed("controller", fn), self.compiled_physics

        def call(*args: Any, **kwargs: Any) -> Any:
            physics[0] = 0.0
            in_reset = bool(self._stack) and self._stack[-1][0] == "reset"
            out = timed(*args, **kwargs)
            if not in_reset:
                self.spent["controller"] -= physics[0]
                self.spent["physics"] += physics[0]
            return out

        return call

    def wrap(self, owner: Any, name: str, part: str, timed: Callable | None = None) -> None:
        """Time `owner.name` (an object's method, a class's function or a module's) as `part` (or as `timed` makes
        it), until `remove`."""
        if not hasattr(owner, name):
            return
        own = name in vars(owner)
        original = getattr(owner, name) if not isinstance(owner, type) else vars(owner).get(name, getattr(owner, name))
        self._undo.append((owner, name, original, own))
        setattr(owner, name, timed(original) if timed is not None else self.timed(part, original))

    def install(self, benchmark: str, adapter: Any) -> None:
        """Time the parts of `adapter`'s step (stock or fast) and of its resets."""
        from ebrl.envs import fast_step

        env = adapter.env.env if benchmark == "libero" else adapter.env  # (LIBERO's ControlEnv wraps robosuite's)
        for name in ("forward", "step", "step1", "step2"):
            self.wrap(env.sim, name, "physics")
        for name in ("mj_step1", "mj_step2"):
            self.wrap(fast_step, name, "physics")
        self.wrap(env, "_pre_action", "controller")  # (the stock substeps, and the fast step's first)
        self.wrap(fast_step._PolicySubstep, "__call__", "controller")  # (or the fast step's own first)
        self.wrap(fast_step.FastStep, "_compiled_substeps", "controller", self.compiled)
        self._undo.append((fast_step.FastStep, "physics_s", None, True))
        fast_step.FastStep.physics_s = self.compiled_physics
        for worker in (
            fast_step._Osc,
            fast_step._Velocity,
            fast_step._JointPosition,
            fast_step._Osc14,
            fast_step._Grip14,
        ):
            for name in ("begin", "torques", "sync"):
                self.wrap(worker, name, "controller")
        for name in ("begin", "due", "advance", "end"):
            self.wrap(fast_step._Timers, name, "observables")
        for name in ("_update_observables", "_get_observations"):
            self.wrap(env, name, "observables")
        self.wrap(adapter, "_obs", "observables")
        for name in ("_post_action", "_check_success"):
            self.wrap(env, name, "reward and success")
        self.wrap(adapter, "begin_episode", "reset")

    def remove(self) -> None:
        for owner, name, original, own in reversed(self._undo):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._undo.clear()
