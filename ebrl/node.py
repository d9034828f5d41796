"""This node as a run sees it: where this process is among the run's ranks (torchrun's environment), its share of
the node's cores, and the GPUs CUDA will show it (counted without starting CUDA).

It also places processes on cores: every thread of a process, since a process's affinity and nice value are its
threads' own. The bottom of the package's layers: the config checks, the resource pool, torch.distributed's glue and
the simulator workers' handles all read it. It imports the standard library only (the simulator workers import it
under a benchmark's own interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

PARTITIONS = ("none", "mps", "green")  # hw.sm_partition: how GPU stages share a GPU's SMs
RANK_SEED_STRIDE = 7919  # rank r's simulators and sampling start from seed + r x this (a prime: no overlap)


@dataclass(frozen=True)
class Ranks:
    """Where this process is among the run's ranks (torchrun's environment; one rank without it)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Ranks":
        world = int(env.get("WORLD_SIZE", 1))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(int(env.get("RANK", 0)), world, int(env.get("LOCAL_RANK", 0)), local_world)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0 writes the run folder's metrics, checkpoints and W&B run."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.local_world)

    def seed(self, seed: int) -> int:
        """This rank's seed for its simulators and sampling: other ranks must collect other episodes."""
        return seed + RANK_SEED_STRIDE * self.rank

    def gpus(self, node_gpus: int) -> int:
        """The GPUs this rank uses of its node's `node_gpus` (hw.gpus): its own one under torchrun (`pin_gpu`), else
        all of them."""
        return 1 if self.distributed and node_gpus else node_gpus


def share_of_node(cores: list[int], ranks: Ranks) -> list[int]:
    """This rank's contiguous slice of its node's cores (ranks of a node split them as evenly as they can)."""
    n, k, i = len(cores), ranks.local_world, ranks.local_rank
    return cores[i * n // k : (i + 1) * n // k]


def visible_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's GPU `index` (a rank under torchrun sees only its own GPU, so
    its index 0 may be the node's GPU 5): what a daemon or a child must be shown to mean the same GPU."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index].strip() if index < len(visible) else str(index)


def visible_gpu_count(visible: str | None, uuids: Sequence[str]) -> int:
    """The GPUs CUDA shows a process started with CUDA_VISIBLE_DEVICES=`visible` (None: unset) on a machine whose
    GPUs have these UUIDs (NVML's list); entries are indices or (prefixes of) GPU-UUIDs, MIG-UUIDs are taken as given.

    CUDA's rule, as torch.cuda._parse_visible_devices encodes it: the first entry that names no GPU ends the list,
    and a GPU named twice leaves none."""
    if visible is None:
        return len(uuids)
    seen: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            found = [uuids[int(entry)]] if int(entry) < len(uuids) else []
        elif entry.startswith("GPU-"):
            found = [u for u in uuids if u.startswith(entry)]
        else:
            found = [entry] if entry.startswith("MIG-") else []  # NVML lists MIG devices under their GPU's handle
        if len(found) != 1:  # no such GPU, or an ambiguous UUID prefix
            break
        if found[0] in seen:
            return 0
        seen.append(found[0])
    return len(seen)


def order_gpus_by_bus() -> None:
    """Number the GPUs in CUDA as NVML, nvidia-smi and our CUDA_VISIBLE_DEVICES arithmetic do, by PCI bus (CUDA's
    default puts the fastest first), in this process and the children it starts. Before CUDA initialises."""
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


# CUDA's own count, through the driver library alone (no torch), printed by a child: in this process it would start
# CUDA, after which CUDA_VISIBLE_DEVICES no longer applies
DRIVER_COUNT = """import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0)
else:
    n = ctypes.c_int()
    print(n.value if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)
"""


def cuda_device_count() -> int:
    """The GPUs CUDA would show this process (CUDA_VISIBLE_DEVICES honoured); 0 without an NVIDIA driver. Counted
    without starting CUDA here (`pin_gpu` has yet to set CUDA_VISIBLE_DEVICES): through NVML, or where NVML is absent
    (no pynvml, or a container without libnvidia-ml) by the CUDA driver in a child."""
    from ebrl.telemetry.monitor import gpu_uuids  # (NVML, and psutil, which a simulator's interpreter may lack)

    uuids = gpu_uuids()
    if uuids is not None:
        return visible_gpu_count(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
    try:
        done = subprocess.run([sys.executable, "-S", "-c", DRIVER_COUNT], capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


# --- placing processes on cores -------------------------------------------------------------------
def _threads(pid: int) -> set[int]:
    try:
        return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None


def set_process_affinity(pid: int, cpus: Iterable[int]) -> None:
    """Pin every thread of `pid` to `cpus`: sched_setaffinity(pid) alone moves only the main thread, and a torch or
    OpenMP pool, or a simulator's render threads (Mesa's llvmpipe), would keep running on the old cores."""
    cpus = set(cpus)
    _each_thread(pid, lambda tid: os.sched_setaffinity(tid, cpus))


def set_process_nice(pid: int, nice: int) -> None:
    """Run every thread of `pid` at `nice`: on Linux a nice value is a thread's own, setpriority(pid) the main
    thread's alone."""
    _each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))


def _each_thread(pid: int, apply: Callable[[int], None]) -> None:
    done: set[int] = set()
    for _ in range(10):  # a thread started meanwhile by one not yet changed copied the old setting: pass again
        todo = _threads(pid) - done
        if not todo:
            return
        for tid in todo:
            try:
                apply(tid)
            except ProcessLookupError:
                pass  # the thread ended
        done |= todo


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,6") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def process_affinity(pid: int) -> dict[int, set[int]]:
    """Each thread's allowed CPUs, read back from /proc (what the kernel enforces, not what was asked)."""
    out: dict[int, set[int]] = {}
    for tid in _threads(pid):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[tid] = parse_cpu_list(line.split(":", 1)[1])
    return out


def cpu_list(cpus: Iterable[int]) -> str:
    """A set of CPUs in the kernel's list format, for messages."""
    ranges: list[list[int]] = []
    for c in sorted(cpus):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
