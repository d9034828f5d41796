"""The benchmark's straggler knob: some envs of a pool step slower, so step-time variance rises.

`StragglerEnv` wraps the configured adapter (`inner_target`). Env i of a pool (seed = pool seed * 1000 + i // G, as
SimWorkerPool and the gymnasium reference give them; G is a GRPO group's size, else 1) is a straggler when
seed % 1000 < `straggler_envs`, so under GRPO `straggler_envs` counts whole groups (the benchmark sets it so): it runs
`straggler_task` (default: the same task) with `control_freq // straggler_slowdown`, i.e. that many times the
physics substeps (and controller updates) per action. robosuite's tasks differ little in step cost (measured on
2 CPU cores: Lift 8.6, Stack 9.2, Door 7.4, NutAssemblySquare 9.0, PickPlaceCan 10.0 ms/step), so a task
mix alone barely moves the variance; the substeps do. A straggler reports the base task's spec (its state
vector padded with zeros or cut to the base's length, the base's instruction), so the pool's envs agree and one
policy drives them all: with another task the figures are throughput, not learning; with the same task (only its
control rate lower) the learning benchmark learns on it (`python -m ebrl.bench.learning --stragglers`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ebrl.envs.base import EnvAdapter, EnvSetupError
from ebrl.envs.process import load_adapter_class


def with_stragglers(cfg: Any, units: int, task: str | None, slowdown: int, after_steps: int = 0) -> Any:
    """A validated run config whose env is `StragglerEnv` around the configured one, `units` of its seeds slowed.
    The env schema has no straggler keys, so this goes on with the config as a plain one, whose env keys all reach
    the adapter's constructor."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.env.inner_target = cfg.env._target_
    cfg.env._target_ = f"{__name__}.StragglerEnv"
    cfg.env.straggler_envs, cfg.env.straggler_task = units, task
    cfg.env.straggler_slowdown, cfg.env.straggler_after_steps = slowdown, after_steps
    return cfg


class StragglerEnv(EnvAdapter):
    """The inner adapter as configured, or, for the first `straggler_envs` envs of a pool, a slower one; with
    `straggler_after_steps` the stragglers start like the others and slow down at their first reset after that many
    steps (the demand shifts mid-run, as when a curriculum moves on to contact-rich tasks)."""

    def __init__(
        self,
        inner_target: str,
        straggler_envs: int = 0,
        straggler_task: str | None = None,
        straggler_slowdown: int = 3,
        straggler_after_steps: int = 0,
        seed: int = 0,
        **inner: Any,
    ) -> None:
        super().__init__(seed)
        if straggler_slowdown < 1:
            raise EnvSetupError(f"straggler_slowdown={straggler_slowdown} must be >= 1")
        self._cls, self._inner, self._task = load_adapter_class(inner_target), inner, straggler_task
        self._slowdown, self._after = straggler_slowdown, straggler_after_steps
        self.straggler = seed % 1000 < straggler_envs
        self.slow = False  # stepping the slower variant now
        self.steps = 0
        self.env = self._cls(**inner, seed=seed)
        self.spec = self.env.spec  # a straggler keeps the base task's spec
        if self.straggler and not self._after:
            self._slow_down()

    def _slow_down(self) -> None:
        slow = dict(self._inner, task=self._task or self._inner["task"])
        if "control_freq" in slow:
            slow["control_freq"] = max(1, slow["control_freq"] // self._slowdown)
        env = self._cls(**slow, seed=self._seed)
        if env.spec.action_dim != self.spec.action_dim:
            env.close()
            raise EnvSetupError(
                f"straggler_task={self._task!r} takes {env.spec.action_dim}-d actions, "
                f"the base task {self.spec.action_dim}-d; choose a task of the same robot"
            )
        self.env.close()
        self.env, self.slow = env, True

    def _fit(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.slow:
            return obs
        n = self.spec.obs["state"].shape[0]
        state = np.zeros(n, np.float32)
        state[: min(n, len(obs["state"]))] = obs["state"][:n]
        return {**obs, "state": state}

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        if self.straggler and not self.slow and self.steps >= self._after:
            self._slow_down()
        return self._fit(self.env.reset(seed))

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._fit(obs), reward, terminated, truncated, info
