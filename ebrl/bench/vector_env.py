"""An EnvAdapter as a plain `gymnasium.Env`, so gymnasium's AsyncVectorEnv can serve as an external reference.

Imports numpy, gymnasium and the adapter's module only: AsyncVectorEnv's spawned children unpickle
`make_adapter_env` from here, and should not pay for torch.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium
import numpy as np

from ebrl.envs.base import EnvAdapter, use_headless_gl
from ebrl.envs.process import build_adapter, worker_environment


class AdapterEnv(gymnasium.Env):
    """One EnvAdapter behind gymnasium's reset/step, truncated at the adapter's max_episode_steps."""

    def __init__(self, adapter: EnvAdapter) -> None:
        self.adapter = adapter
        spec = adapter.spec
        self.observation_space = gymnasium.spaces.Dict(
            {
                key: gymnasium.spaces.Box(
                    low=0 if a.dtype == "uint8" else -np.inf,
                    high=255 if a.dtype == "uint8" else np.inf,
                    shape=a.shape,
                    dtype=np.dtype(a.dtype),
                )
                for key, a in spec.obs.items()
            }
        )
        self.action_space = gymnasium.spaces.Box(spec.action_low, spec.action_high, (spec.action_dim,), np.float32)
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
        super().reset(seed=seed)
        self._steps = 0
        return self.adapter.begin_episode(seed), {}

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        action = np.clip(np.asarray(action, np.float32), self.adapter.spec.action_low, self.adapter.spec.action_high)
        obs, reward, terminated, truncated, info = self.adapter.step(action)
        self._steps += 1
        truncated = bool(truncated or self._steps >= self.adapter.spec.max_episode_steps)
        return obs, float(reward), bool(terminated), truncated, {"success": bool(info.get("success", False))}

    def close(self) -> None:
        self.adapter.close()


def make_adapter_env(env_cfg: dict[str, Any], seed: int) -> AdapterEnv:
    """Build the adapter as a SimWorker would (one thread, headless GL if cameras), wrapped for gymnasium."""
    for name, value in worker_environment().items():
        os.environ.setdefault(name, value)
    if env_cfg.get("cameras"):
        use_headless_gl()
    return AdapterEnv(build_adapter(env_cfg, seed))
