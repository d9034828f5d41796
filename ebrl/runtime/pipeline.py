"""The pipelined runtime behind `scheduler=ebrl | async | hybrid | disaggregated` (docs/design.md, "The schedules"
and "The pipelined loop").

One event loop in the supervisor drives the simulator processes, generation (in this process, or in its own:
ebrl/runtime/generation.py) and the trainer process. The modes are switches of this one loop, not separate code:

- `overlap`: the trainer trains on iteration i-1 while rollout i collects (the rollout runs at most
  `max_ahead` iterations ahead of the finished updates). Weights come back with a version and are
  swapped at a chunk boundary; every chunk records its version; at training time chunks older than
  `max_staleness` versions (by default max_ahead: none) are masked out and counted, and the loss is
  decoupled PPO. Without it, a rollout waits for the previous update (synchronous).
- `groups`: the envs split into groups; a group whose chunk ended queues for generation, which
  serves every queued group in one batch while the others simulate. One group = lockstep.
- `core_rebinding`: the scheduler owns the simulation cores; an env runs its chunk only while it
  holds one (every thread of its process pinned to it), and a freed core goes to the ready env with the longest EMA
  step time. Off: every ready env is submitted at once and the OS places them.
- `sim_nice`: the simulators' nice value; generation and training (nice 0) take a shared core first.
- `train_share`: the share of the cores given to the trainer alone (disaggregated; on GPUs the
  second GPU); null: it shares every core.

Inside a chunk every env steps on its own (its chunk runs in its process without a barrier); the
observations, rewards and dones cross through each env's shared-memory slot.
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from ebrl.config import cuda_device_count, train_core_count
from ebrl.envs.worker import ChunkReport, SimWorkerPool
from ebrl.policies.base import Policy
from ebrl.policies.training import lora_scaling
from ebrl.rl.rollout import ChunkStep, RolloutStats, batch_obs, batch_shapes
from ebrl.runtime.generation import GenerationProcess, InProcessGeneration
from ebrl.runtime.channel import WeightChannel
from ebrl.runtime.loop import Group, RolloutLoop, Serving
from ebrl.runtime.messages import State, Trained
from ebrl.node import set_process_affinity
from ebrl.runtime.trainer_process import TrainerProcess, TrainerStage
from ebrl.telemetry.timers import StageTimers
from ebrl.telemetry.trace import Trace


@dataclass(frozen=True)
class Schedule:
    """The switches of one mode (read from `scheduler.*`)."""

    overlap: bool
    groups: int
    core_rebinding: bool
    max_ahead: int
    max_staleness: int
    queue_size: int | None  # groups that may wait for generation at once; null: all
    train_share: float | None  # share of the cores for the trainer alone; null: it shares every core
    decoupled: bool  # with overlap: decoupled PPO (clip around the proximal policy, weight to the behaviour one)
    is_clip: float  # truncation of the behaviour importance weight (decoupled PPO)
    train_threads: int | None
    sim_nice: int

    @classmethod
    def from_config(cls, scheduler: dict[str, Any]) -> "Schedule":
        return cls(**{name: scheduler[name] for name in cls.__dataclass_fields__})

    @property
    def ahead(self) -> int:
        """How many iterations the rollout may run ahead of the last finished update: `max_ahead` with overlap
        (1: rollout i collects while iteration i-1 trains), none without."""
        return self.max_ahead if self.overlap else 0


class CorePool:
    """The simulation cores: an env runs only while it holds one; a freed core goes to the ready env
    with the longest estimated step time (EMA of its measured steps; never-measured envs first)."""

    def __init__(self, cores: Sequence[int], alpha: float = 0.3) -> None:
        if not cores:
            raise ValueError("a core pool needs at least one core")
        self.cores: list[int] = list(cores)
        self.free: list[int] = list(cores)
        self.core_of: dict[int, int] = {}  # env -> the core it holds
        self.ready: list[int] = []  # envs with a chunk to run, in arrival order
        self.ema: dict[int, float] = {}
        self.alpha = alpha
        self.decisions: deque[tuple[int, int, float, float]] = deque(maxlen=100_000)  # env, core, its est., max other

    def estimate(self, env: int) -> float:
        return self.ema.get(env, math.inf)

    def observe(self, env: int, step_s: float) -> None:
        old = self.ema.get(env)
        self.ema[env] = step_s if old is None else (1 - self.alpha) * old + self.alpha * step_s

    def push(self, env: int) -> None:
        self.ready.append(env)

    def release(self, env: int) -> int:
        core = self.core_of.pop(env)
        if core in self.cores:  # (a core taken away by `resize` while an env held it is not handed on)
            self.free.append(core)
        return core

    def resize(self, cores: Sequence[int]) -> None:
        """Simulate on these cores from now on; an env holding a core that was taken away finishes its chunk."""
        if not cores:
            raise ValueError("a core pool needs at least one core")
        held = set(self.core_of.values())
        self.cores = list(cores)
        self.free = [core for core in self.cores if core not in held]

    def dispatch(self) -> list[tuple[int, int]]:
        """Hand free cores to ready envs, longest estimated step first (ties: first come)."""
        out = []
        while self.free and self.ready:
            env = max(self.ready, key=self.estimate)  # max returns the first of equals
            self.ready.remove(env)
            others = max((self.estimate(e) for e in self.ready), default=-math.inf)
            core = self.free.pop(0)
            self.core_of[env] = core
            self.decisions.append((env, core, self.estimate(env), others))
            out.append((env, core))
        return out


@dataclass(frozen=True)
class ChunkEnded:
    """The dispatcher's report: env `env`'s chunk ended (or failed: `report.failed`)."""

    env: int
    report: ChunkReport


@dataclass(frozen=True)
class TrainerSaid:
    """The dispatcher's report: the trainer process sent this."""

    message: Trained | State


