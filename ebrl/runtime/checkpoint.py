"""Atomic checkpoints (temp file + rename) that refuse to load into a different policy."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from ebrl.errors import DiskFull, free_bytes, is_disk_full, megabytes
from ebrl.policies.base import Policy
from ebrl.policies.training import load_state, lora_scaling, merge_lora, split_lora
from ebrl.policies.weights import CheckpointError, check_state_dict
from ebrl.rl.rollout import new_tensor

CHECKPOINT_FORMAT = 1


def previous_of(path: Path) -> Path:
    """Where `atomic_save(..., keep_previous=True)` keeps the file `path` held before: last.pt -> previous.pt."""
    return (
        path.with_name("previous" + path.suffix)
        if path.stem == "last"
        else path.with_name(path.stem + ".previous" + path.suffix)
    )


def state_nbytes(obj: Any) -> int:
    """The bytes of the tensors and arrays in `obj` (nested): about what torch.save writes of it."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return int(getattr(obj, "nbytes", 0) or 0)


def intact(path: Path) -> str:
    """The newest intact checkpoint beside a write of `path` that failed (the write never replaces it until whole)."""
    kept = [p for p in (path, previous_of(path)) if p.exists()]
    if not kept:
        return "no checkpoint was written before"
    try:
        iteration = torch.load(kept[0], map_location="cpu", weights_only=False, mmap=True).get("iteration")
    except Exception:  # (not ours, or unreadable: name the files only)
        iteration = None
    at = f" (iteration {iteration})" if iteration is not None else ""
    return (
        " and ".join(f"{p}{at if p == kept[0] else ''}" for p in kept)
        + (" are" if len(kept) > 1 else " is")
        + " intact"
    )


def atomic_save(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """Write `obj` with torch.save so that `path` is either the old file or the complete new one; with keep_previous
    the old one moves to `previous_of(path)` first (a checkpoint that turns out unreadable has one to fall back to).
    A disk without room for it raises `DiskFull` (before writing when the free space is short already)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    need, free = state_nbytes(obj), free_bytes(path.parent)
    if need > free:
        raise DiskFull(
            f"the disk is full at {path.parent}: the checkpoint needs {megabytes(need)} and "
            f"{megabytes(free)} is free; {intact(path)}"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_of(path))
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, Exception) and is_disk_full(e):
            raise DiskFull(
                f"the disk filled up at {path.parent} while the checkpoint was written (about "
                f"{megabytes(need)}; {megabytes(free_bytes(path.parent))} free after the partial file was "
                f"removed); {intact(path)}"
            ) from e
        raise


def detached_copy(obj: Any, shared: bool = False) -> Any:
    """A copy of a state dict's tensors, nested ones too (Adam's moments), on the host: what a checkpoint holds while
    training goes on changing the originals in place. One copy per tensor, from the device too; `shared`: made in
    shared memory, so that a pipe to another process passes a handle, not torch's own copy into a new segment."""
    if isinstance(obj, torch.Tensor):
        return new_tensor(obj.shape, obj.dtype, shared).copy_(obj.detach())
    if isinstance(obj, dict):
        return {k: detached_copy(v, shared) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached_copy(v, shared) for v in obj)
    return obj


class CheckpointWriter:
    """Checkpoints written off the loop's critical path: `save` hands a checkpoint to a thread that writes it as
    `atomic_save` does (temp file, fsync, rename, the one before kept as previous.pt) and returns. The next save and
    `wait` wait for the write in flight; a failed write raises there."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._warned = False

    def save(self, obj: Any, path: Path, keep_previous: bool = True) -> None:
        """Write `obj` (whose tensors nothing changes any more: a copy) to `path` in the background; once, a warning
        when the disk has less room than two such checkpoints."""
        self.wait()
        path.parent.mkdir(parents=True, exist_ok=True)
        need, free = state_nbytes(obj), free_bytes(path.parent)
        if free < 2 * need and not self._warned:
            from ebrl.telemetry.report import console

            self._warned = True
            console.print(
                f"warning: {megabytes(free)} free at {path.parent}, less than two checkpoints "
                f"({megabytes(need)} each): when the disk fills the run stops, keeping the last intact one",
                soft_wrap=True,
            )
        self._thread = threading.Thread(target=self._write, args=(obj, path, keep_previous), name="ebrl-checkpoint")
        self._thread.start()

    def _write(self, obj: Any, path: Path, keep_previous: bool) -> None:
        try:
            atomic_save(obj, path, keep_previous)
        except BaseException as e:  # noqa: BLE001  (raised in the loop's thread by wait)
            self._error = e

    def wait(self) -> None:
        """Until the write in flight is on disk; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


