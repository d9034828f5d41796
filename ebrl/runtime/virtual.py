"""The runtime in virtual time: the real `Scheduler`, `RolloutLoop` and `CorePool` driven by modelled stages, with no
process, thread or policy (docs/at-scale.md; `python -m ebrl.bench.at_scale`).

`Scheduler` takes its trainer, generation and dispatcher from a factory and stamps its trace with a clock
(ebrl/runtime/schedule.py); here those are modelled and the clock is a `World`'s:

- `Cpu`: a node's cores as a fluid model. A task is CPU work (seconds of one thread), its threads, its nice and the
  cores it may run on. Threads are spread over their allowed cores, pinned ones first, each onto the allowed core with
  the least weight (as Linux's load balancing tends to); a core's time goes to its threads in proportion to their
  weight (nice 0 = 1024, each nice step 1.25x less, as CFS), less the measured cost of sharing a core (switches,
  cold caches); one-thread tasks that may run on the same cores at the same nice get the mean of their shares (the
  OS migrates them). A task of several threads moves at its slowest thread's pace times their number (OpenMP threads
  wait for each other at every barrier) times its parallel efficiency.
- `World`: the clock and the CPU, advanced from one task's completion to the next. What the supervisor does
  synchronously (generation in the supervisor, a local trainer's update, resets) runs the world until its task is
  done; what happens meanwhile (chunks ending) is queued, as the dispatcher thread would have queued it.
- `VirtualPool` / `VirtualDispatcher`: each env's chunk is a one-thread task of the env's drawn step costs; episodes
  end at their drawn length. With core rebinding the real `CorePool` hands out the cores.
- `Gpu`: a GPU as a fluid too. A call with an SM share (an MPS client's) runs at its own pace whatever else runs;
  calls without one (the whole GPU: colocated, or before a plan) split the GPU evenly in time. A call's length at
  its share comes from the cost model (ebrl/alloc/gpu_cost.py: a roofline per operation, with the host's time to
  issue each), and so does the share of the SMs its kernels keep busy.
- `ModelGeneration`, `ModelTrainer`: a batch's CPU work from the cost model, on the cores and threads the
  `Placement` gives the stage; on a GPU node a GPU call at the stage's SM share.

What is not modelled yet is listed in `NOT_MODELLED`; a figure from this module is a prediction, labelled simulated.
"""
from __future__ import annotations

import heapq
import math
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ebrl.envs.base import EnvSpec
from ebrl.envs.worker import ChunkReport
from ebrl.runtime.dispatcher import ChunkEnded, CorePool, Event, TrainerSaid
from ebrl.runtime.messages import Sampled, State, Trained
from ebrl.runtime.trainer import Trainer

NOT_MODELLED = ("memory", "failures and timeouts", "the supervisor's own CPU per event (orchestration)",
                "the cores a GPU stage's host thread takes from the simulators", "weight publication's copies")
NICE_0 = 1024.0


def weight(nice: int) -> float:
    """CFS's weight of a nice value: 1024 at 0, 1.25x less per step."""
    return NICE_0 / 1.25 ** nice


@dataclass(eq=False)
class Task:
    """CPU work: `work` seconds of one thread, run by `threads` threads on `cores` at `nice`; `efficiency`: its
    speed-up on that many threads over their number (1: perfectly parallel). `done` runs at the completion."""

    name: str
    work: float
    threads: int
    cores: tuple[int, ...]
    nice: int = 0
    efficiency: float = 1.0
    done: Callable[[], None] | None = None
    started: float = 0.0
    rate: float = 0.0  # one-thread seconds of work per second, as last allotted
    gpu: bool = False  # a GPU call: `work` is its seconds at its share (`sm`; None: the whole GPU, time-shared)
    sm: float | None = None
    sm_busy: float = 0.0  # the share of the whole GPU's SMs its kernels keep busy while it runs alone


