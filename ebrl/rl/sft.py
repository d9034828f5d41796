"""Supervised fine-tuning on demonstrations (`algo=sft`), the step before RL: each family's own imitation objective
(`Policy.supervised_loss`: flow matching for openpi, gr00t and wam; L1 for OpenVLA-OFT's head) on (observation,
action chunk) samples, AdamW over what `policy.train` trains. The RL heads (value head, exploration noise) are in no
supervised loss, so they get no gradient and keep their initialisation: RL's critic warm-up (`algo.critic_warmup`)
trains the value head first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ebrl.config import AlgoConfig
from ebrl.policies.base import Policy
from ebrl.rl.optim import make_optimizer
from ebrl.rl.ppo import param_groups

VALID_SEED = 1234  # the held-out loss draws the same noise and flow times at every measurement


@dataclass
class DemoBatch:
    """Samples of demonstrations: the observation at a step and the H actions taken from it."""

    obs: dict[str, torch.Tensor]  # each (B, ...)
    actions: torch.Tensor  # (B, H, env action dims)
    mask: torch.Tensor  # (B, H) bool: the action was in the episode (not padding past its end)

    def rows(self, index: torch.Tensor) -> "DemoBatch":
        return DemoBatch({k: v[index] for k, v in self.obs.items()}, self.actions[index], self.mask[index])

    def __len__(self) -> int:
        return len(self.actions)


class _Supervised(torch.nn.Module):
    """The policy's supervised loss as a module's forward, so that DDP (which hooks forward) sees the pass."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.policy.supervised_loss(obs, actions, mask)


class SFTTrainer:
    """One optimizer step per `update`, on a batch of demonstration samples; `validate` measures the loss without
    a step. Data-parallel over `group` (DDP) when given."""

    def __init__(
        self,
        policy: Policy,
        cfg: AlgoConfig,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.policy, self.cfg = policy, cfg
        self.device = device or torch.device("cpu")
        self.model: torch.nn.Module = _Supervised(policy)
        if group is not None:
            ids = [self.device] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(
                self.model, device_ids=ids, process_group=group, find_unused_parameters=True
            )
        self.optimizer = make_optimizer(
            param_groups(policy, cfg),
            cfg.lr,
            cfg.get("optimizer_dtype", "float32"),
            cfg.adam_betas,
            cfg.adam_eps,
            cfg.weight_decay,
        )
        self.trained = [p for g in self.optimizer.param_groups for p in g["params"]]

    def _to(self, batch: DemoBatch) -> DemoBatch:
        return DemoBatch(
            {k: v.to(self.device) for k, v in batch.obs.items()},
            batch.actions.to(self.device),
            batch.mask.to(self.device),
        )

    def update(self, batch: DemoBatch) -> dict[str, float]:
        """One step on `batch`, in `algo.micro_batch` rows at a time (their gradients add up to the batch's)."""
        batch = self._to(batch)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows = self.cfg.get("micro_batch") or len(batch)
        parts = torch.arange(len(batch), device=self.device).split(rows)
        total = 0.0
        for i, part in enumerate(parts):
            sub = batch.rows(part)
            with self._sync(i == len(parts) - 1):
                loss = self.model(sub.obs, sub.actions, sub.mask) * (len(part) / len(batch))
                loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trained, self.cfg.max_grad_norm))
        if grad_norm == grad_norm and grad_norm != float("inf"):
            self.optimizer.step()
        self.policy.eval()
        return {"losses/sft": total, "train/grad_norm": grad_norm}

    def _sync(self, last: bool):  # noqa: ANN202  (a context manager)
        import contextlib

        if last or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    @torch.no_grad()
    def validate(self, batch: DemoBatch, rows: int = 256) -> float:
        """The loss on `batch` (the held-out episodes' samples), with the same random draws every time it is
        measured, `rows` at a time."""
        batch = self._to(batch)
        total = 0.0
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(VALID_SEED)
            for part in torch.arange(len(batch), device=self.device).split(rows):
                sub = batch.rows(part)
                total += float(self.policy.supervised_loss(sub.obs, sub.actions, sub.mask)) * len(part)
        return total / max(len(batch), 1)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
