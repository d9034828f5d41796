"""Simulator worker processes, the supervisor's side (docs/internals/design.md, "Processes and what crosses between
them"): one process per environment (ebrl/envs/process.py, its protocol), its shared-memory slot (ebrl/envs/slots.py).

A simulator that dies, hangs past its chunk timeout or fails inside a chunk is replaced
(`SimWorkerPool.wait_chunk`): the process is killed, a fresh one with a new seed takes its slot and
starts a new episode, and the chunk reports `failed`, so the scheduler discards that env's partial
episode. More than `max_failures` replacements within `failure_window_s` stop the run
(`SimulatorsFailing`). `env.fault` injects such failures for tests.

A worker is a plain `python -m ebrl.envs.process FD` subprocess joined to its handle by a socket
pair, not a multiprocessing child: it may run under a benchmark's own interpreter (`env.python`),
where multiprocessing's spawn would re-import the parent's main script (run.py, which needs
hydra) before the worker could start. With scheduler.serial no process starts: the supervisor answers the same
notices in a thread of its own (ebrl/envs/serial.py) with the same code (`Simulator.serve`).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import psutil

from ebrl.envs.base import AdapterContractError, EnvSetupError, EnvSpec, one_line
from ebrl.envs.egl import EglDevice, device_of_gpu, egl_devices
from ebrl.envs.process import Simulator, send_quietly, worker_environment
from ebrl.envs.serial import InProcess
from ebrl.envs.setup import worker_python
from ebrl.envs.slots import Slot, SlotLayout
from ebrl.envs.tasks import assign_tasks, joint_spec, task_config
from ebrl.errors import StageFailed
from ebrl.node import set_process_affinity, set_process_nice

RESEED = 100_003  # a replacement process of env i builds from seed + RESEED x (its replacements so far)
REPO_ROOT = Path(__file__).resolve().parents[2]  # put on the worker's PYTHONPATH, whatever its interpreter


@dataclass(frozen=True)
class Launch:
    """How a simulator process starts: its interpreter (env.python or the benchmark's), variables for its environment
    (egl_environment) and how long its simulator may take to build; `serial`: no process, the simulator runs in this
    one (scheduler.serial, ebrl/envs/serial.py)."""

    python: str
    env: dict[str, str]
    timeout_s: float
    serial: bool = False


def process_cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process `pid`, all its threads; None once it is gone (a zombie too)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return sum(process.cpu_times()[:2])
    except psutil.Error:
        return None


class Progress:
    """Whether a simulator process is still at its chunk: a chunk is hung when the process's CPU time stood still for
    `limit` seconds of wall-clock (stopped, blocked, deadlocked), or when the chunk alone took `limit` seconds of CPU
    (a spin that never ends). Wall-clock alone does not count: on a machine that other load slows, a simulator's CPU
    time advances, however slowly, and its chunk is waited for. Without a process of its own (scheduler.serial) the
    wall-clock is all there is."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.moved = time.monotonic()  # when its CPU time was last seen to advance (or the chunk was sent)
        self.start = self.cpu = (process_cpu_seconds(pid) if pid is not None else None) or 0.0

    def hung(self, limit: float) -> str | None:
        """Why the chunk counts as hung now, or None (its CPU time is read again)."""
        now = time.monotonic()
        cpu = process_cpu_seconds(self.pid) if self.pid is not None else None
        if cpu is None:
            if self.pid is not None:  # gone: its pipe's end says so
                return None
        elif cpu > self.cpu:
            self.cpu, self.moved = cpu, now
        if now - self.moved >= limit:
            return (
                f"no CPU time for {now - self.moved:.0f} s"
                if self.pid is not None
                else f"no result for {now - self.moved:.0f} s"
            )
        if self.cpu - self.start >= limit:
            return f"{self.cpu - self.start:.0f} s of CPU on one chunk"
        return None

    def until_check(self, limit: float) -> float:
        """Seconds until `hung` could first say so, at most a quarter of `limit` (its CPU time may stop between two
        reads: a stop is seen within 1.25 limits)."""
        return max(0.0, min(self.moved + limit - time.monotonic(), limit - (self.cpu - self.start), limit / 4))


@dataclass(frozen=True)
class InFlight:
    """The chunk a worker was asked to run: `empty` (0 steps, nothing sent), or `lost` (it could not be sent: why;
    `wait` reports the failure); `progress` watches its process while it runs."""

    empty: bool = False
    lost: str | None = None
    progress: Progress | None = None


# --- the launch environment ---------------------------------------------------------------
MPS_VARIABLES = "CUDA_MPS_"  # an MPS client's variables (its pipe directory, SM share, memory limit) all begin so


def machine_indices(visible: str | None, uuids: Sequence[str] = ()) -> list[int | None] | None:
    """The machine-wide index of each entry of a CUDA_VISIBLE_DEVICES value (None: unset, every GPU in order): digits
    as they are, a GPU-UUID (prefix) looked up in NVML's `uuids`, None for an entry that names no GPU (a MIG
    instance, an unknown UUID)."""
    if visible is None:
        return None
    out: list[int | None] = []
    for entry in (e.strip() for e in visible.split(",") if e.strip()):
        found = [i for i, uuid in enumerate(uuids) if entry.startswith("GPU-") and uuid.startswith(entry)]
        out.append(int(entry) if entry.isdigit() else found[0] if len(found) == 1 else None)
    return out


def egl_environment(
    visible: str | None, gpus: int, uuids: Sequence[str] = (), devices: Sequence[EglDevice] | None = None
) -> dict[str, str]:
    """The variables that make a simulator render on its supervisor's first visible GPU (a rank's own under torchrun),
    given the supervisor's CUDA_VISIBLE_DEVICES (None: unset), the hw's GPU count, NVML's GPU UUIDs and the EGL
    devices as the supervisor lists them (ebrl/envs/egl.py; None: unknown); none on a CPU-only node, which renders
    with Mesa's software EGL.

    MUJOCO_EGL_DEVICE_ID is the GPU's index in EGL's own list (robosuite's, 1.4 in LIBERO, 1.5 and RoboCasa's fork
    alike), found through each NVIDIA device's CUDA ordinal; with no NVIDIA device for the GPU, Mesa's software
    device (the simulator then says so, `SimWorkerPool.start`), and with no device list the GPU's own index.
    CUDA_VISIBLE_DEVICES shows the GPU first, by its machine-wide index (SAPIEN renders on CUDA's device 0, and the
    simulator's value no longer depends on what its supervisor's became: an MPS client's "0"); robosuite asserts at
    import that MUJOCO_EGL_DEVICE_ID occurs in it (utils/binding_utils.py, a substring test), so the EGL index follows
    where it does not already occur."""
    if gpus <= 0:
        return {}
    shown = machine_indices(visible, uuids)
    gpu = 0 if shown is None else shown[0] if shown else None
    if gpu is None:  # no GPU shown, a MIG instance, an unknown UUID: robosuite's own rule applies
        return {}
    egl = gpu
    if devices:
        nvidia = device_of_gpu(gpu, devices, shown)
        software = next((d for d in devices if d.software), None)
        egl = nvidia.index if nvidia is not None else software.index if software is not None else gpu
    cuda = str(gpu)
    return {"MUJOCO_EGL_DEVICE_ID": str(egl), "CUDA_VISIBLE_DEVICES": cuda if str(egl) in cuda else f"{cuda},{egl}"}


def simulator_gpu_environment(gpus: int) -> dict[str, str]:
    """`egl_environment` for this process's CUDA_VISIBLE_DEVICES (taken after `pin_gpu`, before an MPS client's
    environment replaces it) and EGL's devices as this process lists them; GPU-UUIDs are looked up through NVML."""
    if gpus <= 0:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    uuids: Sequence[str] = ()
    if visible and any(not e.strip().isdigit() for e in visible.split(",") if e.strip()):
        from ebrl.telemetry.monitor import gpu_uuids  # (the supervisor's side: workers need no NVML)

        uuids = gpu_uuids() or ()
    return egl_environment(visible, gpus, uuids, egl_devices())


# --- the parent side ----------------------------------------------------------------------
@dataclass
class ChunkReport:
    """What one environment's chunk produced (copies; the shared slot is reused by the next chunk)."""

    executed: int
    rewards: np.ndarray  # (executed,) float32
    successes: np.ndarray  # (executed,) bool
    step_times: np.ndarray  # (executed,) float64 seconds
    terminated: bool
    truncated: bool
    episode: dict[str, float] | None  # return, length, success of the episode that ended, if one did
    final_obs: dict[str, np.ndarray] | None = None  # the obs that episode ended on (before the auto-reset)
    started: float = float("nan")  # perf_counter() when the chunk's first step began (same clock in every process)
    ended: float = float("nan")  # ... and when its last step ended
    cpus: tuple[int, ...] = ()  # the cores the simulator process was allowed while it ran the chunk
    cpu_s: float = 0.0  # the simulator's CPU seconds inside the adapter's run_chunk (the rest of its process's: the
    # plumbing)
    failed: str | None = None  # the simulator died, hung or failed in this chunk (why); it was replaced

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @classmethod
    def nothing(cls, truncated: bool = False, failed: str | None = None) -> "ChunkReport":
        """A chunk that executed no step: an env left as it is, or (failed) one whose simulator failed, which ends its
        episode (the replacement starts a new one)."""
        return cls(
            executed=0,
            rewards=np.zeros(0, np.float32),
            successes=np.zeros(0, bool),
            step_times=np.zeros(0, np.float64),
            terminated=False,
            truncated=truncated,
            episode=None,
            failed=failed,
        )


class SimFailure(StageFailed):
    """A simulator process died, hung or failed inside a chunk; the message is one line."""


class SimHung(SimFailure):
    """A simulator stopped making progress in its chunk (`Progress`)."""


class SimulatorsFailing(StageFailed):
    """Simulators keep failing: more replacements in a window than allowed; the message is one line."""


_BLOCKS: dict[str, SharedMemory] = {}  # the shared slots this process created and has not freed


def free_blocks_now() -> None:
    """Unlink every shared slot this process created (a stop at once, `exit_cleanly`'s second signal: no owner will
    close them, and the resource tracker would free them with a warning)."""
    for shm in list(_BLOCKS.values()):
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    _BLOCKS.clear()


class _Resources:
    """What a SimWorker must release even if its owner forgets: the process, the pipe, the shm block."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.shm: SharedMemory | None = None

    def release(self, timeout: float = 5.0) -> None:
        if self.conn is not None:
            send_quietly(self.conn, ("close",))
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5.0)  # (killed: reaped at once)
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.shm is not None:
            _BLOCKS.pop(self.shm.name, None)
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            try:
                self.shm.close()
            except BufferError:  # numpy views still held by a caller: the mapping goes with them
                pass
            self.shm = None


class SimWorker:
    """Main-process handle of one simulator process and its shared-memory slot."""

    def __init__(
        self,
        env_cfg: dict[str, Any],
        seed: int,
        execute: int | None = None,
        index: int = 0,
        cpus: Sequence[int] | None = None,
        start_timeout: float = 600.0,
        process_env: Mapping[str, str] | None = None,
        serial: bool = False,
    ) -> None:
        if execute is not None and execute < 1:
            raise ValueError(f"execute={execute} must be >= 1")
        self.launch = Launch(
            worker_python(env_cfg.get("name", ""), env_cfg.get("python")),
            dict(process_env or {}),
            start_timeout,
            serial,
        )
        self.env_cfg = dict(env_cfg)
        self.seed = int(seed)
        self.replacements = 0  # processes that took over this env after one failed
        self.nice: int | None = None  # applied to every process of this env
        # the actions of a chunk the env executes (policy.execute): what its slot holds; may be given at `attach`
        self.execute = execute
        self.index = index
        self.cpus = list(cpus) if cpus else None
        self.spec: EnvSpec | None = None  # set once the slot is attached
        self.slot_spec: EnvSpec | None = None  # a multi-task pool's joint spec (tasks.joint_spec), its slot's layout
        self._received_spec: EnvSpec | None = None
        self.slot: Slot | None = None
        self._chunk: InFlight | None = None  # submitted, not yet waited for
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)

    # --- lifecycle
    def start(self, wait: bool = True) -> None:
        """Start the process under `env.python`; with wait, also receive its spec and attach the shared slot."""
        if self._res.process is not None or self._res.conn is not None:
            raise RuntimeError(f"sim worker {self.index} was started already")
        if self.launch.serial:
            self._start_here()
        else:
            self._start_process()
        if wait:
            self.connect()

    def _start_here(self) -> None:
        if os.path.abspath(self.launch.python) != os.path.abspath(sys.executable):
            raise EnvSetupError(
                f"scheduler.serial=true runs the simulators in this process ({sys.executable}) and "
                f"this env's run under {self.launch.python}; serially, run an env of this interpreter"
            )
        self._res.conn = InProcess(Simulator, self.env_cfg, self.seed)  # type: ignore[assignment]

    def _start_process(self) -> None:
        ours, theirs = socket.socketpair()
        # not an MPS client's variables: a supervisor that generates under MPS has them, and a simulator (a
        # replacement started later) would take its SM share and memory limit, or a pipe it should not use
        own = {k: v for k, v in os.environ.items() if not k.startswith(MPS_VARIABLES)}
        env = {**own, **worker_environment(), **self.launch.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [self.launch.python, "-m", "ebrl.envs.process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except OSError as e:
            ours.close()
            raise EnvSetupError(
                f"env.python={self.launch.python!r} cannot be started ({one_line(e)}); "
                "give the path of a Python interpreter"
            ) from e
        finally:
            theirs.close()  # the child's end: so a dead child shows up as EOF instead of a hang
        self._res.process = process
        self._res.conn = multiprocessing.connection.Connection(ours.detach())
        self._send(("init", self.env_cfg, self.seed, self.cpus))

    def connect(self) -> EnvSpec:
        """Receive the spec and attach a slot of `execute` actions (both steps of a started process)."""
        self.receive_spec()
        return self.attach(self.execute)

    def receive_spec(self) -> EnvSpec:
        """The env's spec, sent by the child once its simulator is built (blocks until then)."""
        if self._received_spec is None:
            if not self.connection.poll(self.launch.timeout_s):
                raise EnvSetupError(
                    f"sim worker {self.index} (pid {self.pid}) sent no spec within {self.launch.timeout_s:.0f} s"
                )
            self._received_spec = self._receive("spec")
        return self._received_spec

    def attach(self, execute: int | None) -> EnvSpec:
        """Create the shared slot for chunks of up to `execute` actions and attach the child to it."""
        if self.spec is not None:
            return self.spec
        if execute is None or execute < 1:
            raise ValueError(f"execute={execute} must be >= 1")
        spec = self.receive_spec()
        self.execute = int(execute)
        layout = SlotLayout.build(self.slot_spec or spec, self.execute)
        self._res.shm = SharedMemory(create=True, size=layout.size)
        _BLOCKS[self._res.shm.name] = self._res.shm
        self.slot = Slot.of(layout.views(self._res.shm.buf))
        self._send(("attach", self._res.shm.name, self.execute, self.slot_spec))
        self._receive("ok")
        self.spec = spec
        return spec

    def replace(self, reseed: bool = True) -> None:
        """Kill this env's process and start a fresh one in its place, built from a new seed (reseed=False: from its
        own, as a GRPO group's members must be built alike), with a new shared slot and a new episode begun (its
        first obs is then in `obs`). Blocks until the simulator is built."""
        process = self._res.process
        if process is not None and process.poll() is None:
            process.kill()  # dead, hung or failed: nothing to say goodbye to
        self.close()
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)
        self.replacements += 1
        if reseed:
            self.seed += RESEED  # (each replacement's seed is new: seed + RESEED x reseeded replacements)
        fault = self.env_cfg.get("fault")
        if fault and not fault.get("again"):
            self.env_cfg.pop("fault")  # an injected fault strikes the first process only, unless `again`
        spec, self._received_spec = self.spec, None
        self.spec = None
        self.start(wait=False)
        if self.nice is not None:
            self.renice(self.nice)
        if self.receive_spec() != spec:
            raise EnvSetupError(f"sim worker {self.index}'s replacement reports {self._received_spec}, not {spec}")
        self.attach(self.execute)
        self.reset()

    def renice(self, nice: int) -> None:
        """Run this env's processes (this one and any replacement), every thread of them, at `nice`."""
        self.nice = nice
        if self.pid is not None:  # (serial: this process's own stays)
            set_process_nice(self.pid, nice)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (close, then kill if it does not exit within `timeout` s) and free the shared slot.
        Idempotent."""
        self.slot = None
        self._chunk = None
        if self._finalizer.detach() is not None:
            self._res.release(timeout)

    @property
    def pid(self) -> int | None:
        return self._res.process.pid if self._res.process is not None else None

    @property
    def connection(self) -> multiprocessing.connection.Connection:
        """The pipe end to `multiprocessing.connection.wait` on; readable when a reply is ready."""
        if self._res.conn is None:
            raise EnvSetupError(f"sim worker {self.index} is not running")
        return self._res.conn

    @property
    def shm_name(self) -> str | None:
        return self._res.shm.name if self._res.shm is not None else None

    # --- commands
    def bind(self, cpus: Sequence[int]) -> None:
        """Let the simulator process, every thread of it (a renderer's too), run only on `cpus` from now on (a
        scheduler handing it a core)."""
        if self.pid is not None:  # (serial: the simulators' thread runs where this process does)
            set_process_affinity(self.pid, cpus)
        self.cpus = list(cpus)

    def reset(self, seed: int | None = None) -> None:
        """Start a new episode (blocking); its first obs is then in `obs`."""
        self.send_reset(seed)
        self._receive("ok")

    def send_reset(self, seed: int | None = None) -> None:
        self._check_idle()
        self._send(("reset", seed))

    def submit(self, n_steps: int) -> None:
        """Run actions[:n_steps] in the child (non-blocking); collect with `wait`.

        0 steps runs nothing: the env keeps its state and `wait` reports 0 executed (an env whose
        episode must not go on, e.g. one GRPO episode per env per rollout).
        """
        self._check_idle()
        if not 0 <= n_steps <= self.execute:
            raise ValueError(f"n_steps={n_steps}: this worker's slot holds 0..{self.execute} actions")
        lost = None
        if n_steps:
            try:
                self._send(("chunk", int(n_steps)))
            except EnvSetupError as e:  # it died between chunks: `wait` reports it
                lost = str(e)
        self._chunk = InFlight(empty=n_steps == 0, lost=lost, progress=Progress(self.pid) if n_steps else None)

    def hung(self, limit: float) -> str | None:
        """Why the running chunk counts as hung under `limit` (`Progress`), or None."""
        chunk = self._chunk
        return chunk.progress.hung(limit) if chunk is not None and chunk.progress is not None else None

    def until_check(self, limit: float) -> float | None:
        """Seconds until `hung` is worth asking again (None: no chunk runs)."""
        chunk = self._chunk
        return chunk.progress.until_check(limit) if chunk is not None and chunk.progress is not None else None

    def wait(self, limit: float | None = None) -> ChunkReport:
        """Block until the submitted chunk is done; obs then holds the next decision's observation. Raises
        SimFailure if the process died or failed inside the chunk, and SimHung if it made no progress (`Progress`
        under `limit` seconds; None: wait for ever)."""
        chunk = self._chunk
        if chunk is None:
            raise RuntimeError(f"sim worker {self.index}: wait() without submit()")
        try:
            if chunk.empty:
                return ChunkReport.nothing()
            if chunk.lost is not None:
                raise SimFailure(chunk.lost)
            if limit is not None and chunk.progress is not None:
                while not self.connection.poll(chunk.progress.until_check(limit)):
                    why = chunk.progress.hung(limit)
                    if why is not None:
                        raise SimHung(f"sim worker {self.index} (pid {self.pid}) hung: {why}")
        finally:
            self._chunk = None
        try:
            reply = self._receive("ok") or {}
        except AdapterContractError:
            raise
        except EnvSetupError as e:  # died (EOF) or answered ("error", why)
            raise SimFailure(
                f"sim worker {self.index} (pid {self.pid}) failed: {e}" if "sim worker" not in str(e) else str(e)
            ) from None
        slot = self.slot
        executed, terminated, truncated, has_final = (int(x) for x in slot.header)
        return ChunkReport(
            executed=executed,
            rewards=slot.rewards[:executed].copy(),
            successes=slot.successes[:executed].copy(),
            step_times=slot.step_times[:executed].copy(),
            terminated=bool(terminated),
            truncated=bool(truncated),
            episode=reply.get("episode"),
            final_obs={k: v.copy() for k, v in slot.final.items()} if has_final else None,
            started=float(slot.clock[0]),
            ended=float(slot.clock[1]),
            cpus=tuple(reply.get("cpus", ())),
            cpu_s=float(reply.get("cpu_s", 0.0)),
        )

    @property
    def obs(self) -> dict[str, np.ndarray]:
        """The next decision's observation, in the shared slot (empty before `attach`)."""
        return self.slot.obs if self.slot is not None else {}

    @property
    def actions(self) -> np.ndarray | None:
        """The chunk to run, in the shared slot: write actions[:n] before `submit(n)`."""
        return self.slot.actions if self.slot is not None else None

    # --- plumbing
    def _check_idle(self) -> None:
        if self.spec is None:
            raise RuntimeError(f"sim worker {self.index} is not started")
        if self._chunk is not None:
            raise RuntimeError(f"sim worker {self.index} has a chunk in flight; wait() first")

    def _send(self, message: tuple) -> None:
        try:
            self.connection.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise EnvSetupError(self._died(f"cannot be reached ({type(e).__name__})")) from e

    def _receive(self, expected: str) -> Any:
        try:
            kind, payload = self.connection.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise EnvSetupError(self._died("stopped")) from e
        if kind == "error":
            raise EnvSetupError(payload)
        if kind == "broken":
            raise AdapterContractError(payload)
        if kind != expected:
            raise RuntimeError(f"sim worker {self.index}: expected {expected!r}, got {kind!r}")
        return payload

    def _died(self, what: str) -> str:
        process = self._res.process
        if process is not None:
            try:
                process.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        code = process.returncode if process is not None else None
        return f"sim worker {self.index} (pid {self.pid}) {what}; exit code {code}"


