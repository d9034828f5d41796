"""What crosses between the supervisor and the processes it starts for training and generation: one small
dataclass per message, sent over a `PipedProcess`'s pipes (torch tensors inside travel as shared-memory handles).

The simulator workers speak their own protocol of plain tuples (ebrl/envs/process.py): they may run under a
benchmark's own interpreter, which has neither torch nor this module's imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ebrl.rl.rollout import RolloutBatch


# --- both ways, both processes -----------------------------------------------------------------
@dataclass(frozen=True)
class Stop:
    """Supervisor -> child: stop serving and exit."""


@dataclass(frozen=True)
class Ready:
    """Child -> supervisor, once: built and serving, holding the weights of `version` (the channel's count)."""

    version: int = 0


@dataclass(frozen=True)
class Failed:
    """Child -> supervisor: a failure, in one line; the child has ended."""

    reason: str


# --- the trainer process -----------------------------------------------------------------------
@dataclass
class Train:
    """Train on `batch` (iteration `iteration` of this run); with `gather`, rank 0's trainer then sends the `State`
    too (FSDP: every rank's gathers it)."""

    iteration: int
    batch: RolloutBatch
    decoupled: bool  # decoupled PPO: clip around the proximal policy, weight to the behaviour one
    is_clip: float  # truncation of the behaviour importance weight
    gather: bool = False  # a checkpoint is due after this update
    critic_only: bool = False  # the critic's warm-up after init: the value head alone trains
    version: int | None = None  # of the weights the update starts from, in the count of the batch's versions


@dataclass
class Trained:
    """An update finished: it ran [start, published), the weights' publication [published, end) (perf_counter)."""

    iteration: int
    metrics: dict[str, float]
    version: int  # of the published weights
    start: float
    published: float
    end: float


@dataclass(frozen=True)
class StateRequest:
    """Send the model and optimizer state after every update sent so far."""


@dataclass
class State:
    """The trainer's model and optimizer state, after update `gathered_after` (a checkpoint due then), or after
    every update sent so far (None: the answer to a `StateRequest`)."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    gathered_after: int | None = None


@dataclass
class Load:
    """Continue from this model and optimizer state (a predecessor's, handed over)."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


# --- the generation process --------------------------------------------------------------------
@dataclass
class Sample:
    """Swap in newer weights, then sample a chunk per row of `obs`; answered by a `Sampled`."""

    obs: dict[str, torch.Tensor]


@dataclass
class Sampled:
    """One call's chunks (CPU tensors, rows in the order of the observations) and the weight version that sampled."""

    chunk: torch.Tensor  # (B, H, action_dim) in the policy's dtype
    extras: dict[str, torch.Tensor]
    log_prob: torch.Tensor
    value: torch.Tensor  # float32
    version: int  # the channel's count of the weights that sampled


@dataclass
class Value:
    """Value `obs` by the weights held now, no swap; answered by `Values`."""

    obs: dict[str, torch.Tensor]


@dataclass
class Values:
    values: torch.Tensor  # (B,) float32


@dataclass(frozen=True)
class Release:
    """Let go of the trainer's device slots (it is about to be replaced); answered by `Released`."""


@dataclass(frozen=True)
class Released:
    pass
