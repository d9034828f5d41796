"""What RL needs from every policy family (docs/internals/design.md, "Policies and simulators").

Observation batches are dicts of tensors:
  "state"        (B, S) float32       proprio + object state, S = env_spec.obs["state"].shape[0]
  "image/<cam>"  (B, H, W, 3) uint8   one key per camera, only when the env has cameras
  "tokens"       (B, L) int64         the task instruction, from `Policy.tokenize`
  "token_mask"   (B, L) bool          True on real tokens
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import numpy as np
import torch
from torch import nn

from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.policies.weights import read_weights


def masked_mean(error: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of a (B, H) per-action loss over the actions `mask` keeps (all of them without one)."""
    if mask is None:
        return error.mean()
    m = mask.to(error.device, error.dtype)
    return (error * m).sum() / m.sum().clamp_min(1.0)


def preset_dims(presets: dict[str, Any], preset: str, dims: dict[str, int] | None = None) -> Any:
    """The sizes of `policy.preset`, with `policy.dims` (a checkpoint at sizes of its own) replacing some; one line
    for an unknown preset or size."""
    if preset not in presets:
        raise ConfigError(f"policy.preset={preset!r} is not available; accepted: {', '.join(presets)}")
    d = presets[preset]
    if dims:
        known = [f.name for f in dataclasses.fields(d)]
        unknown = [k for k in dims if k not in known]
        if unknown:
            raise ConfigError(f"policy.dims has no size {', '.join(unknown)}; accepted: {', '.join(known)}")
        d = dataclasses.replace(d, **{k: int(v) for k, v in dims.items()})
    return d


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
    execute: int  # k <= H: the actions of each chunk the env executes before the next is sampled (policy.execute)
    action_dim: int  # env action dims
    model_action_dim: int  # the model's real action dims (a checkpoint's; `to_env` maps them to the env's)
    cameras: list[str]  # the env's "image/<cam>" keys, sorted

    # a full preset may record the figure it is checked against: {variant or "default": (parameters, source)}
    PUBLISHED_PARAMETERS: dict[str, tuple[float, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        # what the matmuls run in (policy.dtype): the dtype the policy is built in, unless the trainer keeps float32
        # master weights of a bfloat16 policy (ebrl/policies/build.py)
        self.compute_dtype = torch.get_default_dtype()

    def precision(self) -> ContextManager:
        """Autocast to `compute_dtype` (a no-op in float32): a bfloat16 policy's matmuls run in bfloat16 whether its
        weights are bfloat16 (generation) or float32 masters mixed with frozen bfloat16 ones (the trainer). Every
        entry point (sample, value, evaluate, the supervised losses) runs inside it; log-densities stay float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        device = next(self.parameters()).device
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def num_parameters(self) -> int:
        """Total parameter count (works on the meta device)."""
        return sum(p.numel() for p in self.parameters())

    def rl_heads(self) -> list[str]:
        """Name prefixes of the parameters RL adds to the published model (value head, exploration noise/std)."""
        raise NotImplementedError

    def action_expert(self) -> list[str]:
        """Name prefixes of what `policy.train=action_expert` trains besides the RL heads: the parts that turn the
        backbone's features into actions."""
        raise NotImplementedError

    def lora_targets(self) -> str:
        """A regular expression over module names: the backbone's attention and MLP projections that
        `policy.train=lora` adapts."""
        raise NotImplementedError

    def init_head(self, prefix: str) -> None:
        """Initialise the head under `prefix` (an RL head, or one a published checkpoint may lack) as the constructor
        does: after a build that allocates without initialising (ebrl/policies/build.py), for what the file lacked.
        Modules get their layers' reset_parameters; families add what their constructor does on top."""
        target = getattr(self, prefix.rstrip("."), None)
        if isinstance(target, nn.Module):
            for module in target.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()

    @classmethod
    def published_names(cls, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint file's tensors (or anything keyed by their names) under the family's own names: its writers'
        prefixes removed, older names renamed; nothing dropped or added (`import_state_dict` drops and ties)."""
        return state

    def import_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """A local checkpoint's tensors under this policy's keys, and the key prefixes it may lack (the RL heads a
        published checkpoint does not have). Families whose public checkpoints name things differently map here."""
        return state, self.rl_heads()

    def bind(
        self,
        presets: dict[str, Any],
        preset: str,
        env_spec: EnvSpec,
        dims: dict[str, int] | None = None,
        state_dims: list[int] | None = None,
    ) -> Any:
        """Take this env's spec (env_spec, action_dim, the sorted camera keys) and return the dims of
        `policy.preset` (`preset_dims`); one line for an env whose state (or actions) exceed the padded max_state_dim
        (max_action_dim)."""
        d = preset_dims(presets, preset, dims)
        state_dim = env_spec.obs["state"].shape[0]
        if state_dims is not None:  # the env state dims the policy reads (policy.state_dims)
            bad = [i for i in state_dims if not 0 <= i < state_dim]
            if bad or not state_dims:
                raise ConfigError(
                    f"policy.state_dims={list(state_dims)} must pick dims of the env's state (0..{state_dim - 1})"
                )
            state_dim = len(state_dims)
        if state_dim > d.max_state_dim:
            raise ConfigError(
                f"policy.preset={preset} has max_state_dim={d.max_state_dim} < env state dim {state_dim}: "
                "use a preset with a larger max_state_dim or an env with fewer state features"
            )
        max_action_dim = getattr(d, "max_action_dim", None)
        if max_action_dim is not None and env_spec.action_dim > max_action_dim:
            raise ConfigError(
                f"policy.preset={preset} has max_action_dim={max_action_dim} < env action dim "
                f"{env_spec.action_dim}: use a preset with a larger max_action_dim"
            )
        self.env_spec, self.action_dim = env_spec, env_spec.action_dim
        self.model_action_dim = env_spec.action_dim
        self.cameras = sorted(k for k in env_spec.obs if k.startswith("image/"))
        return d

    def to_env(self, x: torch.Tensor) -> torch.Tensor:
        """The model's actions (B, H, model_action_dim) as the env takes them (a checkpoint's families un-normalise and
        map dims here); the identity by default."""
        return x

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions (demonstrations) in the model's action space: `to_env`'s inverse."""
        return actions.float()

    @classmethod
    def checkpoint_defaults(cls, folder: Path, config: dict, keys: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The family's constructor arguments completed from a checkpoint folder (its config.json as `config`, its
        tensor names as `keys`): what the user left unset. Families whose folders carry more (tokenizer,
        statistics) read them here."""
        return kwargs

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Instruction strings -> (tokens (B, L) int64, mask (B, L) bool)."""
        raise NotImplementedError

    @classmethod
    def read_checkpoint(cls, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of `policy.checkpoint` under the files' own names (`import_state_dict` maps them): the
        safetensors files (ebrl/policies/weights.py); families whose releases keep parts in other files read those."""
        return read_weights(path)

    @torch.no_grad()
    def sample(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> PolicySample:
        """deterministic: the family's noise-free action (evaluation), where it has one."""
        raise NotImplementedError

    def supervised_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The family's own imitation objective (algo=sft) on demonstrated chunks `actions` (B, H, env action dims),
        averaged over the actions `mask` (B, H) keeps (a chunk that runs past its episode's end is padded)."""
        raise NotImplementedError

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) state values only: bootstrapping where an episode was cut off by its step limit."""
        raise NotImplementedError

    def evaluate(
        self, obs: dict[str, torch.Tensor], chunk: torch.Tensor, extras: dict[str, torch.Tensor], prefix: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns log_prob (B, H), entropy (B, H), value (B,), with gradients.

        For the same obs and extras it reproduces `sample`'s log_prob (up to float error). `prefix`: these rows'
        `prefix(obs)`, computed before (a frozen prefix, `frozen_prefix`), in place of running it again.
        """
        raise NotImplementedError

    # --- the frozen prefix -------------------------------------------------------------------------
    # Name prefixes of the parameters `prefix` runs (the vision-language backbone); empty: the family keeps no prefix
    # apart from the rest of its pass
    PREFIX: tuple[str, ...] = ()

    def frozen_prefix(self) -> bool:
        """`prefix(obs)` is a constant of the observation: the family has one and none of its parameters trains
        (policy.train=action_expert), so a trainer computes it once per row and every pass over the row reuses it
        (docs/internals/design.md, "The frozen prefix")."""
        return bool(self.PREFIX) and not any(
            p.requires_grad for name, p in self.named_parameters() if name.startswith(self.PREFIX)
        )

    def prefix(self, obs: dict[str, torch.Tensor]) -> Any:
        """What the backbone (`PREFIX`'s parameters) makes of each observation, rows first (nested tensors), for
        `evaluate(..., prefix=)`; call it inside `precision()`."""
        raise NotImplementedError
