"""Weight publication (docs/internals/design.md, "Processes and what crosses between them"): the trainer's newest
weights, with their version, for generation to copy in at a chunk boundary.

The payload is the policy in policy.dtype (bfloat16 at full size: half the bytes of the trainer's float32 masters),
in the family's own layout (LoRA folded in, ebrl/policies/training.py), packed in one flat buffer per slot. Two
slots take turns, so the trainer writes version v + 1 into the slot generation is not reading, and no lock is held
while anyone copies: each slot has a sequence count, odd while it is written; a reader copies the newest slot and
keeps the copy only if the count did not move meanwhile (the trainer would have to publish twice during one copy),
else copies again.

Where the slots live:
- host: two flat buffers in shared memory (the supervisor creates them, with its weights as version 0);
- cuda: on one GPU, the trainer allocates the two slots on the device and hands them to generation by CUDA IPC
  (torch's CUDA tensor sharing: a handle per buffer, opened once per reader), so an update reaches generation as a
  device-to-device copy, not a copy to host memory and back. The host slot then only carries the first weights to
  the trainer. A trainer that is replaced withdraws its slots (`withdraw`) once readers have let go of them
  (`release`), and its successor attaches its own.
Counters and handles sit in a small shared int64 tensor and byte buffer, so the channel pickles into every spawned
process whatever its slots are.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ebrl.policies.training import folded, load_state, split_lora

# the meta tensor's cells; EPOCH: which trainer's device slots readers open (0: none, or withdrawn), ATTACHED: how many
# trainers have attached slots, so an epoch never repeats
VERSION, SEQ0, SEQ1, EPOCH, HANDLES, ATTACHED = range(6)
HANDLE_BYTES = 1 << 16
Whole = Callable[[torch.Tensor], torch.Tensor]  # a state dict's tensor whole as it is written (a shard gathered)


@dataclass(frozen=True)
class Entry:
    """Where one state-dict tensor sits in a slot's flat buffer."""

    key: str
    shape: tuple[int, ...]
    offset: int
    numel: int


