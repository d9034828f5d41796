"""GRPO over action chunks: PPO's clipped loss with group-relative episode returns instead of a critic.

Each iteration every env runs one episode; the K envs of a group (env i is in group i // K) start
from the same seeded reset, so their returns differ only by what the policy sampled. Every
executed action of an episode gets A = (R - mean of its group) / (std of its group + eps). There
is no value loss and no GAE: the policy's value head is left untrained.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ebrl.rl.ppo import PPOTrainer, RolloutBatch

EPS = 1e-6  # a group whose K returns are equal carries no signal: its advantages stay 0


def group_seeds(seed: int, iteration: int, num_envs: int, group_size: int) -> list[int]:
    """Reset seed of each env for one iteration: equal within a group, distinct across groups and
    iterations, a function of (seed, iteration, group) only; below 2**31 for every simulator."""
    groups = num_envs // group_size
    return [(seed * 1_000_003 + iteration * groups + i // group_size) % 2**31 for i in range(num_envs)]


def first_episode(done: torch.Tensor) -> torch.Tensor:
    """(T, N) bool: the chunk step belongs to each env's first episode (up to and with its first done)."""
    return (done.long().cumsum(0) - done.long()) == 0


def finished(batch: RolloutBatch) -> torch.Tensor:
    """(N,) bool: the env's first episode ended, and not because its simulator failed (that episode was discarded).
    A group's members: whether the episode's steps are in the loss (staleness may mask them) does not matter."""
    alive = first_episode(batch.done)
    ended = (batch.done & alive).any(0)
    return ended if batch.failed is None else ended & ~(batch.failed & alive).any(0)


def group_advantages(
    reward: torch.Tensor, done: torch.Tensor, group_size: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (advantages (T, N), episode returns (N,), within-group std (N // K,)).

    R = the rewards of each env's first episode; A = (R - group mean) / (group std + EPS),
    broadcast to that episode's chunk steps and 0 after it (the std is the population std, so a
    group's advantages have unit variance), and 0 for a group whose std is within EPS. `valid` (N,)
    bool leaves envs out of their group's mean and std, with advantage 0: an episode whose
    simulator failed never finished.
    """
    T, N = reward.shape
    if N % group_size:
        raise ValueError(f"{N} envs do not split into groups of {group_size}")
    alive = first_episode(done)
    ret = (reward * alive).sum(0)
    # float64: the mean of K bitwise-equal float32 returns is then exactly their value (in float32 it can be an ulp
    # off, which / (0 + EPS) turned into |A| ~ 0.2 of one sign for the whole group)
    groups = ret.double().view(N // group_size, group_size)
    members = torch.ones_like(groups) if valid is None else valid.view_as(groups).to(groups.dtype)
    n = members.sum(1, keepdim=True).clamp_min(1.0)
    mean = (groups * members).sum(1, keepdim=True) / n
    std = ((groups - mean).pow(2) * members).sum(1, keepdim=True).div(n).sqrt()
    std = std.to(reward.dtype)
    signal = (std > EPS).to(groups.dtype)  # a spread within EPS is a tie (what groups_without_signal counts)
    adv = ((groups - mean) / (std + EPS) * members * signal).to(reward.dtype).view(N)
    return adv.unsqueeze(0) * alive, ret, std.squeeze(1)


class GRPOTrainer(PPOTrainer):
    """PPOTrainer whose advantages are group-normalised episode returns; no critic, no value loss.

    Expects a rollout of one episode per env from grouped seeded resets (`collect(reset_seeds=...)`).
    """

    def update(
        self,
        batch: RolloutBatch,
        decoupled: bool = False,
        is_clip: float = 2.0,
        critic_only: bool = False,
        version: int | None = None,
    ) -> dict[str, float]:
        # only the first episode of each env counts: anything after it would belong to another start
        alive = first_episode(batch.done)
        return super().update(
            replace(batch, mask=batch.mask & alive.unsqueeze(-1)), decoupled, is_clip, version=version
        )  # (no critic to warm up)

    def advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, None, dict[str, float]]:
        adv, ret, std = group_advantages(batch.reward, batch.done, self.cfg.group_size, finished(batch))
        metrics = {
            "train/return_mean": float(ret.mean()),
            "train/group_return_std": float(std.mean()),  # 0: no group had a signal
            "train/groups_without_signal": float((std <= EPS).float().mean()),
        }
        return adv, None, metrics
