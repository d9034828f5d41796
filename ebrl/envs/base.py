"""The one interface every simulator adapter implements (docs/internals/design.md, "Policies and simulators").

This module, and every adapter, imports numpy and the simulator only: simulator workers may run
under a benchmark's own interpreter that has no torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ebrl.errors import BadInput


class EnvSetupError(BadInput, RuntimeError):
    """A simulator package, asset or option is missing or wrong; the message is one line saying what to do."""


class AdapterContractError(EnvSetupError):
    """An adapter broke its contract while running (a `step` that returns 4 values): no fresh simulator would do
    better, so the run stops at once (the worker answers "broken", not "error")."""


# what an EnvAdapter subclass implements, as the errors about a user's adapter say it
ADAPTER_CONTRACT = (
    "__init__(..., seed) calling EnvAdapter.__init__(self, seed) and setting self.spec (an EnvSpec), "
    "reset(seed) -> obs, step(action) -> (obs, reward, terminated, truncated, info) with obs a dict "
    "of arrays and info a dict (info['success']: bool)"
)


def describe(value: Any) -> str:
    """A returned value's shape, for a contract error: "4 values", "a list"."""
    if isinstance(value, tuple):
        kinds = ", ".join(type(v).__name__ for v in value)
        return f"{len(value)} value{'s' if len(value) != 1 else ''} ({kinds})"
    return f"a {type(value).__name__}"


# Offscreen OpenGL for MuJoCo on headless machines: EGL and OSMesa tie on CPU, and EGL also drives the NVIDIA
# driver on GPU machines, so it is the default (docs/internals/schedules.md, "Measured choices").
HEADLESS_GL = "egl"


def use_headless_gl() -> None:
    """Point MuJoCo/PyOpenGL at offscreen rendering unless the user chose a backend; call before importing mujoco."""
    backend = os.environ.setdefault("MUJOCO_GL", HEADLESS_GL)
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)