class Device:
    """Tasks on a part of the node, each moving at the rate `allot` gives it; `spent` per stage (the part of a
    task's name before "/")."""

    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}  # id -> task, in start order (a completion leaves in O(1))
        self.spent: dict[str, float] = {}
        self.model_s = 0.0  # this machine's seconds spent in the model itself (the driver's own cost, not the run's)

    def allot(self) -> None:
        raise NotImplementedError

    def advance(self, dt: float) -> None:
        raise NotImplementedError

    def next_done(self) -> tuple[float, Task] | None:
        """Seconds until the next task completes, and that task."""
        t0 = time.perf_counter()
        best = None
        for task in self.tasks.values():
            if task.rate > 0:
                dt = max(task.work, 0.0) / task.rate
                if best is None or dt < best[0]:
                    best = (dt, task)
        self.model_s += time.perf_counter() - t0
        return best


class Cpu(Device):
    """See the module docstring: the tasks on a node's cores and the rate each moves at."""

    def __init__(self, cores: int, timeslice: float = 0.0) -> None:
        """timeslice: the CPU a thread loses to switches and cold caches while it shares its core with others, as a
        fraction of its work (measured: a lockstep rollout's CPU per env step over one env per core's, minus 1)."""
        super().__init__()
        self.cores, self.timeslice = cores, timeslice
        self.occupied = [False] * cores  # cores with a thread on them, as last allotted
        self.core_busy = [0.0] * cores  # seconds each core had a thread on it

    def allot(self) -> None:
        """Each task's rate from where its threads go and how the cores' time divides."""
        t0 = time.perf_counter()
        load = [0.0] * self.cores
        placed: list[tuple[Task, int]] = []
        heap: list[tuple[float, int]] = []  # (load, core) of the allowed cores of a run of tasks with the same ones
        heap_cores: tuple[int, ...] | None = None
        for task in sorted(self.tasks.values(), key=lambda t: len(t.cores)):  # (pinned first)
            w = weight(task.nice)
            if task.cores != heap_cores:  # (the least-loaded core, lowest index first, as min() over them would)
                heap_cores, heap = task.cores, [(load[c], c) for c in task.cores]
                heapq.heapify(heap)
            for _ in range(task.threads):
                _, core = heapq.heappop(heap)
                load[core] += w
                heapq.heappush(heap, (load[core], core))
                placed.append((task, core))
        threads_on = [0] * self.cores
        for _, core in placed:
            threads_on[core] += 1
        self.occupied = [n > 0 for n in threads_on]
        shares = [weight(task.nice) / load[core] / (1 + self.timeslice if threads_on[core] > 1 else 1)
                  for task, core in placed]
        # one-thread tasks free to move between the same cores at the same nice even out over time (the OS migrates
        # them); the threads of one multi-threaded task do not: each barrier waits for the one that shares its core
        alike: dict[tuple, list[int]] = {}
        for j, (task, _) in enumerate(placed):
            if len(task.cores) > 1 and task.threads == 1:
                alike.setdefault((task.cores, task.nice), []).append(j)
        for members in alike.values():
            mean = sum(shares[j] for j in members) / len(members)
            for j in members:
                shares[j] = mean
        slowest: dict[int, float] = {}
        for (task, _), share in zip(placed, shares):
            slowest[id(task)] = min(slowest.get(id(task), math.inf), share)
        for task in self.tasks.values():
            task.rate = task.threads * slowest[id(task)] * task.efficiency
        self.model_s += time.perf_counter() - t0

    def advance(self, dt: float) -> None:
        """Move every task on by `dt` seconds; the CPU each used counts for its stage (the part of its name before
        "/"), waiting threads of a multi-threaded task included (they spin)."""
        t0 = time.perf_counter()
        for task in self.tasks.values():
            task.work -= task.rate * dt
            stage = task.name.split("/", 1)[0]
            self.spent[stage] = self.spent.get(stage, 0.0) + dt * task.rate / task.efficiency
        for core, on in enumerate(self.occupied):
            if on:
                self.core_busy[core] += dt
        self.model_s += time.perf_counter() - t0