@dataclass(frozen=True)
class Broke:
    """The dispatcher's report: it, or the trainer, failed; the main thread raises `error`."""

    error: BaseException


Event = ChunkEnded | TrainerSaid | Broke


class Dispatcher:
    """The thread that runs chunks: it waits on every simulator pipe and the trainer's, so a finished
    chunk frees its core and the next ready env starts at once, even while the main thread generates.

    The main thread hands it envs whose actions are written (`ready`) and reads what happened from
    `events`: `ChunkEnded`, `TrainerSaid` or `Broke`.
    """

    def __init__(self, pool: SimWorkerPool, cores: CorePool | None, trainer: TrainerProcess) -> None:
        self.pool, self.cores, self.trainer = pool, cores, trainer
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready: list[int] = []  # without a core pool: envs to submit at once
        self._running: dict[Any, int] = {}  # worker connection -> env
        self._since: dict[int, float] = {}  # env -> time.monotonic() its chunk was submitted
        self._wake_recv, self._wake_send = multiprocessing.Pipe(duplex=False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ebrl-dispatcher", daemon=True)
        self._thread.start()

    def ready(self, envs: Sequence[int]) -> None:
        """These envs' actions are in their slots: run their chunks as cores allow."""
        with self._lock:
            for env in envs:
                if self.cores is None:
                    self._ready.append(env)
                else:
                    self.cores.push(env)
        self._wake_send.send_bytes(b"!")

    def resize(self, cores: Sequence[int]) -> None:
        """Hand chunks out on these sim cores from now on (with a core pool; without one, nothing to do here)."""
        if self.cores is not None:
            with self._lock:
                self.cores.resize(cores)
            self._wake_send.send_bytes(b"!")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_send.send_bytes(b"!")
        except OSError:
            pass
        self._thread.join(10.0)

    def _start_ready(self) -> None:
        with self._lock:
            if self.cores is None:
                starting, self._ready = [(env, None) for env in self._ready], []
            else:
                starting = self.cores.dispatch()
        for env, core in starting:
            worker = self.pool.workers[env]
            if core is not None:
                worker.bind([core])
            worker.submit(worker.chunk_len)
            self._running[worker.connection] = env
            self._since[env] = time.monotonic()

    def _until_overdue(self) -> float | None:
        """Seconds until the oldest running chunk passes the pool's chunk timeout (None: no timeout or none runs)."""
        if self.pool.chunk_timeout_s is None or not self._since:
            return None
        return max(0.0, min(self._since.values()) + self.pool.chunk_timeout_s - time.monotonic())

    def _overdue(self) -> list[Any]:
        """Connections of chunks past the timeout (their wait_chunk then finds no result and replaces them)."""
        if self.pool.chunk_timeout_s is None:
            return []
        now = time.monotonic()
        return [conn for conn, env in self._running.items() if now - self._since[env] >= self.pool.chunk_timeout_s]

    def swap_trainer(self, trainer: TrainerProcess) -> None:
        """Wait on this trainer's pipes from the next round on (a respawn's successor); messages of the one before
        are dropped from then on (it has answered everything it was sent)."""
        with self._lock:
            self.trainer = trainer
        self._wake_send.send_bytes(b"!")

    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    trainer = self.trainer
                results, died = trainer.waitables
                self._start_ready()
                ready = multiprocessing.connection.wait([*self._running, results, died, self._wake_recv],
                                                        timeout=self._until_overdue())
                # a chunk past the timeout is taken as hung: wait_chunk replaces it and reports a failed chunk
                for conn in list(dict.fromkeys([*ready, *self._overdue()])):
                    if conn is self._wake_recv:
                        while conn.poll():
                            conn.recv_bytes()
                    elif conn is results or (conn is died and not results.poll()):
                        if trainer is self.trainer:  # (else it was replaced while we waited)
                            self.events.put(TrainerSaid(trainer.receive()))
                    elif conn in self._running:
                        env = self._running.pop(conn)
                        since = self._since.pop(env)
                        timeout = self.pool.chunk_timeout_s
                        report = self.pool.wait_chunk(env, None if timeout is None else
                                                      timeout - (time.monotonic() - since))
                        if self.cores is not None:
                            with self._lock:
                                self.cores.release(env)
                                if report.executed:
                                    self.cores.observe(env, float(report.step_times.mean()))
                        self.events.put(ChunkEnded(env, report))
        except Exception as e:  # noqa: BLE001  (the main thread raises it)
            if not self._stopping:
                self.events.put(Broke(e))


class PipelineScheduler:
    """Rollout by one event loop over simulator pipes and the trainer's pipe; see the module docstring."""

    def __init__(self, pool: SimWorkerPool, policy: Policy, timers: StageTimers, device: torch.device,
                 conf: dict[str, Any], cores: Sequence[int], base_version: int = 0, resume: str | None = None,
                 generation: str = "supervisor", seed: int | None = None,
                 spawn_env: Callable[[str], ContextManager] | None = None) -> None:
        self.pool, self.policy, self.timers, self.device = pool, policy, timers, device
        self.schedule = s = Schedule.from_config(conf["scheduler"])
        self.base_version = base_version  # updates made before this run started (a resumed run)
        self.iterations = int(conf["iterations"]) - base_version  # updates this run makes
        self.loop = RolloutLoop(len(pool.workers), s.groups, int(conf["algo"]["rollout_chunks"]), self.iterations,
                                s.ahead, s.max_staleness, s.queue_size, base_version)
        tokens, mask = policy.tokenize([w.spec.instruction for w in pool.workers])
        self.tokens, self.token_mask = torch.from_numpy(tokens), torch.from_numpy(mask)
        self.trace = Trace()

        cores = list(cores)
        k = train_core_count(self.schedule.train_share, len(cores)) if self.schedule.train_share else 0
        train_cpus = cores[len(cores) - k:] if k else cores
        self.sim_cpus = cores[: len(cores) - k] if k else cores
        self._affinity = os.sched_getaffinity(0)  # given back at close
        set_process_affinity(os.getpid(), self.sim_cpus)  # generation runs beside the simulators
        for worker in pool.workers:
            worker.bind(self.sim_cpus)
            # generation and training are on the critical path of every env: when they want a shared core they get
            # it first, and the simulators fill what is left (README, "Measured choices")
            worker.renice(self.schedule.sim_nice)
        cores = CorePool(self.sim_cpus) if self.schedule.core_rebinding else None

        train_device = str(device)
        if device.type == "cuda" and k and cuda_device_count() > 1:  # (NVML: starts no CUDA here)
            train_device = "cuda:1"  # disaggregated: training on its own GPU
        # training alone on its cores (its own share, or without overlap, when the rollout waits for it) uses them
        # all; sharing them with the rollout on CPU, one thread (see experiment.generation_threads)
        alone = k or device.type == "cuda" or not self.schedule.overlap
        threads = self.schedule.train_threads or (len(train_cpus) if alone else 1)
        # each child starts in its stage's environment (spawn_env: a resource pool's MPS share and GPU)
        spawn_env = spawn_env or (lambda stage: contextlib.nullcontext())
        # on one GPU generation reads the trainer's published weights on the device (CUDA IPC), else from host memory
        channel = WeightChannel(policy.state_dict(), torch.multiprocessing.get_context("spawn"), policy.compute_dtype,
                                cuda=device.type == "cuda" and train_device == str(device),
                                lora_scaling=lora_scaling(conf["policy"]))
        with spawn_env("train"):
            self.trainer = TrainerStage(conf, pool.spec, channel, train_cpus, threads, train_device, resume)
        if generation == "process":  # its own process, on the simulators' cores until a lease moves it
            seed = int(conf["seed"]) + 2 if seed is None else seed
            try:
                with spawn_env("generate"):
                    self.generation: InProcessGeneration | GenerationProcess = GenerationProcess(
                        conf["policy"], pool.spec, channel, self.sim_cpus, torch.get_num_threads(),
                        str(device), seed)
            except BaseException:
                self.trainer.close()
                raise
        else:
            self.generation = InProcessGeneration(policy, device, channel)
        self.version = 0  # of the weights generation sampled with last, counted by the channel
        self.last_shapes: dict[str, tuple[int, ...]] = {}  # of the last batch sent to training
        # the trainer sends its state after each update a checkpoint is due at (FSDP: every rank's trainer gathers
        # it then, together), so a checkpoint holds exactly the weights of its iteration
        self.checkpoint_every = int(conf["checkpoint_every"])
        self.dispatcher = Dispatcher(pool, cores, self.trainer.process)
        self.results: dict[int, tuple[RolloutStats, dict[str, float]]] = {}
        self.returned = 0  # iterations handed to the caller
        self.shipped: dict[int, tuple[RolloutStats, dict[str, float]]] = {}  # sent to the trainer, not yet trained

    # --- the caller's view ----------------------------------------------------------------------
    def next_iteration(self) -> tuple[RolloutStats, dict[str, float]]:
        """Drive the loop until the next iteration's update finished; its rollout stats and metrics."""
        want = self.returned
        while want not in self.results:
            self._step()
        self.returned += 1
        return self.results.pop(want)

    def gathered_state(self, iteration: int) -> tuple[dict[str, torch.Tensor], dict]:
        """The model and optimizer state the trainer sent right after update `iteration` (the run's count), which it
        does at every iteration a checkpoint is due at (`checkpoint_every`, and the last)."""
        k = iteration - self.base_version - 1  # this run's index of that update
        while (state := self.trainer.take_gathered(k)) is None:
            self._handle(self.dispatcher.events.get())
        return state

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The trainer's model and optimizer state after every update sent so far (a checkpoint on the way out). Those
        updates' results arrive before it, so `unreturned` then hands out those the caller has not seen."""
        self.trainer.process.request_state()
        while self.trainer.state is None:
            try:
                self._handle(self.dispatcher.events.get(timeout=1.0))
            except queue.Empty:
                if not self.dispatcher.alive:  # it stopped on an error (the run is stopping): read the trainer here
                    self._trainer_message(self.trainer.process.receive())
        state, self.trainer.state = self.trainer.state, None
        return state

    def unreturned(self) -> list[tuple[RolloutStats, dict[str, float]]]:
        """The results of updates the trainer finished that `next_iteration` has not handed out yet, in order; handed
        out now (a run stopping counts them)."""
        out = [self.results.pop(k) for k in sorted(self.results)]
        self.returned += len(out)
        return out

    def simulate_on(self, cpus: Sequence[int]) -> None:
        """Simulate on these cores from now on (an allocator's plan): the core pool's cores, or, without core
        rebinding, every simulator's affinity. Generation and training move with their leases (ResourcePool)."""
        self.sim_cpus = list(cpus)
        self.dispatcher.resize(self.sim_cpus)
        if self.dispatcher.cores is None:
            for worker in self.pool.workers:
                worker.bind(self.sim_cpus)

    def regroup(self, groups: int) -> None:
        """Serve generation in `groups` groups (batches of num_envs / groups envs, an allocator's new plan) from the
        next segment boundary that every group can reach (RolloutLoop.regroup)."""
        self.loop.regroup(groups)

    def respawn_trainer(self, cpus: Sequence[int] | None = None) -> None:
        """Start a successor trainer in this process's environment of the moment (a new MPS share: set it around
        this call), on `cpus` if given. Once it is ready it takes over between two updates: the trainer finishes
        the updates sent to it, its model and Adam state go to the successor, and it stops. Rollout goes on
        meanwhile; only the handover waits for the update in flight. A successor still starting is replaced."""
        self.trainer.respawn(cpus)

    def wait_trainer_switch(self, timeout: float = 600.0) -> None:
        """Block until a started successor has taken over (tests; a run's end)."""
        if self.trainer.successor_ready(timeout):
            self._hand_over()

    def close(self) -> None:
        self.dispatcher.stop()
        self.generation.close()
        self.trainer.close()
        set_process_affinity(os.getpid(), self._affinity)

    # --- the loop ------------------------------------------------------------------------------
    def _step(self) -> None:
        """Hand training over to a successor that is ready, generate for the queued groups (if any), then handle
        what the dispatcher reported meanwhile (waiting for at least one event when there was nothing to generate)."""
        if self.trainer.successor_ready():
            self._hand_over()
        serving = self.loop.serve()
        if serving is not None:
            self._generate(serving)
        events = self.dispatcher.events
        self._handle(events.get() if not self.loop.queue else events.get_nowait() if not events.empty() else None)
        while not events.empty():
            self._handle(events.get_nowait())

    def _handle(self, event: Event | None) -> None:
        if isinstance(event, ChunkEnded):
            self._chunk_reported(event.env, event.report)
        elif isinstance(event, TrainerSaid):
            self._trainer_message(event.message)
        elif isinstance(event, Broke):  # the dispatcher or the trainer failed
            raise event.error

    def _chunk_reported(self, env: int, report: ChunkReport) -> None:
        if report.failed is None:
            self.trace.add(f"simulate/env{env}", "chunk", report.started, report.ended, steps=report.executed,
                           step_s=float(report.step_times.sum()), cpus=list(report.cpus),
                           version=int(self.loop.group_of[env].pending.version[0]))
        self.loop.reported(env, report)

    def _generate(self, serving: Serving) -> None:
        """Serve these groups in one batch: finish their chunk steps (cutoff and bootstrap values), swap in newer
        weights at this chunk boundary, and sample the next chunks."""
        t0 = time.perf_counter()
        with self.timers.stage("generate"), torch.inference_mode():
            cut = serving.cut
            if cut:  # values of the obs episodes were cut off on (their step limit), by the weights that acted
                finals = self._batch_obs([o for g in cut for o in g.cut_obs],
                                         [g.envs[j] for g in cut for j in g.steps[-1].cut])
                values = self.generation.value(finals)
                for g, rows in zip(cut, self._rows([len(g.cut_obs) for g in cut])):
                    g.set_cutoff_values(values[rows], {k: v[rows] for k, v in finals.items()})
            held = serving.held
            if held:  # a segment's bootstrap value, by the weights that acted, without sampling
                envs = [i for g in held for i in g.envs]
                obs = self._batch_obs([self.pool.workers[i].obs for i in envs], envs)
                values = self.generation.value(obs)
                for g, rows in zip(held, self._rows([len(g.envs) for g in held])):
                    self._finish_segment(g, values[rows], {k: v[rows] for k, v in obs.items()})
            starting = serving.starting
            if starting:
                envs = [i for g in starting for i in g.envs]
                obs = self._batch_obs([self.pool.workers[i].obs for i in envs], envs)
                out = self.generation.sample(obs)  # newer weights first (a chunk boundary)
                self.version = out.version
                chunk = out.chunk.float()
                for g, rows in zip(starting, self._rows([len(g.envs) for g in starting])):
                    if g in serving.ending:  # its segment's bootstrap value: from this sample's prefix
                        self._finish_segment(g, out.value[rows], {k: v[rows] for k, v in obs.items()})
                    self.loop.started(g, ChunkStep(
                        obs={k: v[rows] for k, v in obs.items()}, chunk=out.chunk[rows],
                        extras={k: v[rows] for k, v in out.extras.items()},
                        log_prob=out.log_prob[rows], value=out.value[rows],
                        version=torch.full((len(g.envs),), self.base_version + self.version, dtype=torch.long),
                    ))
                    for i, actions in zip(g.envs, chunk[rows].numpy()):
                        self.pool.workers[i].actions[: len(actions)] = actions
                    self.dispatcher.ready(g.envs)
            self.loop.served(serving)
        self.trace.add("generate", "sample", t0, time.perf_counter(), groups=[g.index for g in serving.groups],
                       version=self.version, pid=self.generation.pid)

    @staticmethod
    def _rows(sizes: list[int]) -> list[slice]:
        """Consecutive row ranges of these sizes in a batch."""
        ends = np.cumsum([0, *sizes])
        return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]

    def _finish_segment(self, group: Group, last_value: torch.Tensor, last_obs: dict[str, torch.Tensor]) -> None:
        """The group collected its chunks of one iteration; once every group did, ship that iteration (with the
        observations of its bootstrap values: a decoupled update values them with its own critic)."""
        shipment = self.loop.finish_segment(group, last_value, last_obs)
        if shipment is None:
            return
        iteration = shipment.iteration
        self.last_shapes = batch_shapes(shipment.batch)
        self.shipped[iteration] = (shipment.stats, {"sched/dropped_chunks": float(shipment.dropped),
                                                    "sched/staleness_mean": shipment.staleness})
        decoupled = self.schedule.overlap and self.schedule.decoupled
        k = self.base_version + iteration + 1  # the run's count after this update
        gather = k % self.checkpoint_every == 0 or k == self.base_version + self.iterations
        self.trainer.process.train(iteration, shipment.batch, decoupled=decoupled, is_clip=self.schedule.is_clip,
                                   gather=gather)

    def _hand_over(self) -> None:
        """The ready successor trains from the next update on, with the trainer's state after every update sent to
        it (their results are handled meanwhile); the dispatcher waits on its pipes from its next round."""
        model, optimizer = self.training_state()
        self.trainer.switch(model, optimizer, release=self.generation.release, swap=self.dispatcher.swap_trainer)

    def _trainer_message(self, message: Trained | State) -> None:
        message = self.trainer.take(message)
        if message is None:  # a state, kept
            return
        iteration = message.iteration
        self.trace.add("train", "update", message.start, message.published, iteration=iteration)
        self.trace.add("train", "publish", message.published, message.end, iteration=iteration,
                       version=message.version)
        stats, shipped = self.shipped.pop(iteration)
        metrics = {**message.metrics, **shipped, "sched/weights_version": float(self.base_version + message.version)}
        self.results[iteration] = (stats, metrics)
        self.loop.trained()

    # --- helpers -------------------------------------------------------------------------------
    def _batch_obs(self, per_env: list[dict[str, np.ndarray]], envs: list[int]) -> dict[str, torch.Tensor]:
        return batch_obs(per_env, self.tokens, self.token_mask, envs)
