"""What RL needs from every policy family (DESIGN.md section 5).

Observation batches are dicts of tensors:
  "state"        (B, S) float32       proprio + object state, S = env_spec.obs["state"].shape[0]
  "image/<cam>"  (B, H, W, 3) uint8   one key per camera, only when the env has cameras
  "tokens"       (B, L) int64         the task instruction, from `Policy.tokenize`
  "token_mask"   (B, L) bool          True on real tokens
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ebrl.envs.base import EnvSpec


@dataclass
class PolicySample:
    """One sampled action chunk per batch row."""

    chunk: torch.Tensor  # (B, H, action_dim) actions to execute, env action dims only
    log_prob: torch.Tensor  # (B, H) log-density of each action of the chunk under the sampling chain
    value: torch.Tensor  # (B,) state value estimate
    extras: dict[str, torch.Tensor]  # what `evaluate` needs to recompute log_prob (e.g. the denoising chain)


class Policy(nn.Module):
    """sample(obs) -> chunk, log-prob, value; evaluate(obs, chunk, extras) -> log-prob, entropy, value."""

    env_spec: EnvSpec
    chunk_len: int  # H: actions per chunk
    action_dim: int  # env action dims

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Instruction strings -> (tokens (B, L) int64, mask (B, L) bool)."""
        raise NotImplementedError

    @torch.no_grad()
    def sample(self, obs: dict[str, torch.Tensor]) -> PolicySample:
        raise NotImplementedError

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) state values only: bootstrapping where an episode was cut off by its step limit."""
        raise NotImplementedError

    def evaluate(
        self, obs: dict[str, torch.Tensor], chunk: torch.Tensor, extras: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns log_prob (B, H), entropy (B, H), value (B,), with gradients.

        For the same obs and extras it reproduces `sample`'s log_prob (up to float error).
        """
        raise NotImplementedError