class Gpu(Device):
    """One GPU (see the module docstring): `spent[stage]` counts the SM-seconds its kernels kept busy (in whole-GPU
    seconds), `active` the seconds any call ran."""

    def __init__(self) -> None:
        super().__init__()
        self.active = 0.0

    def allot(self) -> None:
        whole = sum(1 for t in self.tasks.values() if t.sm is None)
        for task in self.tasks.values():
            task.rate = 1.0 if task.sm is not None else 1.0 / whole

    def advance(self, dt: float) -> None:
        if self.tasks:
            self.active += dt
        for task in self.tasks.values():
            task.work -= task.rate * dt
            stage = task.name.split("/", 1)[0]
            self.spent[stage] = self.spent.get(stage, 0.0) + dt * task.rate * task.sm_busy


class World:
    """The virtual clock, the node's CPU and (one rank's) GPU."""

    def __init__(self, cores: int, timeslice: float = 0.0) -> None:
        self.now = 0.0
        self.cpu = Cpu(cores, timeslice)
        self.gpu = Gpu()
        self.events = VirtualEvents(self)

    def clock(self) -> float:
        return self.now

    @property
    def model_s(self) -> float:
        """This machine's seconds in the CPU's and the GPU's models so far."""
        return self.cpu.model_s + self.gpu.model_s

    def device(self, task: Task) -> Device:
        return self.gpu if task.gpu else self.cpu

    def start(self, *tasks: Task) -> None:
        """Start these tasks now: the rates are allotted once, after the last (no time passes between them)."""
        devices = {}
        for task in tasks:
            task.started = self.now
            device = self.device(task)
            device.tasks[id(task)] = task
            devices[id(device)] = device
        for device in devices.values():
            device.allot()

    def step(self) -> bool:
        """Advance to the next task's completion and run what it triggers; False: nothing is running."""
        nexts = [n for n in (self.cpu.next_done(), self.gpu.next_done()) if n is not None]
        if not nexts:
            return False
        dt, task = min(nexts, key=lambda n: n[0])
        self.cpu.advance(dt)
        self.gpu.advance(dt)
        self.now += dt
        device = self.device(task)
        del device.tasks[id(task)]
        device.allot()
        if task.done is not None:
            task.done()
        return True

    def run(self, task: Task) -> float:
        """Run `task` to its end (the caller waits for it, as the supervisor for its own work); its duration."""
        finished = []
        inner = task.done
        task.done = lambda: (finished.append(True), inner and inner())
        start = self.now
        self.start(task)
        while not finished:
            if not self.step():
                raise RuntimeError(f"virtual time: {task.name} cannot finish")
        return self.now - start


class VirtualEvents:
    """The dispatcher's event queue in virtual time: `get` advances the world until something is queued."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.queued: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.count = 0  # events put: chunk ends and trainer messages

    def put(self, event: Event) -> None:
        self.queued.put(event)
        self.count += 1

    def empty(self) -> bool:
        return self.queued.empty()

    def get_nowait(self) -> Event:
        return self.queued.get_nowait()

    def get(self, timeout: float | None = None) -> Event:
        while self.queued.empty():
            if not self.world.step():
                raise RuntimeError("virtual time: the loop waits for an event nothing will send (a deadlock)")
        return self.queued.get_nowait()


# --- costs -------------------------------------------------------------------------------------
class Costs(Protocol):
    """The cost model: CPU seconds of one thread (see ebrl/bench/at_scale.py for the measured and published ones)."""

    def sim_steps(self, env: int, n: int, rng: np.random.Generator) -> np.ndarray: ...
    def episode_length(self, env: int, rng: np.random.Generator) -> int: ...
    def generate(self, batch: int) -> float: ...
    def value(self, batch: int) -> float: ...
    def train(self, rows: int) -> float: ...  # rows: decisions, chunk steps x envs
    def efficiency(self, stage: str, threads: int) -> float: ...
    def reset(self) -> float: ...


class GpuCosts(Costs, Protocol):
    """A cost model with GPU stages: a call's seconds at an SM share and the SMs it keeps busy (kind: sample, value
    or train; rows: its batch, or the update's decisions)."""

    def on_gpu(self, kind: str, rows: int, share: float) -> Any: ...  # ebrl.alloc.gpu_cost.GpuTime


