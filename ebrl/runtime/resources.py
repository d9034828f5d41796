"""One interface for the CPU cores, GPU SM shares and device-memory budgets of every stage (docs/internals/design.md,
"Placement").

Cores are real: the affinity of every thread of a stage's processes. SM shares come from NVIDIA MPS (set in a
child's environment before its CUDA starts and fixed for the process's life, so a re-quota respawns the worker), from
CUDA green contexts (re-created in-process; caps that overlap, see GreenPartition), or, with partition "none", are
only recorded and the GPU time-slices.
torch is imported only where a GPU is touched, so spawned CPU workers that import this module start fast.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from ebrl.errors import BadInput
from ebrl.node import PARTITIONS, cpu_list, set_process_affinity, visible_gpu

if TYPE_CHECKING:
    import torch

MPS_CONTROL = "nvidia-cuda-mps-control"
GREEN_UNAVAILABLE = (
    "green contexts need a CUDA build of torch with green-context support and a driver >= 12.4; "
    "use hw.sm_partition=mps or none"
)

# NVIDIA MPS documentation, "Appendix: Environment Variables"
# (https://docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html):
# - CUDA_VISIBLE_DEVICES set when the control daemon starts is remapped by the MPS server: a client sees the daemon's
#   devices renumbered from 0, and keeping the physical index in the client "would lead to an error".
# - CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: in a client's environment, constrains the portion of available threads of each
#   device (a percentage; it can only lower a limit the control daemon set).
# - CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: in a client's environment, caps the device memory the client can allocate, as
#   comma-separated <device ordinal>=<size> pairs with a unit suffix, e.g. "0=1G,1=512MB". (The search index held
#   this section's title only; the format is the page's example as public MPS scripts use it: "0=1G", "0=512M".)
# Both are read when the client's CUDA initialises, which is why a share is fixed for a process's life.

# CUDA Driver API 12.4, section 6.35 "Green Contexts"
# (https://docs.nvidia.com/cuda/archive/12.4.0/cuda-driver-api/group__CUDA__GREEN__CONTEXTS.html), the guideline for
# the SM count of a cuDevSmResourceSplitByCount partition, "subject to change": 6.X at least 1 SM; 7.X at least 2, a
# multiple of 2; 8.X at least 4, a multiple of 2; 9.0+ at least 8, a multiple of 8. CUDA 13 says to query
# minSmPartitionSize and smCoscheduledAlignment from cuDeviceGetDevResource instead, which torch does not expose, so
# this table is a guideline: not checked for compute capability 10+ (assumed like 9.0), and the driver rounds a
# request up, so a count rounded down here to the rule is what the context gets.
_GREEN_RULES = {6: (1, 1), 7: (2, 2), 8: (4, 2)}  # compute capability major -> (minimum SMs, multiple)
_GREEN_RULE_HOPPER = (8, 8)  # 9.0 and later

_ENV_LOCK = threading.RLock()  # one spawn environment at a time: os.environ is the whole process's


class ResourceError(BadInput, ValueError):
    """A lease, partition or daemon that cannot be had; one line: what was wrong and what would be right."""


@dataclass(frozen=True)
class Lease:
    """What one stage holds: cores and, on a GPU, an SM share and a memory budget; version counts its resizes."""

    stage: str
    cpus: tuple[int, ...]
    gpu: int | None = None
    sm_share: float | None = None  # of the GPU's SMs, in (0, 1]
    mem_bytes: int | None = None
    version: int = 0


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` set for a block (spawned children copy the parent's environment when they start),
    restored after; one such block at a time, since os.environ is the whole process's."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# --- green contexts and memory budgets ---------------------------------------------------------------
def _require_green() -> None:
    import torch

    try:  # (an older torch has no torch.cuda.green_contexts)
        from torch.cuda import green_contexts
    except ImportError:
        raise ResourceError(GREEN_UNAVAILABLE) from None
    if not (getattr(green_contexts, "SUPPORTED", False) and torch.cuda.is_available()):
        raise ResourceError(GREEN_UNAVAILABLE)


def green_rule(device: int) -> tuple[int, int]:
    """(minimum SMs, multiple of SMs) of one green context on `device`; the table's source is cited above."""
    import torch

    _require_green()
    major, _ = torch.cuda.get_device_capability(device)
    return _GREEN_RULE_HOPPER if major >= 9 else _GREEN_RULES.get(major, (1, 1))


