"""Weights that come from a file: a family's published checkpoint (`policy.checkpoint`), checked key by key against
the policy before anything is loaded.

`policy.checkpoint` is a file or a folder as its writer left it:
- a safetensors file, or a folder with `model.safetensors` (openpi's JAX-to-PyTorch converter output and its PyTorch
  training checkpoints, lerobot's `save_pretrained`), or with HF's sharded `model-0000N-of-0000M.safetensors` and
  their `model.safetensors.index.json` (NVIDIA's GR00T release, OpenVLA);
- a lerobot training output's step folder, whose `pretrained_model/` holds the above.
The folder's other files (config.json, normalisation statistics, tokenizer) are read by the family (`Policy.
import_state_dict` maps names; ebrl/policies/build.py passes the folder to the constructor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ebrl.errors import BadInput


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint that is missing, corrupt or made for another policy; the message is one line."""


def check_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], source: str, may_miss: tuple[str, ...] = ()
) -> None:
    """One line naming the first mismatched keys, or nothing when `state` fits `model` (keys under the prefixes in
    `may_miss` may be absent)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(may_miss)]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} with other shapes (e.g. {'; '.join(shapes[:3])})")
    if problems:
        raise CheckpointError(f"{source} does not fit this policy: keys " + ", ".join(problems))


SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def checkpoint_folder(path: str) -> Path | None:
    """The folder holding a checkpoint's files (config.json, statistics, tokenizer): the folder given (or its
    `pretrained_model/`), or the folder of the file given; None when the path does not exist."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.parent
    if not p.is_dir():
        return None
    return (
        p / "pretrained_model"
        if (p / "pretrained_model" / SINGLE).is_file() or (p / "pretrained_model" / INDEX).is_file()
        else p
    )


def checkpoint_config(path: str) -> dict:
    """The checkpoint folder's config.json (lerobot's policy config, openpi's converter record), or {}."""
    folder = checkpoint_folder(path)
    try:
        return json.loads((folder / "config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        return {}


def weight_files(path: str) -> list[Path]:
    """The safetensors files a `policy.checkpoint` path names: the file, the folder's model.safetensors, or the
    shards its index lists; one line when there is none."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    folder = checkpoint_folder(path)
    if folder is None:
        raise CheckpointError(
            f"policy.checkpoint={path} does not exist; give a local checkpoint folder or .safetensors file"
        )
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{folder / INDEX} is not a safetensors index ({type(e).__name__})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{folder / INDEX} lists {len(missing)} shards that are not there (e.g. {', '.join(missing[:3])})"
            )
        return [folder / s for s in shards]
    raise CheckpointError(
        f"policy.checkpoint={path} holds no {SINGLE} or {INDEX}; give the checkpoint folder "
        "its writer saved, or a .safetensors file"
    )


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint `path` names, in one flat dict under the file's own names."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise CheckpointError(
                f"policy.checkpoint={path}: {f.name} is not a readable safetensors file ({type(e).__name__})"
            ) from None
    return state


def load_weights(model: nn.Module, path: str) -> list[str]:
    """Start a `Policy` from a local checkpoint (policy.checkpoint=...): the policy's own keys, or its family's
    published layout as `Policy.import_state_dict` maps it. Returns the prefixes the file had nothing for (the RL heads
    a published checkpoint lacks); their parameters are left as they were."""
    state, may_miss = model.import_state_dict(model.read_checkpoint(path))
    check_state_dict(model, state, f"policy.checkpoint={path}", tuple(may_miss))
    model.load_state_dict(state, strict=False)
    return [prefix for prefix in may_miss if not any(k.startswith(prefix) for k in state)]