def layout(state: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """The entries of a flat buffer holding every tensor of `state`, and its length."""
    entries, offset = [], 0
    for key, value in state.items():
        if not value.is_floating_point():
            raise TypeError(f"published weights are floating point; {key} is {value.dtype}")
        entries.append(Entry(key, tuple(value.shape), offset, value.numel()))
        offset += value.numel()
    return entries, offset


def views(flat: torch.Tensor, entries: list[Entry]) -> dict[str, torch.Tensor]:
    return {e.key: flat[e.offset : e.offset + e.numel].view(e.shape) for e in entries}


class WeightChannel:
    """The latest published weights (see the module docstring): `publish` on the trainer's side, `pull` on
    generation's; `cuda=True` for slots on the trainer's GPU shared with generation on the same GPU."""

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        ctx: Any,
        dtype: torch.dtype,
        cuda: bool = False,
        lora_scaling: float | None = None,
    ) -> None:
        """`state`: the first weights (version 0), a state dict in the family's layout; `dtype`: the payload's."""
        self.entries, self.numel = layout(state)
        self.dtype, self.cuda, self.lora_scaling = dtype, cuda, lora_scaling
        self.meta = torch.zeros(6, dtype=torch.int64).share_memory_()
        self.handles = torch.zeros(HANDLE_BYTES, dtype=torch.uint8).share_memory_()
        # host slots: two, or one that only brings the first weights when the slots are on the GPU
        self.host = [torch.empty(self.numel, dtype=dtype).share_memory_() for _ in range(1 if cuda else 2)]
        self._write(self.host[0], state)
        self._device: list[torch.Tensor] | None = None  # this process's device slots (allocated, or opened by IPC)
        self._epoch = 0  # of the device slots this process holds

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_device"], state["_epoch"] = None, 0  # each process opens the device slots itself
        return state

    @property
    def version(self) -> int:
        return int(self.meta[VERSION])

    @property
    def payload_bytes(self) -> int:
        """One slot's size."""
        return self.numel * self.dtype.itemsize

    # --- the trainer's side ---------------------------------------------------------------------
    def attach(self, device: torch.device | str, state: dict[str, torch.Tensor], whole: Whole | None = None) -> None:
        """(cuda) Allocate this trainer's two device slots, put `state` (the current version's weights; `whole` as in
        `publish`) in the current one, and offer both to readers by IPC handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        self._device = [torch.empty(self.numel, dtype=self.dtype, device=device) for _ in range(2)]
        with torch.no_grad():
            self._write(self._device[self.version % 2], folded(*split_lora(state)), whole)
        torch.cuda.synchronize(device)
        blob = pickle.dumps([reduce_tensor(slot) for slot in self._device])
        if len(blob) > HANDLE_BYTES:
            raise RuntimeError(f"CUDA IPC handles take {len(blob)} bytes, more than the channel's {HANDLE_BYTES}")
        self.handles[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.meta[HANDLES] = len(blob)
        self.meta[ATTACHED] += 1
        self._epoch = int(self.meta[ATTACHED])
        self.meta[EPOCH] = self._epoch

    def withdraw(self) -> None:
        """(cuda) Readers stop using these device slots from their next pull (call `release` on each reader, then
        let the trainer that owns them go)."""
        self.meta[EPOCH] = 0

    def publish(self, state: dict[str, torch.Tensor], whole: Whole | None = None) -> int:
        """Write a trainer's state (its own layout: LoRA adapters are folded in here) as the next version, into the
        slot no reader is copying; returns the new version. `whole` gives each tensor whole as it is written (a
        sharded trainer's `Gathered.whole`: one tensor gathered at a time, never the whole state dict)."""
        version = self.version + 1
        slot = version % 2
        self.meta[SEQ0 + slot] += 1  # odd: being written
        with torch.no_grad():
            target = self._device[slot] if self._device is not None else self.host[slot]
            self._write(target, folded(*split_lora(state)), whole)
            if target.is_cuda:
                torch.cuda.synchronize(target.device)
        self.meta[SEQ0 + slot] += 1
        self.meta[VERSION] = version
        return version

    # --- generation's side ---------------------------------------------------------------------
    def pull(self, module: torch.nn.Module, have: int, timeout: float = 600.0) -> int:
        """Copy the published weights into `module` if they are newer than version `have`; the version it now holds
        (`have` while a trainer's device slots are withdrawn: the module keeps its weights). have < 0: the module
        has none yet, so wait up to `timeout` seconds for slots to read."""
        deadline = time.monotonic() + timeout
        while True:
            version = self.version
            if version == have:
                return have
            source = self._slot(version % 2)
            seq = int(self.meta[SEQ0 + version % 2])
            if self.version != version:
                # the trainer published again between the two reads, and may already have rewritten this slot with
                # version + 2 (the seq read then vouches for that copy, labelled `version`): read the newest again
                continue
            if source is not None and seq % 2 == 0:
                with torch.no_grad():
                    load_state(module, views(source, self.entries))
                    if source.is_cuda:
                        torch.cuda.synchronize(source.device)
                if int(self.meta[SEQ0 + version % 2]) == seq:
                    return version
            elif source is None and (have >= 0 or time.monotonic() > deadline):
                if have < 0:
                    raise RuntimeError(f"no published weights to read within {timeout:.0f} s")
                return have
            time.sleep(0.001)  # being written (the trainer lapped this copy): read the newest again

    def release(self) -> None:
        """Let go of the device slots this process opened (before their trainer goes)."""
        self._device, self._epoch = None, 0

    def _slot(self, slot: int) -> torch.Tensor | None:
        """The buffer of `slot`: host memory, or the current trainer's device slot (opened on first use); None while
        a trainer's device slots are withdrawn."""
        if not self.cuda:
            return self.host[slot]
        epoch = int(self.meta[EPOCH])
        if epoch == 0:  # before the first trainer attached (version 0 is on the host) or while one is replaced
            self.release()
            return self.host[0] if self.version == 0 else None
        if epoch != self._epoch:
            rebuilds = pickle.loads(self.handles[: int(self.meta[HANDLES])].numpy().tobytes())
            self._device = [fn(*args) for fn, args in rebuilds]
            self._epoch = epoch
        return self._device[slot]

    def _write(self, flat: torch.Tensor, items: Any, whole: Whole | None = None) -> None:
        """Copy a state dict, or `folded`'s weights with their adapters (B, A) as W + s B A in one fused matmul per
        weight (accumulated in float32, rounded once to the payload's dtype), into a slot; each tensor through
        `whole` as it is written."""
        whole = whole or (lambda t: t)
        targets = views(flat, self.entries)
        for key, value, ab in ((k, v, None) for k, v in items.items()) if isinstance(items, dict) else items:
            target, value = targets[key], whole(value)
            if ab is None:
                target.copy_(value, non_blocking=flat.is_cuda and value.is_cuda)
            else:
                up, down = (whole(t).to(target.device, target.dtype) for t in ab)
                torch.addmm(value.to(target.device, target.dtype), up, down, alpha=self.lora_scaling, out=target)

    def state(self) -> dict[str, torch.Tensor]:
        """The newest weights as a state dict (copies, on the host): tests and checks."""
        return {k: v.detach().cpu().clone() for k, v in views(self._slot(self.version % 2), self.entries).items()}


class SharedWeights:
    """The weights when the trainer and generation are one policy in one process (colocated: the stages take turns,
    so one copy serves both): nothing is copied, and each update is the next version at once. The part of the
    `WeightChannel` interface that generation and the trainer use."""

    cuda = False

    def __init__(self) -> None:
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def publish(self) -> int:
        """The policy was updated in place: count it."""
        self._version += 1
        return self._version

    def pull(self, module: torch.nn.Module, have: int) -> int:
        """The version `module` (the trainer's own policy) holds: the newest."""
        return self._version

    def release(self) -> None:
        pass