IDENTITY = ("name", "preset", "variant", "chunk", "denoise_steps", "logprob", "train")


def policy_identity(policy_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config keys that must match for weights (and their optimizer state) to mean the same thing."""
    return {k: policy_cfg.get(k) or ("all" if k == "train" else None) for k in IDENTITY}


def model_entries(state: dict[str, torch.Tensor], policy_cfg: dict[str, Any]) -> dict[str, Any]:
    """A trainer's state dict as a checkpoint holds it: "model" in the family's layout (what evaluation and
    generation load), "lora" the adapters apart with their "lora_scaling" (so that training resumes as it was)."""
    base, lora = split_lora(state)
    return {"model": base, "lora": lora, "lora_scaling": lora_scaling(policy_cfg)}


def checkpoint_record(
    conf: dict[str, Any],
    model: dict[str, torch.Tensor],
    optimizer: dict,
    iteration: int,
    env_steps: int,
    wandb_id: str | None,
) -> dict[str, Any]:
    """What a run's checkpoint holds (RL and SFT runs alike): the policy's identity and weights, the optimizer state,
    the counts, this process's generators and the resolved config."""
    import numpy as np

    return {
        "format": CHECKPOINT_FORMAT,
        "norm_stats": norm_stats_table(conf["policy"]),
        "policy": policy_identity(conf["policy"]),
        **model_entries(model, conf["policy"]),
        "optimizer": optimizer,
        "iteration": iteration,
        "env_steps": env_steps,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "wandb_id": wandb_id,
        "config": conf,
    }


NORM_STATS = "norm_stats.json"


def norm_stats_table(policy_cfg: dict[str, Any]) -> dict | None:
    """The statistics the policy normalises with, as openpi's norm_stats.json holds them (an SFT run computes them
    from its demos), for the checkpoint to carry; None for none, or for a file in another layout (which stays where
    policy.norm_stats names it)."""
    path = policy_cfg.get("norm_stats")
    if not path or not str(path).endswith(".json") or Path(path).name == "policy_preprocessor.json":
        return None
    try:
        return json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError):
        return None


def adopt_norm_stats(record: dict[str, Any], conf: dict[str, Any], folder: Path) -> None:
    """A policy built from `record`'s weights normalises as they were trained to: where policy.norm_stats is unset
    and the checkpoint carries statistics, they are written to `folder`/norm_stats.json and the policy reads them
    (a value you set wins)."""
    policy = conf["policy"]
    if "norm_stats" not in policy or policy["norm_stats"] or not record.get("norm_stats"):
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NORM_STATS
    path.write_text(json.dumps(record["norm_stats"]))
    policy["norm_stats"] = str(path)


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
        raise CheckpointError(
            f"{e}; {previous_of(path)} (iteration {iteration}) is intact: move it to {path} to start from it"
        ) from None


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


def load_policy_checkpoint(path: Path, policy_cfg: dict[str, Any], source: str, resume: bool = True) -> dict[str, Any]:
    """A checkpoint (`load_checkpoint`) made for the policy `policy_cfg` configures; otherwise one line that starts
    with `source` (the key that named it, e.g. "resume=runs/...") and names the policy keys that differ. What was
    trained (policy.train) must match only to `resume` training: the weights mean the same either way."""
    ckpt = load_checkpoint(path)
    want, have = policy_identity(policy_cfg), {"train": "all", **ckpt["policy"]}  # (older checkpoints trained all)
    if not resume:
        want["train"] = have["train"]
    if want != have:
        diff = ", ".join(f"policy.{k}={have[k]} (asked {want[k]})" for k in want if want[k] != have[k])
        raise CheckpointError(f"{source} holds a checkpoint of another policy: {diff}")
    return ckpt


def restore_weights(model: Policy, ckpt: dict[str, Any], source: str) -> None:
    """Load a checkpoint's weights into `model`, or one line (starting with `source`) naming keys that do not fit: a
    trainer with LoRA adapters takes them as they were, any other policy the adapters folded in."""
    base, lora = ckpt["model"], ckpt.get("lora")
    if getattr(model, "lora_scaling", None) is not None:
        try:
            load_state(model, base, lora)
        except KeyError as e:
            raise CheckpointError(f"{source} does not fit this policy: {e}") from None
        return
    state = merge_lora(base, lora, ckpt.get("lora_scaling"))
    check_state_dict(model, state, source)
    model.load_state_dict(state)