def one_line(error: BaseException) -> str:
    """EnvSetupError messages as they are; anything else as `Type: message`, on one line."""
    text = " ".join(str(error).split())
    if isinstance(error, EnvSetupError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


REWARDS = ("dense", "sparse")


def check_reward(reward: str, note: str = "") -> None:
    """Every adapter takes env.reward from the same two modes; `note` says what they mean there."""
    if reward not in REWARDS:
        raise EnvSetupError(f"env.reward={reward!r} is not available; accepted: {', '.join(REWARDS)}{note}")


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of one observation array."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32" or "uint8"


@dataclass(frozen=True)
class EnvSpec:
    """What an adapter produces and accepts, known right after construction.

    obs keys: "state" (float32 vector: proprio + object state) and, when cameras are enabled,
    "image/<camera>" (uint8 HxWx3).
    """

    obs: dict[str, ArraySpec]
    action_dim: int
    instruction: str
    max_episode_steps: int
    action_low: float = -1.0
    action_high: float = 1.0
    # where the cameras render when that is a software renderer on the CPU, and the fix ('' on a GPU, or without
    # cameras): the adapter's `software_renderer`, which the supervisor says on a GPU node; not part of what the envs
    # of a pool must agree on
    software_render: str = field(default="", compare=False)


@dataclass
class ChunkResult:
    """What executing one action chunk produced, step by step."""

    rewards: np.ndarray  # (executed,) float32
    step_times: np.ndarray  # (executed,) float64 seconds per simulator step
    successes: np.ndarray  # (executed,) bool
    terminated: bool  # the episode ended by the task (e.g. success) inside this chunk
    truncated: bool  # the episode hit its step limit inside this chunk
    episode: dict[str, float] | None = None  # return, length, success of the episode that ended
    final_obs: dict[str, np.ndarray] | None = None  # obs the episode ended on (before the auto-reset)

    @property
    def executed(self) -> int:
        return len(self.rewards)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class EnvAdapter:
    """One simulator environment. Subclasses implement `reset` and `step` and set `self.spec`.

    `run_chunk` executes an action chunk step by step, stops at the end of an episode and then
    resets (seeded), so the observation after a chunk is always the start of the next decision.
    """

    spec: EnvSpec
    # Whether the step about to run renders the cameras. The policy reads a chunk's observation once, after its last
    # step, so run_chunk clears the flag for the steps before that one (unless `render_every_step`, which the worker
    # sets from env.render_every_step) and sets it again for the reset. Adapters whose cameras can skip a frame read
    # it (and implement `render_now`); the others render at every step as before.
    render_this_step: bool = True
    render_every_step: bool = False
    # Where successive episodes' seeds start and how far apart they are (`next_seed`): an evaluation gives env i of n
    # (first + i, n), so that its episode j starts from seed first + j whatever n; None: from the env's own seed
    episode_seeds: tuple[int, int] | None = None
    # Whether reset compiles the model anew (RoboCasa samples a new kitchen): then MuJoCo's compile cache is kept
    # after the build (worker.release_build_memory), since every reset reads it.
    recompiles_on_reset: bool = False
    # How the cameras render: "egl" (MuJoCo's offscreen EGL context: the robosuite family), or "" (the adapter's own
    # way, which overrides `software_renderer` where it can tell)
    gl: str = ""

    def __init__(self, seed: int = 0) -> None:
        self._seed = int(seed)
        self._episodes = 0
        self._ep_return = 0.0
        self._ep_len = 0
        self._ep_success = False

    # --- what each simulator implements -------------------------------------------------
    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        """Returns obs, reward, terminated, truncated, info (info["success"]: bool)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the simulator; adapters keep theirs in `self.env`."""
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
            self.env = None

    @classmethod
    def all_tasks(cls, env_cfg: dict[str, Any]) -> list[str]:
        """What env.tasks=all means for this benchmark (with `env_cfg`'s other keys, e.g. LIBERO's suite): its task
        list, read without building a simulator; empty where the benchmark has no fixed list."""
        return []

    def render_now(self) -> dict[str, np.ndarray]:
        """The cameras' frames ("image/<camera>") of the current state, rendered now: the obs an episode ended on at
        a step that did not render. Adapters that never skip a frame have nothing to add."""
        return {}

    def software_renderer(self) -> str:
        """Where the cameras render when that is a software renderer on the CPU, and the fix, as a clause for the
        supervisor's line; '' on a GPU, without cameras, or where the adapter cannot tell."""
        rendered = any(key.startswith("image/") for key in self.spec.obs)
        if self.gl != "egl" or not rendered or os.environ.get("MUJOCO_GL") != "egl":
            return ""
        from ebrl.envs.egl import software_renderer

        return software_renderer()

    # --- shared by all adapters ----------------------------------------------------------
    def next_seed(self) -> int:
        """Seeds for successive episodes of this env: distinct across envs and episodes."""
        if self.episode_seeds is not None:
            first, stride = self.episode_seeds
            seed = first + stride * self._episodes
        else:
            seed = self._seed * 100_003 + self._episodes
        self._episodes += 1
        return seed

    def begin_episode(self, seed: int | None = None) -> dict[str, np.ndarray]:
        self._ep_return, self._ep_len, self._ep_success = 0.0, 0, False
        obs = self.reset(self.next_seed() if seed is None else seed)
        if not isinstance(obs, dict):  # e.g. gymnasium's (obs, info)
            raise AdapterContractError(
                f"{type(self).__qualname__}.reset returned {describe(obs)}, not the obs dict: "
                f"an adapter implements {ADAPTER_CONTRACT}"
            )
        return obs

    def run_chunk(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], ChunkResult]:
        """Execute `actions` (H, action_dim) in order; auto-reset when the episode ends. Only the steps whose
        observation is read render the cameras: the chunk's last, the one the step limit ends the episode at, and
        the reset (see `render_this_step`)."""
        if len(actions) == 0:
            raise ValueError("run_chunk needs at least one action")
        actions = np.clip(np.asarray(actions, np.float32), self.spec.action_low, self.spec.action_high)
        rewards, times, successes = [], [], []
        terminated = truncated = False
        obs: dict[str, np.ndarray] = {}
        for i, action in enumerate(actions):
            self.render_this_step = (
                self.render_every_step or i == len(actions) - 1 or self._ep_len + 1 >= self.spec.max_episode_steps
            )
            t0 = time.perf_counter()
            try:
                out = self.step(action)
            finally:
                rendered, self.render_this_step = self.render_this_step, True
            if not (isinstance(out, tuple) and len(out) == 5 and isinstance(out[0], dict) and isinstance(out[4], dict)):
                raise AdapterContractError(
                    f"{type(self).__qualname__}.step returned {describe(out)}: an adapter implements {ADAPTER_CONTRACT}"
                )
            obs, reward, terminated, truncated, info = out
            times.append(time.perf_counter() - t0)
            rewards.append(reward)
            success = bool(info.get("success", False))
            successes.append(success)
            self._ep_return += float(reward)
            self._ep_len += 1
            self._ep_success |= success
            if self._ep_len >= self.spec.max_episode_steps:
                truncated = True
            if terminated or truncated:
                break
        result = ChunkResult(
            rewards=np.asarray(rewards, np.float32),
            step_times=np.asarray(times, np.float64),
            successes=np.asarray(successes, bool),
            terminated=bool(terminated),
            truncated=bool(truncated and not terminated),
        )
        if result.done:
            result.episode = {"return": self._ep_return, "length": self._ep_len, "success": float(self._ep_success)}
            # ended by the task before the chunk's last step: that step did not render
            result.final_obs = obs if rendered else {**obs, **self.render_now()}
            obs = self.begin_episode()
        return obs, result