def env_seed(seed: int, env: int, group_size: int = 1) -> int:
    """The seed env `env` of a pool is built from: the envs of a group (GRPO's) share one, so they are alike."""
    return seed * 1000 + env // group_size


class SimWorkerPool:
    """N simulator processes started together, one environment each; env i gets seed
    `seed * 1000 + i // group_size`.

    The envs of a group (GRPO's K envs i // K) are built from one seed, so they are alike where a
    simulator randomises the build itself (robosuite's Lift draws its cube's size when it builds the
    model, once per process): equal reset seeds then give them equal initial states.
    """

    def __init__(
        self,
        env_cfg: dict[str, Any],
        num_envs: int,
        seed: int,
        execute: int | None = None,
        cpus: Sequence[Sequence[int] | None] | None = None,
        group_size: int = 1,
        chunk_timeout_s: float | None = None,
        max_failures: int = 5,
        failure_window_s: float = 600.0,
        process_env: Mapping[str, str] | None = None,
        serial: bool = False,
        episode_seeds: int | None = None,
        on_gpu: bool = False,
    ) -> None:
        """episode_seeds: env i's k-th episode starts from seed episode_seeds + i + k x num_envs (an evaluation's
        episode j from seed episode_seeds + j, however many envs share them); None: from each env's own seed.
        on_gpu: the simulators are meant to render on the run's GPU (`process_env`: simulator_gpu_environment's), so
        simulators that render on the CPU are said, in one line at `start`."""
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs} must be >= 1")
        if group_size < 1 or num_envs % group_size:
            raise ValueError(f"group_size={group_size} must divide num_envs={num_envs}")
        self.num_envs = num_envs
        self.group_size = group_size
        self.execute = execute  # the actions of a chunk the envs execute (policy.execute); may be given at `attach`
        self.chunk_timeout_s = chunk_timeout_s  # a chunk without a result for this long: the simulator hung
        self.max_failures, self.failure_window_s = max_failures, failure_window_s
        self.started_episodes = False  # reset_all succeeded once: a failure in a later one is a simulator failure
        self.failures: list[tuple[float, int, str]] = []  # (time.monotonic(), env, why) of every replacement
        fault = env_cfg.get("fault") or {}  # env.fault (tests): kind, env, chunk, again, seconds (FaultConfig)
        self.tasks = assign_tasks(env_cfg, num_envs, group_size)  # env.tasks: env i's task; None: env.task for all
        own = [
            {k: v for k, v in env_cfg.items() if k != "fault" or (fault.get("kind") and fault["env"] == i)}
            for i in range(num_envs)
        ]
        if episode_seeds is not None:
            for i, cfg_i in enumerate(own):
                cfg_i["episode_seeds"] = [episode_seeds + i, num_envs]
        self.workers = [
            SimWorker(
                task_config(own[i], self.tasks[i]) if self.tasks else own[i],
                env_seed(seed, i, group_size),
                execute,
                index=i,
                cpus=cpus[i] if cpus else None,
                process_env=process_env,
                serial=serial,
            )
            for i in range(num_envs)
        ]
        self.spec: EnvSpec | None = None
        self.on_gpu = on_gpu

    def start(self) -> "SimWorkerPool":
        """Spawn every process first, then collect the specs: the simulators build concurrently.

        With `execute` known the slots are attached too; otherwise call `attach` once the policy
        (built from `spec`) says how many actions of its chunks run.
        """
        try:
            for worker in self.workers:
                worker.start(wait=False)
            specs = [worker.receive_spec() for worker in self.workers]
            if self.tasks:  # tasks may differ in state and action size and instruction: the widest, padded
                self.spec = joint_spec(specs)
                for worker in self.workers:
                    worker.slot_spec = self.spec
            else:
                for i, spec in enumerate(specs[1:], 1):
                    if spec != specs[0]:
                        raise EnvSetupError(f"sim worker {i} reports {spec}, worker 0 {specs[0]}: the envs disagree")
                self.spec = specs[0]
            software = next((spec.software_render for spec in specs if spec.software_render), "")
            if self.on_gpu and software:  # (once: a replacement renders where the one it replaces did)
                from ebrl.telemetry.report import console  # (parent side only: the worker side imports no rich)

                console.print(f"simulators render on the CPU, not on the run's GPU: {software}", soft_wrap=True)
            if self.execute is not None:
                self.attach(self.execute)
        except BaseException:
            self.close()
            raise
        return self

    def attach(self, execute: int) -> None:
        """Give every worker its shared slot for chunks of up to `execute` actions."""
        self.execute = execute
        for worker in self.workers:
            worker.attach(execute)

    def __enter__(self) -> "SimWorkerPool":
        return self.start() if self.spec is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.workers)

    def reset_all(self, seeds: Sequence[int] | None = None) -> int:
        """Start a new episode in every env (see `reset`)."""
        return self.reset(range(len(self.workers)), seeds)

    def reset(self, envs: Sequence[int], seeds: Sequence[int] | None = None) -> int:
        """Start a new episode in these envs, in parallel; env envs[k] from `seeds[k]` if given, else from its own
        next seed. Equal seeds give equal initial states (GRPO's groups). Returns how many simulators failed in the
        reset and were replaced (then reset as asked); in the very first episodes a failure is bad input."""
        envs = list(envs)
        if seeds is not None and len(seeds) != len(envs):
            raise ValueError(f"{len(seeds)} reset seeds for {len(envs)} envs")
        seed_of = {i: None if seeds is None else int(s) for i, s in zip(envs, seeds or [None] * len(envs))}
        failed: dict[int, str] = {}
        for i in envs:
            try:
                self.workers[i].send_reset(seed_of[i])
            except EnvSetupError as e:  # it died since its last chunk
                failed[i] = str(e)
        for i in envs:
            if i not in failed:
                try:
                    self.workers[i]._receive("ok")
                except EnvSetupError as e:  # died, or its adapter raised, inside the reset
                    failed[i] = str(e)
        if failed and not self.started_episodes:  # the very first episodes: the env cannot run at all
            raise EnvSetupError(next(iter(failed.values())))
        for i, why in failed.items():  # a simulator failure, as inside a chunk: replaced, then reset as asked
            self.replace(i, f"{why} (in a reset)")
            if seed_of[i] is not None:
                self.workers[i].reset(seed_of[i])
        self.started_episodes = True
        return len(failed)

    def submit_all(self, n_steps: int | Sequence[int], actions: np.ndarray | None = None) -> None:
        """Start a chunk everywhere: n_steps for every env, or n_steps[i] for env i (0: not stepped);
        `actions` (N, steps, action_dim) is copied in first if given."""
        steps = [n_steps] * len(self.workers) if isinstance(n_steps, (int, np.integer)) else list(n_steps)
        if len(steps) != len(self.workers):
            raise ValueError(f"{len(steps)} step counts for {len(self.workers)} envs")
        for i, (worker, n) in enumerate(zip(self.workers, steps)):
            if actions is not None:
                worker.actions[:n] = actions[i, :n]
            worker.submit(n)

    def wait_all(self) -> list[ChunkReport]:
        """Every env's chunk (submitted together), a failed one replaced and reported as `failed`."""
        return [self.wait_chunk(i) for i in range(len(self.workers))]

    def wait_chunk(self, env: int) -> ChunkReport:
        """Env `env`'s chunk; if its simulator died, failed or hung (no progress for chunk_timeout_s: `Progress`), it
        is replaced and the chunk reports `failed`. Raises SimulatorsFailing when replacements come too often."""
        try:
            report = self.workers[env].wait(self.chunk_timeout_s)
        except SimHung as e:
            return self.replace(env, f"{e} (scheduler.chunk_timeout_s={self.chunk_timeout_s:g})")
        except SimFailure as e:
            return self.replace(env, str(e))
        if self.tasks and report.episode is not None:
            report.episode["task"] = self.tasks[env]  # a multi-task run's per-task metrics
        return report

    def replace(self, env: int, why: str) -> ChunkReport:
        """Replace env `env`'s simulator process (see `SimWorker.replace`) and record why."""
        now = time.monotonic()
        self.failures.append((now, env, why))
        recent = [f for f in self.failures if now - f[0] <= self.failure_window_s]
        if len(recent) > self.max_failures:
            raise SimulatorsFailing(
                f"{len(recent)} simulator failures within {self.failure_window_s:.0f} s, more than "
                f"scheduler.max_sim_failures={self.max_failures} (the last: {why})"
            )
        from ebrl.telemetry.report import console  # (parent side only: the worker side imports no rich)

        console.print(f"{why}: replaced by a fresh simulator; its partial episode is discarded", soft_wrap=True)
        # in a group (GRPO) the members are built from one seed (Lift draws its cube then): the replacement too
        self.workers[env].replace(reseed=self.group_size == 1)
        return ChunkReport.nothing(truncated=True, failed=why)

    def stacked_obs(self) -> dict[str, np.ndarray]:
        """Every env's current obs as (N, ...) arrays (one copy)."""
        keys = self.workers[0].obs.keys()
        return {key: np.stack([worker.obs[key] for worker in self.workers]) for key in keys}

    def close(self, grace: float = 5.0) -> None:
        """Stop every process: ask all to close first, so they exit concurrently, then reap each, killing what has not
        exited within `grace` s of the ask, all together (a loaded machine's simulators may be slow to exit: a stop
        does not wait that long for each)."""
        for worker in self.workers:
            if worker._res.conn is not None:
                send_quietly(worker._res.conn, ("close",))
        deadline = time.monotonic() + grace
        for worker in self.workers:
            worker.close(max(0.0, deadline - time.monotonic()))