def gpu_task(name: str, costs: Any, kind: str, rows: int, placement: Any, stage: str) -> Task:
    """A GPU call of `stage` at the SM share its lease holds (none: the whole GPU, time-shared with other such calls;
    its cost as at the whole GPU)."""
    lease = placement.pool.leases.get(stage) if placement.pool is not None else None
    share = lease.sm_share if lease is not None else None
    t = costs.on_gpu(kind, rows, share or 1.0)
    return Task(name, t.seconds, 1, (), gpu=True, sm=share, sm_busy=t.sm_busy)


# --- the simulators ----------------------------------------------------------------------------
@dataclass
class VirtualWorker:
    """One env: its observation (a placeholder of the spec's shapes), its action slot, its episode so far."""

    index: int
    spec: EnvSpec
    chunk_len: int
    obs: dict[str, np.ndarray] = field(default_factory=dict)
    actions: np.ndarray | None = None
    step: int = 0  # of its episode
    length: int = 0  # its episode's drawn length
    cpus: tuple[int, ...] = ()

    def bind(self, cpus: Sequence[int]) -> None:
        self.cpus = tuple(cpus)

    def renice(self, nice: int) -> None:
        pass


class VirtualPool:
    """`SimWorkerPool`'s face to the Scheduler, the envs' chunks modelled (`VirtualDispatcher` runs them)."""

    def __init__(self, world: World, costs: Costs, spec: EnvSpec, num_envs: int, chunk_len: int, seed: int,
                 sim_cores: Sequence[int], sim_nice: int) -> None:
        self.world, self.costs, self.spec, self.chunk_len = world, costs, spec, chunk_len
        self.rng = np.random.default_rng(seed)
        self.sim_nice = sim_nice
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in spec.obs.items()}
        self.workers = [VirtualWorker(i, spec, chunk_len, obs=zeros, cpus=tuple(sim_cores),
                                      actions=np.zeros((chunk_len, spec.action_dim), np.float32))
                        for i in range(num_envs)]
        for w in self.workers:
            w.length = costs.episode_length(w.index, self.rng)
        self.failures: list = []
        self.tasks = None
        self.chunk_timeout_s = None

    def reset(self, envs: Sequence[int], seeds: Sequence[int] | None = None) -> None:
        """The envs reset (GRPO's segments), all at once, each in its process as the real pool sends them; the
        supervisor waits for the last."""
        left = [len(envs)]

        def one_done() -> None:
            left[0] -= 1

        self.world.start(*(Task(f"simulate/reset{i}", self.costs.reset(), 1, self.workers[i].cpus, self.sim_nice,
                                done=one_done) for i in envs))
        for i in envs:
            self.workers[i].step = 0
            self.workers[i].length = self.costs.episode_length(i, self.rng)
        while left[0]:
            if not self.world.step():
                raise RuntimeError("virtual time: a reset cannot finish")

    def chunk(self, env: int, cores: tuple[int, ...], done: Callable[[ChunkReport], None]) -> Task:
        """Env `env`'s next chunk as a task; `done` gets its report."""
        w = self.workers[env]
        n = min(self.chunk_len, w.length - w.step)
        costs = self.costs.sim_steps(env, n, self.rng)
        work = float(costs.sum()) + (self.costs.reset() if w.step + n >= w.length else 0.0)  # (the auto-reset)
        started = self.world.now

        def finished() -> None:
            end = self.world.now
            w.step += n
            ended = w.step >= w.length
            truncated = ended and w.length >= self.spec.max_episode_steps
            episode = None
            if ended:
                episode = {"return": 0.0, "length": float(w.length), "success": float(not truncated)}
                w.step, w.length = 0, self.costs.episode_length(env, self.rng)
            report = ChunkReport(
                executed=n, rewards=np.zeros(n, np.float32), successes=np.zeros(n, bool),
                step_times=costs * ((end - started) / max(costs.sum(), 1e-12)), terminated=ended and not truncated,
                truncated=truncated, episode=episode, final_obs=dict(w.obs) if truncated else None,
                started=started, ended=end, cpus=cores)
            done(report)

        return Task(f"simulate/env{env}", work, 1, cores, self.sim_nice, done=finished)


