"""The benchmark's straggler knob: some envs of a pool step slower, so step-time variance rises.

`StragglerEnv` wraps the configured adapter (`inner_target`). Env i of a pool (seed = pool seed * 1000 + i, as
SimWorkerPool and the gymnasium reference give them) is a straggler when i % 1000 < `straggler_envs`: it runs
`straggler_task` (default: the same task) with `control_freq // straggler_slowdown`, i.e. that many times the
physics substeps (and controller updates) per action. robosuite's tasks differ little in step cost (measured on
2 CPU cores: Lift 8.6, Stack 9.2, Door 7.4, NutAssemblySquare 9.0, PickPlaceCan 10.0 ms/step), so a task
mix alone barely moves the variance; the substeps do. A straggler reports the base task's spec (its state
vector padded with zeros or cut to the base's length, the base's instruction), so the pool's envs agree and one
policy drives them all: the figures are throughput, not learning.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ebrl.envs.base import EnvAdapter, EnvSetupError
from ebrl.envs.worker import load_adapter_class


class StragglerEnv(EnvAdapter):
    """The inner adapter as configured, or, for the first `straggler_envs` envs of a pool, a slower one."""

    def __init__(self, inner_target: str, straggler_envs: int = 0, straggler_task: str | None = None,
                 straggler_slowdown: int = 3, seed: int = 0, **inner: Any) -> None:
        super().__init__(seed)
        if straggler_slowdown < 1:
            raise EnvSetupError(f"straggler_slowdown={straggler_slowdown} must be >= 1")
        cls = load_adapter_class(inner_target)
        self.straggler = seed % 1000 < straggler_envs
        if not self.straggler:
            self.env = cls(**inner, seed=seed)
            self.spec = self.env.spec
            return
        base = cls(**inner, seed=seed)  # built once for its spec, which the straggler must match
        self.spec = base.spec
        base.close()
        slow = dict(inner, task=straggler_task or inner["task"])
        if "control_freq" in slow:
            slow["control_freq"] = max(1, slow["control_freq"] // straggler_slowdown)
        self.env = cls(**slow, seed=seed)
        if self.env.spec.action_dim != self.spec.action_dim:
            raise EnvSetupError(f"straggler_task={straggler_task!r} takes {self.env.spec.action_dim}-d actions, "
                                f"the base task {self.spec.action_dim}-d; choose a task of the same robot")

    def _fit(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.straggler:
            return obs
        n = self.spec.obs["state"].shape[0]
        state = np.zeros(n, np.float32)
        state[: min(n, len(obs["state"]))] = obs["state"][:n]
        return {**obs, "state": state}

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        return self._fit(self.env.reset(seed))

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._fit(obs), reward, terminated, truncated, info
