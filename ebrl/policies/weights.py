"""Weights that come from a file: a family's published checkpoint (`policy.checkpoint`), checked key by key against
the policy before anything is loaded."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ebrl.policies.base import Policy


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt or made for another policy; the message is one line."""


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str,
                     may_miss: tuple[str, ...] = ()) -> None:
    """One line naming the first mismatched keys, or nothing when `state` fits `model` (keys under the prefixes in
    `may_miss` may be absent)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(may_miss)]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} with other shapes (e.g. {'; '.join(shapes[:3])})")
    if problems:
        raise CheckpointError(f"{source} does not fit this policy: keys " + ", ".join(problems))


def load_weights(model: Policy, path: str) -> list[str]:
    """Start from a local safetensors file (policy.checkpoint=...): the policy's own keys, or its family's published
    layout as `Policy.import_state_dict` maps it. Returns the prefixes the file had nothing for (the RL heads a
    published checkpoint lacks); their parameters are left as they were."""
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise CheckpointError(f"policy.checkpoint={path} does not exist; give a local .safetensors file")
    try:
        state = load_file(str(p))
    except Exception as e:
        raise CheckpointError(f"policy.checkpoint={path} is not a readable safetensors file ({type(e).__name__})")
    state, may_miss = model.import_state_dict(state)
    check_state_dict(model, state, f"policy.checkpoint={path}", tuple(may_miss))
    model.load_state_dict(state, strict=False)
    return [prefix for prefix in may_miss if not any(k.startswith(prefix) for k in state)]