class VirtualDispatcher:
    """`Dispatcher` in virtual time: ready envs run their chunks at once (no core rebinding: on every simulation
    core, as the OS would place them) or as the real `CorePool` hands out cores."""

    def __init__(self, world: World, pool: VirtualPool, cores: CorePool | None) -> None:
        self.world, self.pool, self.cores, self.events = world, pool, cores, world.events
        self.running: dict[int, Task] = {}
        self.alive = True

    def ready(self, envs: Sequence[int]) -> None:
        if self.cores is None:
            self.world.start(*(self._chunk(env, self.pool.workers[env].cpus) for env in envs))
            return
        for env in envs:
            self.cores.push(env, envs[0])
        self._dispatch()

    def _dispatch(self) -> None:
        started = [self._chunk(env, (core,)) for env, core in self.cores.dispatch()]
        moved = self.cores.promote()
        for env, core in moved:  # (running: its task moves to the new core)
            self.running[env].cores = (core,)
        if started:
            self.world.start(*started)
        elif moved:
            self.world.cpu.allot()

    def _chunk(self, env: int, cores: tuple[int, ...]) -> Task:
        task = self.pool.chunk(env, cores, lambda report, env=env: self._ended(env, report))
        self.running[env] = task
        return task

    def _ended(self, env: int, report: ChunkReport) -> None:
        del self.running[env]
        if self.cores is not None:
            self.cores.release(env)
            if report.executed:
                self.cores.observe(env, float(report.step_times.mean()))
        self.events.put(ChunkEnded(env, report))
        if self.cores is not None:
            self._dispatch()

    def resize(self, cores: Sequence[int], spare: Sequence[int] = ()) -> None:
        if self.cores is not None:
            self.cores.resize(cores, spare)
            self._dispatch()

    def swap_trainer(self, trainer: Any) -> None:
        pass

    def stop(self) -> None:
        self.alive = False


# --- the policy's stages -----------------------------------------------------------------------
class ModelPolicy:
    """What the Scheduler asks of a policy besides its forward passes: tokens and the chunk's shape."""

    def __init__(self, spec: EnvSpec, execute: int, chunk_len: int) -> None:
        self.env_spec, self.execute, self.chunk_len = spec, execute, chunk_len

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((len(texts), 1), np.int64), np.ones((len(texts), 1), bool)


def _rows(obs: dict[str, torch.Tensor]) -> int:
    return len(next(iter(obs.values())))


class ModelGeneration:
    """Generation's batches as CPU work on the placement's generation cores and threads (the supervisor's, nice 0);
    the weights' version is the trainer's count of published updates."""

    def __init__(self, world: World, costs: Costs, policy: ModelPolicy, trainer: "ModelTrainer",
                 placement: Any) -> None:
        self.world, self.costs, self.policy, self.trainer, self.placement = world, costs, policy, trainer, placement
        self.pid = 0
        self.version = 0

    def _run(self, kind: str, n: int) -> None:
        if self.placement.device.type == "cuda":
            self.world.run(gpu_task(f"generate/{kind}", self.costs, kind, n, self.placement, "generate"))
            return
        threads = self.placement.threads("generate")
        work = self.costs.generate(n) if kind == "sample" else self.costs.value(n)
        self.world.run(Task(f"generate/{kind}", work, threads, tuple(self.placement.cpus("generate")),
                            efficiency=self.costs.efficiency("generate", threads)))

    def sample(self, obs: dict[str, torch.Tensor]) -> Sampled:
        n = _rows(obs)
        self.version = self.trainer.published
        self._run("sample", n)
        p = self.policy
        return Sampled(torch.zeros(n, p.chunk_len, p.env_spec.action_dim), {}, torch.zeros(n, p.chunk_len),
                       torch.zeros(n), self.version)

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        n = _rows(obs)
        self._run("value", n)
        return torch.zeros(n)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class LentThreads:
    """`TrainerThreads` of a modelled trainer process: the placement lends it every core while the rollout idles
    (`Placement.lend_to_trainer`), and a running update moves onto them at once."""

    def __init__(self, trainer: "ModelTrainer", lent: int | None) -> None:
        self.trainer, self.lent = trainer, lent
        self.count = trainer.own_threads

    def set(self, n: int) -> None:
        self.count = n
        if self.trainer.running is not None:
            self.trainer._place(self.trainer.running)
            self.trainer.world.cpu.allot()


