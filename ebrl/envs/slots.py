"""The shared-memory slot of one simulator (docs/internals/design.md, "Processes and what crosses between them"): its
observation, the chunk's actions and each step's results in one block, laid out alike by the supervisor and the
simulator process. This module imports numpy and the standard library only (it runs under a benchmark's interpreter).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from ebrl.envs.base import EnvSpec

HEADER = ("executed", "terminated", "truncated", "has_final")
_ALIGN = 64


# --- shared memory layout ---------------------------------------------------------------
@dataclass(frozen=True)
class SlotLayout:
    """Where each array of one environment's slot lies in its shared-memory block.

    Arrays: obs/<key> and final/<key> (the obs an episode ended on) per observation key,
    actions (k, action_dim) float32, rewards (k,) float32, step_times (k,) float64,
    successes (k,) bool, header (4,) int32: executed, terminated, truncated, has_final, clock (2,)
    float64: time.perf_counter() when the chunk's first step began and its last ended (CLOCK_MONOTONIC,
    one clock for every process of the node, so a trace can set envs side by side). k: `execute`, the actions of
    a chunk the env executes (policy.execute).
    """

    fields: tuple[tuple[str, tuple[int, ...], str, int], ...]  # name, shape, dtype, byte offset
    size: int

    @classmethod
    def build(cls, spec: EnvSpec, execute: int) -> "SlotLayout":
        arrays: list[tuple[str, tuple[int, ...], str]] = [("header", (len(HEADER),), "int32")]
        arrays += [(f"obs/{key}", tuple(a.shape), a.dtype) for key, a in spec.obs.items()]
        arrays += [(f"final/{key}", tuple(a.shape), a.dtype) for key, a in spec.obs.items()]
        arrays += [
            ("actions", (execute, spec.action_dim), "float32"),
            ("rewards", (execute,), "float32"),
            ("step_times", (execute,), "float64"),
            ("successes", (execute,), "bool"),
            ("clock", (2,), "float64"),
        ]
        fields, offset = [], 0
        for name, shape, dtype in arrays:
            fields.append((name, shape, dtype, offset))
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return cls(tuple(fields), max(offset, _ALIGN))

    def views(self, buffer: memoryview) -> dict[str, np.ndarray]:
        """numpy arrays over `buffer`, one per field; both processes build the same ones."""
        return {
            name: np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            for name, shape, dtype, offset in self.fields
        }


def attach_shared_memory(name: str) -> SharedMemory:
    """Map a block the parent created and owns, without registering it with this process's resource tracker (Python
    < 3.13 registers attached blocks too): the tracker would unlink the parent's block when this worker exits, and a
    worker killed between registering and unregistering (a stop's kill) left a tracker to do so with a warning."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *args: None  # (SharedMemory looks it up as it attaches)
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def split_views(views: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix) :]: view for name, view in views.items() if name.startswith(prefix)}


@dataclass(frozen=True)
class Slot:
    """The parent's views of one env's shared-memory block (see `SlotLayout`)."""

    obs: dict[str, np.ndarray]  # the next decision's observation
    final: dict[str, np.ndarray]  # the obs an episode ended on (before the auto-reset)
    actions: np.ndarray  # (H, action_dim) float32: the chunk to run
    rewards: np.ndarray
    step_times: np.ndarray
    successes: np.ndarray
    header: np.ndarray  # executed, terminated, truncated, has_final
    clock: np.ndarray  # the chunk's first step began, its last ended (perf_counter)

    @classmethod
    def of(cls, views: dict[str, np.ndarray]) -> "Slot":
        return cls(
            split_views(views, "obs/"),
            split_views(views, "final/"),
            views["actions"],
            views["rewards"],
            views["step_times"],
            views["successes"],
            views["header"],
            views["clock"],
        )
