"""Atomic checkpoints (temp file + rename) that refuse to load into a different policy."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ebrl.policies.base import Policy


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt or made for another policy; the message is one line."""


CHECKPOINT_FORMAT = 1


def previous_of(path: Path) -> Path:
    """Where `atomic_save(..., keep_previous=True)` keeps the file `path` held before: last.pt -> previous.pt."""
    return path.with_name("previous" + path.suffix) if path.stem == "last" else path.with_name(path.stem + ".previous"
                                                                                                + path.suffix)


def atomic_save(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """Write `obj` with torch.save so that `path` is either the old file or the complete new one; with keep_previous
    the old one moves to `previous_of(path)` first (a checkpoint that turns out unreadable has one to fall back to)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_of(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def policy_identity(policy_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config keys that must match for weights to mean the same thing."""
    return {k: policy_cfg.get(k) for k in ("name", "preset", "variant", "chunk", "denoise_steps", "logprob")}


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


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by `atomic_save`; a missing, truncated or foreign file gives one line, which names
    the previous checkpoint (`previous_of`) when that one is readable. Nothing is moved or deleted."""
    try:
        return _read(path)
    except CheckpointError as e:
        try:
            iteration = _read(previous_of(path)).get("iteration")
        except CheckpointError:
            raise e from None
        raise CheckpointError(f"{e}; {previous_of(path)} (iteration {iteration}) is intact: move it to {path} to "
                              "start from it") from None


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for truncated/corrupt files
        first = str(e).splitlines()[0][:120] if str(e) else ""
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not an EBRL checkpoint (format {CHECKPOINT_FORMAT})")
    return ckpt


def checkpoint_file(path: str | Path) -> Path:
    """The checkpoint a path names: a run folder's checkpoints/last.pt, or the file itself."""
    p = Path(path).expanduser()
    return p / "checkpoints" / "last.pt" if p.is_dir() else p


def load_policy_checkpoint(path: Path, policy_cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A checkpoint (`load_checkpoint`) made for the policy `policy_cfg` configures; otherwise one line that starts
    with `source` (the key that named it, e.g. "resume=runs/...") and names the policy keys that differ."""
    ckpt = load_checkpoint(path)
    want, have = policy_identity(policy_cfg), ckpt["policy"]
    if want != have:
        diff = ", ".join(f"policy.{k}={have[k]} (asked {want[k]})" for k in want if want[k] != have[k])
        raise CheckpointError(f"{source} holds a checkpoint of another policy: {diff}")
    return ckpt


def restore_weights(model: Policy, ckpt: dict[str, Any], source: str) -> None:
    """Load a checkpoint's weights into `model`, or one line (starting with `source`) naming keys that do not fit."""
    check_state_dict(model, ckpt["model"], source)
    model.load_state_dict(ckpt["model"])


def load_weights(model: Policy, path: str) -> None:
    """Start from a local safetensors file (policy.checkpoint=...): the policy's own keys, or its family's published
    layout as `Policy.import_state_dict` maps it; the RL heads may be absent and then keep their initialisation."""
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
