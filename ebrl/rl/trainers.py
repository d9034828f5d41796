"""The trainer of each `algo.name`, built the same way wherever training runs: in the supervisor (colocated, and
`algo=sft`, which runs no simulator) or in the trainer process (pipelined schedules)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ebrl.policies.base import Policy
from ebrl.rl.grpo import GRPOTrainer
from ebrl.rl.ppo import PPOTrainer
from ebrl.rl.sft import SFTTrainer

TRAINERS: dict[str, type[PPOTrainer] | type[SFTTrainer]] = {
    "ppo": PPOTrainer,
    "grpo": GRPOTrainer,
    "sft": SFTTrainer,
}  # by algo.name


def make_trainer(policy: Policy, algo: Any, device: torch.device | str, group: dist.ProcessGroup | None = None) -> Any:
    """`algo.name`'s trainer of `policy` (algo: the composed `algo` config, a DictConfig), data-parallel over
    `group` when given."""
    return TRAINERS[algo.name](policy, algo, torch.device(device), group)