def green_granule(device: int) -> int:
    """SMs per green-context allocation unit on `device`: 8 on compute capability 9.x (Hopper), 2 on 7.x and 8.x."""
    return green_rule(device)[1]


def green_sm_count(share: float, sm_count: int, rule: tuple[int, int]) -> int:
    """The SMs a green context gets for `share` of `sm_count`: rounded down to the rule's multiple, at least its
    minimum (rounding down keeps the shares of one GPU within its SMs)."""
    minimum, multiple = rule
    return max(minimum, int(share * sm_count + 1e-9) // multiple * multiple)


class GreenPartition:
    """One CUDA green context per stage on one GPU of this process, each capped at its share of the SMs; `rebuild`
    re-creates them with new shares (a re-quota without a respawn).

    A cap, not a slice of its own: torch's GreenContext.create splits the whole device each time and keeps the first
    group, so every context starts at the same SMs and two contexts overlap on the smaller one's (gpu_check measures
    both loops at once). Contexts of two processes without MPS also take turns on the GPU, which is why a run, whose
    generation and training are two processes, refuses hw.sm_partition=green (config._check_allocator).
    """

    def __init__(self, device: int, shares: dict[str, float]) -> None:
        import torch

        self.rule = green_rule(device)  # ResourceError without green-context support
        self.device = device
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.sms: dict[str, int] = {}
        self._contexts: dict[str, Any] = {}
        self._streams: dict[str, torch.cuda.Stream] = {}
        self.rebuild(shares)

    def rebuild(self, shares: dict[str, float]) -> None:
        """Drop every context and create one per stage with its new share; waits for the GPU's work first."""
        import torch
        from torch.cuda.green_contexts import GreenContext

        sms = {stage: green_sm_count(share, self.sm_count, self.rule) for stage, share in shares.items()}
        if sum(sms.values()) > self.sm_count:
            raise ResourceError(
                f"green shares {shares} need {sum(sms.values())} SMs on GPU {self.device}, which has "
                f"{self.sm_count} (at least {self.rule[0]} per context): lower the shares"
            )
        torch.cuda.synchronize(self.device)  # no kernel may still run in a context about to go
        self._contexts.clear()
        self._streams.clear()
        self.sms = sms
        for stage, n in sms.items():
            try:
                ctx = GreenContext.create(num_sms=n, device_id=self.device)
            except RuntimeError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ResourceError(
                    f"green context of {n} SMs on GPU {self.device} failed ({first}); {GREEN_UNAVAILABLE}"
                ) from None
            self._contexts[stage], self._streams[stage] = ctx, ctx.Stream()

    def context(self, stage: str) -> Any:
        """The stage's torch.cuda.green_contexts.GreenContext."""
        if stage not in self._contexts:
            raise ResourceError(f"stage {stage!r} has no green context; stages: {', '.join(self._contexts)}")
        return self._contexts[stage]

    def stream(self, stage: str) -> "torch.cuda.Stream":
        """The stage's stream: work queued on it runs on the stage's SMs only."""
        self.context(stage)
        return self._streams[stage]

    @contextmanager
    def use(self, stage: str) -> Iterator["torch.cuda.Stream"]:
        """Run the block in the stage's green context, on its stream."""
        import torch

        ctx, stream = self.context(stage), self.stream(stage)
        ctx.set_context()
        try:
            with torch.cuda.stream(stream):
                yield stream
        finally:
            ctx.pop_context()


MEMORY_BUDGET_VAR = "EBRL_GPU_MEMORY_BYTES"  # a child's memory budget where no MPS daemon enforces one


def apply_memory_budget(mem_bytes: int, device: int) -> float:
    """Cap this process's CUDA caching allocator at mem_bytes on `device` (past it an allocation raises
    OutOfMemoryError); returns the fraction of the device's memory that is."""
    import torch

    if not torch.cuda.is_available():
        raise ResourceError(
            f"a memory budget of {mem_bytes} bytes needs a CUDA device and this torch has none: "
            "lease mem_bytes=None on this hw"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < mem_bytes <= total:
        raise ResourceError(f"mem_bytes={mem_bytes} is not in (0, {total}], the memory of GPU {device}")
    fraction = mem_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def over_budget(usage: dict[str, int], leases: dict[str, Lease]) -> list[str]:
    """One line per stage whose measured device memory exceeds its lease's budget."""
    lines = []
    for stage, used in usage.items():
        lease = leases.get(stage)
        if lease is not None and lease.mem_bytes is not None and used > lease.mem_bytes:
            lines.append(
                f"stage {stage} uses {used} bytes ({used / 2**30:.2f} GiB) of GPU {lease.gpu}, over its "
                f"budget of {lease.mem_bytes} bytes ({lease.mem_bytes / 2**30:.2f} GiB)"
            )
    return lines


# --- MPS daemons ---------------------------------------------------------------------------------
# A client reaches its daemon through a Unix socket in the pipe directory, whose path AF_UNIX limits to 107 bytes: a
# run folder on a long home or shared-filesystem path exceeds it, and a shared filesystem is not the node's. So the
# pipes are in a short folder of this node's /tmp, one per supervisor process and run folder; the logs stay in the run.
MPS_PIPE_ROOT = Path("/tmp")
AF_UNIX_PATH = 107  # bytes of a socket's path (sockaddr_un's 108, less the terminating NUL)


def mps_dirs(run_dir: Path, gpu: int, pid: int | None = None) -> tuple[Path, Path]:
    """The pipe and log directories of GPU `gpu`'s MPS daemon of the supervisor `pid` (None: this process) and its
    run folder `run_dir`."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    pipe = MPS_PIPE_ROOT / f"ebrl-mps-{os.getpid() if pid is None else pid}-{digest}" / f"gpu{gpu}"
    return pipe, Path(run_dir) / "mps" / f"gpu{gpu}" / "log"


class MpsDaemon:
    """The MPS control daemon of one GPU, with pipe and log directories of its own (`mps_dirs`), so a run neither
    needs nor disturbs a system-wide daemon; stopped at interpreter exit if nobody stopped it. `pid` names another
    supervisor whose daemon this one may `adopt`."""

    def __init__(self, gpu: int, run_dir: Path, timeout_s: float = 10.0, pid: int | None = None) -> None:
        self.gpu = gpu
        self.pipe_dir, self.log_dir = mps_dirs(run_dir, gpu, pid)
        self.timeout_s = timeout_s
        self.running = False
        self._exe: str | None = None

    @property
    def control(self) -> Path:
        """The daemon's control pipe: present while it runs."""
        return self.pipe_dir / "control"

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": visible_gpu(self.gpu),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def start(self) -> None:
        """`nvidia-cuda-mps-control -d` for this GPU; returns once its control pipe exists."""
        exe = shutil.which(MPS_CONTROL)
        if exe is None:
            raise ResourceError(
                f"hw.mps=true but {MPS_CONTROL} is not on PATH: install the NVIDIA driver utilities or set hw.mps=false"
            )
        if len(str(self.control).encode()) > AF_UNIX_PATH - 16:  # (room for the servers' pipes beside it)
            raise ResourceError(
                f"the MPS pipe directory {self.pipe_dir} is too long for a Unix socket's path "
                f"({AF_UNIX_PATH} bytes): use a node whose {MPS_PIPE_ROOT} is a short path"
            )
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out_path = self.log_dir / "start.out"
        # output to a file, not a pipe: the forked daemon may inherit the descriptors and a pipe would never end
        with open(out_path, "w") as out:
            try:
                rc = subprocess.run(
                    [exe, "-d"],
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=self.timeout_s,
                ).returncode
            except subprocess.TimeoutExpired:
                raise ResourceError(
                    f"{MPS_CONTROL} -d for GPU {self.gpu} did not return within {self.timeout_s:g} "
                    f"s: see {self.log_dir / 'control.log'}"
                ) from None
        if rc != 0:
            said = " ".join(out_path.read_text().split())[:200] or "no output"
            self._remove_pipes()
            raise ResourceError(
                f"{MPS_CONTROL} -d for GPU {self.gpu} exited with {rc} ({said}): see {self.log_dir / 'control.log'}"
            )
        self._exe, self.running = exe, True
        atexit.register(self.stop)
        deadline = time.monotonic() + self.timeout_s
        while not self.control.exists():
            if time.monotonic() > deadline:
                self.stop()
                raise ResourceError(
                    f"the MPS daemon of GPU {self.gpu} did not open {self.control} within "
                    f"{self.timeout_s:g} s: see {self.log_dir / 'control.log'}"
                )
            time.sleep(0.02)

    def adopt(self) -> bool:
        """Take over the daemon another supervisor (`pid`) started for these directories and left running (it was
        killed), so that stop() quits it; False where none runs there."""
        exe = shutil.which(MPS_CONTROL)
        if exe is None or not self.control.exists():
            return False
        self._exe, self.running = exe, True
        return True

    def ask(self, command: str) -> list[str]:
        """The daemon's answer to one control command (`get_server_list`, `get_client_list PID`, `quit`), word by
        word; raises OSError or subprocess.TimeoutExpired when it cannot be asked."""
        if self._exe is None:
            raise OSError(f"the MPS daemon of GPU {self.gpu} was not started")
        done = subprocess.run(
            [self._exe], input=f"{command}\n", env=self._env(), text=True, capture_output=True, timeout=self.timeout_s
        )
        return done.stdout.split()

    def clients(self) -> set[int]:
        """The PIDs of the processes the daemon's servers serve: its clients (every server's `get_client_list`)."""
        pids: set[int] = set()
        for server in (word for word in self.ask("get_server_list") if word.isdigit()):
            pids.update(int(word) for word in self.ask(f"get_client_list {server}") if word.isdigit())
        return pids

    def stop(self) -> None:
        """Send "quit", wait until the control pipe is gone and remove the pipe directory; does nothing if the daemon
        is not running."""
        if not self.running:
            return
        self.running = False
        atexit.unregister(self.stop)
        if self._exe is None or not self.control.exists():
            return self._remove_pipes()
        try:
            self.ask("quit")
        except (OSError, subprocess.TimeoutExpired):
            return  # stopping must not fail a run that is ending anyway
        deadline = time.monotonic() + self.timeout_s
        while self.control.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._remove_pipes()

    def _remove_pipes(self) -> None:
        """The pipe directory, and the supervisor's folder of them once it is empty (/tmp is not the run's to fill)."""
        shutil.rmtree(self.pipe_dir, ignore_errors=True)
        try:
            self.pipe_dir.parent.rmdir()
        except OSError:  # another GPU's daemon still has its pipes there
            pass

    def __enter__(self) -> "MpsDaemon":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MpsDaemons:
    """One MPS daemon per GPU, started together; when one fails to start, those already started are stopped."""

    def __init__(self, gpus: Iterable[int], run_dir: Path) -> None:
        self.daemons = [MpsDaemon(gpu, run_dir) for gpu in gpus]

    def start(self) -> None:
        started: list[MpsDaemon] = []
        try:
            for daemon in self.daemons:
                daemon.start()
                started.append(daemon)
        except BaseException:
            for daemon in reversed(started):
                daemon.stop()
            raise

    def unenforced(self, clients: dict[str, tuple[int, int]]) -> str | None:
        """One line naming the processes that are not their GPU's daemon's clients (`clients`: what each is -> its
        pid and GPU), whose SM shares and memory limits nothing enforces then; None when every one is a client. Asked
        once the processes hold their CUDA contexts: a client connects when its CUDA starts."""
        missing, asked = [], {daemon.gpu: daemon for daemon in self.daemons}
        for what, (pid, gpu) in clients.items():
            daemon = asked.get(gpu)
            if daemon is None:
                continue
            try:
                served = daemon.clients()
            except (OSError, subprocess.TimeoutExpired) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                return (
                    f"MPS: the daemon of GPU {gpu} could not be asked for its clients ({reason}): the stages' SM "
                    f"shares may not be enforced; see {daemon.log_dir / 'control.log'}"
                )
            if pid not in served:
                missing.append((what, pid, daemon))
        if not missing:
            return None
        names = " and ".join(f"{what} (pid {pid})" for what, pid, _ in missing)
        daemon = missing[0][2]
        verb = "is" if len(missing) == 1 else "are"
        return (
            f"MPS: {names} {verb} not a client of GPU {daemon.gpu}'s daemon ({daemon.pipe_dir}), so {verb} not "
            f"held to an SM share or memory limit; a client that cannot reach the daemon's pipe runs without MPS: "
            f"see {daemon.log_dir / 'control.log'}"
        )

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop()

    def __enter__(self) -> "MpsDaemons":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the pool ----------------------------------------------------------------------------------
class ResourcePool:
    """Leases of cores, SM shares and memory budgets per stage, checked against the node, and resizes applied: cores
    to every attached process at once, SM shares and budgets through the stage's re-quota callback (MPS: respawn the
    worker with its new environment; green: rebuild its contexts); with partition "none" shares are only recorded."""

    def __init__(
        self,
        cores: Sequence[int],
        gpus: int = 0,
        sm_count: int = 0,
        gpu_memory_bytes: int = 0,
        partition: str = "none",
        run_dir: Path | None = None,
    ) -> None:
        if partition not in PARTITIONS:
            raise ResourceError(f"hw.sm_partition={partition!r} is not one of: {', '.join(PARTITIONS)}")
        if partition != "none" and gpus == 0:
            raise ResourceError(f"hw.sm_partition={partition} needs a GPU; this hw has none: use hw.sm_partition=none")
        if partition == "green" and sm_count <= 0:
            raise ResourceError(
                f"hw.sm_partition=green needs the GPU's SM count, got hw.sm_count={sm_count}: set hw.sm_count"
            )
        if not cores:
            raise ResourceError("the resource pool has no cores: give it at least one (hw.cpu_cores)")
        self.cores = tuple(sorted(set(cores)))
        self.gpus, self.sm_count, self.gpu_memory_bytes = gpus, sm_count, gpu_memory_bytes
        self.partition = partition
        self.run_dir = None if run_dir is None else Path(run_dir)
        self._green_rule = green_rule(0) if partition == "green" else None  # one GPU model per node
        self.leases: dict[str, Lease] = {}
        self.history: list[tuple[float, Lease]] = []  # (time.perf_counter(), lease) of every grant and resize
        self._pids: dict[str, set[int]] = {}
        self._requota: dict[str, Callable[[Lease], None]] = {}

    # --- leases -----------------------------------------------------------------------------
    def lease(
        self,
        stage: str,
        cpus: Iterable[int],
        gpu: int | None = None,
        sm_share: float | None = None,
        mem_bytes: int | None = None,
    ) -> Lease:
        """Grant `stage` these resources; granting a stage that already holds a lease resizes it."""
        if stage in self.leases:
            return self.resize(stage, cpus=cpus, gpu=gpu, sm_share=sm_share, mem_bytes=mem_bytes)
        return self._record(self._validate(Lease(stage, tuple(cpus), gpu, sm_share, mem_bytes)))

    def resize(self, stage: str, **changes: Any) -> Lease:
        """A new version of the stage's lease with `changes` (cpus, gpu, sm_share, mem_bytes), checked like a grant,
        then applied: cores to every attached process, a GPU change through the stage's re-quota callback."""
        old = self._held(stage)
        unknown = set(changes) - {"cpus", "gpu", "sm_share", "mem_bytes"}
        if unknown:
            raise ResourceError(
                f"resize({stage!r}) got {', '.join(sorted(unknown))}; accepted: cpus, gpu, sm_share, mem_bytes"
            )
        if "cpus" in changes:
            changes["cpus"] = tuple(changes["cpus"])
        new = self._record(self._validate(replace(old, **changes, version=old.version + 1)))
        for pid in list(self._pids.get(stage, ())):
            try:
                set_process_affinity(pid, new.cpus)
            except ProcessLookupError:
                self._pids[stage].discard(pid)  # it ended: nothing to move
        gpu_changed = (old.gpu, old.sm_share, old.mem_bytes) != (new.gpu, new.sm_share, new.mem_bytes)
        if self.partition != "none" and gpu_changed and stage in self._requota:
            self._requota[stage](new)
        return new

    def _held(self, stage: str) -> Lease:
        if stage not in self.leases:
            raise ResourceError(f"stage {stage!r} holds no lease; stages with one: {', '.join(self.leases) or 'none'}")
        return self.leases[stage]

    def _record(self, lease: Lease) -> Lease:
        self.leases[lease.stage] = lease
        self.history.append((time.perf_counter(), lease))
        return lease

    def _validate(self, lease: Lease) -> Lease:
        """The lease as it will be held (cpus sorted, a green share rounded to whole allocation units), or one line
        on what does not fit."""
        s = lease.stage
        cpus = tuple(sorted(set(lease.cpus)))
        if not cpus:
            raise ResourceError(
                f"stage {s}: cpus is empty: lease at least one of the pool's cores {cpu_list(self.cores)}"
            )
        outside = set(cpus) - set(self.cores)
        if outside:
            raise ResourceError(
                f"stage {s}: cpus {cpu_list(outside)} are not in the pool's cores "
                f"{cpu_list(self.cores)}: lease cores from that set"
            )
        share, mem = lease.sm_share, lease.mem_bytes
        if lease.gpu is None:
            if share is not None or mem is not None:
                raise ResourceError(
                    f"stage {s}: sm_share={share} and mem_bytes={mem} need a GPU but gpu=None: lease a gpu or drop them"
                )
            return replace(lease, cpus=cpus)
        if not 0 <= lease.gpu < self.gpus:
            have = f"GPUs 0..{self.gpus - 1}" if self.gpus else "no GPU: lease gpu=None"
            raise ResourceError(f"stage {s}: gpu={lease.gpu} is not on this hw, which has {have}")
        others = [x for x in self.leases.values() if x.stage != s and x.gpu == lease.gpu]
        if share is not None:
            if not 0 < share <= 1:
                raise ResourceError(f"stage {s}: sm_share={share} must be in (0, 1]")
            if self._green_rule is not None:
                share = green_sm_count(share, self.sm_count, self._green_rule) / self.sm_count
            total = share + sum(x.sm_share or 0.0 for x in others)
            if total > 1 + 1e-9:
                held = ", ".join(f"{x.stage}={x.sm_share:.3g}" for x in others if x.sm_share)
                raise ResourceError(
                    f"stage {s}: sm_share={share:.3g} brings the SM shares of GPU {lease.gpu} to "
                    f"{total:.3g} > 1 (held: {held}): lower it or shrink another stage first"
                )
        if mem is not None:
            if self.gpu_memory_bytes <= 0:
                raise ResourceError(
                    f"stage {s}: mem_bytes={mem} but the pool does not know the GPU's memory: set hw.gpu_memory_gb"
                )
            if mem <= 0:
                raise ResourceError(f"stage {s}: mem_bytes={mem} must be > 0 (None: no budget)")
            total_mem = mem + sum(x.mem_bytes or 0 for x in others)
            if total_mem > self.gpu_memory_bytes:
                raise ResourceError(
                    f"stage {s}: mem_bytes={mem} brings the budgets on GPU {lease.gpu} to {total_mem} "
                    f"bytes, over its {self.gpu_memory_bytes}: lower it or shrink another stage first"
                )
        return replace(lease, cpus=cpus, sm_share=share)

    # --- processes --------------------------------------------------------------------------
    def attach(self, stage: str, pid: int) -> None:
        """Count `pid` as one of the stage's processes and pin all its threads to the stage's cores."""
        lease = self._held(stage)
        set_process_affinity(pid, lease.cpus)
        self._pids.setdefault(stage, set()).add(pid)

    def detach(self, stage: str, pid: int) -> None:
        """Stop moving `pid` with the stage's lease (it ended, or is being replaced)."""
        self._pids.get(stage, set()).discard(pid)

    def on_requota(self, stage: str, callback: Callable[[Lease], None]) -> None:
        """Called with the new lease when a resize changes the stage's GPU, SM share or memory budget (MPS: respawn
        the worker under spawn_env; green: GreenPartition.rebuild)."""
        self._requota[stage] = callback

    # --- environment of a child -------------------------------------------------------------
    def child_env(self, stage: str) -> dict[str, str]:
        """The variables a child of this stage must start with, before its CUDA initialises."""
        lease = self._held(stage)
        if lease.gpu is None:
            return {}
        if self.partition != "mps":  # (a budget without MPS: torch's per-process cap, set by the child, start_worker)
            env = {"CUDA_VISIBLE_DEVICES": visible_gpu(lease.gpu)}
            if lease.mem_bytes is not None:
                env[MEMORY_BUDGET_VAR] = str(lease.mem_bytes)
            return env
        # our daemon of this GPU was started with CUDA_VISIBLE_DEVICES=<gpu> and shows it to clients as device 0;
        # without a run folder the child uses a system daemon that sees every GPU by its own index
        env = {"CUDA_VISIBLE_DEVICES": "0" if self.run_dir else visible_gpu(lease.gpu)}
        if self.run_dir is not None:
            pipe, log = mps_dirs(self.run_dir, lease.gpu)
            env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = str(pipe), str(log)
        if lease.sm_share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(100 * lease.sm_share)))
        if lease.mem_bytes is not None:
            # the child sees its GPU as device 0; whole MiB rounded down, so the cap never exceeds the budget
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, lease.mem_bytes // 2**20)}M"
        return env

    @contextmanager
    def spawn_env(self, stage: str) -> Iterator[dict[str, str]]:
        """os.environ with child_env(stage) while a spawn-context child starts (it copies the parent's environment
        at start), restored after."""
        env = self.child_env(stage)
        with environment(env):
            yield env