class VirtualPlacement:
    """Mixed into the run's `Placement` class: its decisions as they are, no process moved (`pin`), no MPS daemon
    started (the pool records the SM shares, which the modelled GPU calls read)."""

    def pin(self, pid: int, cpus: Sequence[int]) -> None:
        pass

    def partition(self) -> str:
        return "none"


class ModelTrainer(Trainer):
    """An update as CPU work: `local` in the supervisor (the rollout waits: colocated), else a process of its own
    whose `Trained` arrives when its task ends; lent every core while the rollout idles, as the placement decides."""

    def __init__(self, world: World, costs: Costs, placement: Any) -> None:
        super().__init__()
        self.world, self.costs, self.placement = world, costs, placement
        self.local = placement.local
        self.weights = None
        self.published = 0
        self.queued: list[Task] = []  # updates sent while one runs: a trainer process takes them in turn
        self.running: Task | None = None
        self.shared_threads = None if self.local else LentThreads(self, placement.idle_trainer_threads())

    @property
    def own_threads(self) -> int:
        """A local trainer trains with the supervisor's threads, a process with its own (Placement.threads)."""
        return self.placement.threads("generate" if self.local else "train")

    @property
    def threads(self) -> int:  # type: ignore[override]
        return self.own_threads

    @property
    def pid(self) -> int:
        return 0

    def train(self, iteration: int, batch: Any, decoupled: bool, is_clip: float, gather: bool = False,
              critic_only: bool = False) -> None:
        rows = int(batch.reward.numel())  # decisions (chunk steps x envs): an update computes masked ones too

        def trained() -> None:
            self.published += 1
            self.world.events.put(TrainerSaid(Trained(iteration, {}, self.published, task.started, self.world.now,
                                                      self.world.now)))
            if gather:
                self.world.events.put(TrainerSaid(State({}, {}, iteration)))
            self.running = None
            if self.queued:
                self._start(self.queued.pop(0))

        if self.placement.device.type == "cuda":
            task = gpu_task("train", self.costs, "train", rows, self.placement, "train")
            task.done = trained
        else:
            task = Task("train", self.costs.train(rows), 1, (), done=trained)
        if self.local:
            self._place(task)
            self.world.run(task)
        elif self.running is None:
            self._start(task)
        else:
            self.queued.append(task)

    def _place(self, task: Task) -> None:
        """The threads and cores of the moment (a new plan may have moved them since the update was sent; the
        placement may have lent it every core); a GPU call keeps its share."""
        if task.gpu:
            return
        lent = self.shared_threads is not None and self.shared_threads.count != self.own_threads
        task.threads = self.shared_threads.count if lent else self.own_threads
        task.cores = tuple(self.placement.cores if lent else self.placement.cpus("train"))
        task.efficiency = self.costs.efficiency("train", task.threads)

    def _start(self, task: Task) -> None:
        self._place(task)
        self.running = task
        self.world.start(task)

    def request_state(self) -> None:
        self.world.events.put(TrainerSaid(State({}, {})))
