"""The runtime in virtual time: the real `Scheduler`, `RolloutLoop` and `CorePool` driven by modelled stages, with no
process, thread or policy (docs/internals/at-scale.md; `python -m ebrl.bench.at_scale`).

`Scheduler` takes its trainer, generation and dispatcher from a factory and stamps its trace with a clock
(ebrl/runtime/schedule.py); here those are modelled and the clock is a `World`'s:

- `Cpu`: a node's cores as a fluid model. A task is CPU work (seconds of one thread), its threads, its nice and the
  cores it may run on. Threads are spread over their allowed cores, pinned ones first, each onto the allowed core with
  the least weight (as Linux's load balancing tends to); a core's time goes to its threads in proportion to their
  weight (the kernel's table: nice 0 = 1024, each step about 1.25x less), less the measured cost of sharing a core
  (switches, cold caches); one-thread tasks that may run on the same cores at the same nice get the mean of their
  shares (the OS migrates them), so they are kept as `Cohort`s: an event costs the same at 1,024 envs as at 8. A task
  of several threads moves at its slowest thread's pace times their number (OpenMP threads wait for each other at
  every barrier) times its parallel efficiency.
- `World`: the clock and the CPU, advanced from one task's completion to the next. What the supervisor does
  synchronously (generation in the supervisor, a local trainer's update, resets) runs the world until its task is
  done; what happens meanwhile (chunks ending) is queued, as the dispatcher thread would have queued it.
- `VirtualPool` / `VirtualDispatcher`: each env's chunk is a one-thread task of the env's drawn step costs; episodes
  end at their drawn length. With core rebinding the real `CorePool` hands out the cores.
- `Gpu`: a GPU as a fluid too. A call with an SM share (an MPS client's) runs at its own pace whatever else runs;
  calls without one (the whole GPU: colocated, or before a plan) split the GPU evenly in time. A call's length at
  its share comes from the cost model (ebrl/forecast/gpu_cost.py: a roofline per operation, with the host's time to
  issue each), and so does the share of the SMs its kernels keep busy.
- `ModelGeneration`, `ModelTrainer`: a batch's CPU work from the cost model, on the cores and threads the
  `Placement` gives the stage; on a GPU node a GPU call at the stage's SM share.

What is not modelled yet is listed in `NOT_MODELLED`; a figure from this module is a prediction, labelled simulated.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from ebrl.envs.base import EnvSpec
from ebrl.envs.worker import ChunkReport
from ebrl.policies.build import policy_dtype
from ebrl.rl.ppo import proximal_rows
from ebrl.runtime.dispatcher import ChunkEnded, CorePool, Event, TrainerSaid
from ebrl.runtime.messages import Sampled, State, Trained
from ebrl.runtime.trainer import Trainer, TrainerThreads

NOT_MODELLED = (
    "memory",
    "failures and timeouts",
    "the supervisor's own CPU per event (orchestration)",
    "the cores a GPU stage's host thread takes from the simulators",
    "weight publication's copies",
)

# CFS's weight per nice value, -20 to 19: 1024 at 0, about 1.25x less per step (Linux, kernel/sched/core.c,
# sched_prio_to_weight). Whole numbers: loads add up exactly, so equal loads tie as they do in the kernel's sums.
PRIO_TO_WEIGHT = (
    88761,
    71755,
    56483,
    46273,
    36291,
    29154,
    23254,
    18705,
    14949,
    11916,
    9548,
    7620,
    6100,
    4904,
    3906,
    3121,
    2501,
    1991,
    1586,
    1277,
    1024,
    820,
    655,
    526,
    423,
    335,
    272,
    215,
    172,
    137,
    110,
    87,
    70,
    56,
    45,
    36,
    29,
    23,
    18,
    15,
)
WEIGHTS = {nice: float(w) for nice, w in zip(range(-20, 20), PRIO_TO_WEIGHT)}


def weight(nice: int) -> float:
    """CFS's weight of a nice value (outside -20 to 19, the nearest, as the kernel clamps a renice)."""
    w = WEIGHTS.get(nice)
    return w if w is not None else WEIGHTS[min(max(int(nice), -20), 19)]


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
    seq: int = 0  # its start's order on its device
    cohort: "Cohort | None" = None  # while it runs in one (Cpu): its work is then `finish` less the cohort's progress
    finish: float = 0.0


def stage_of(task: Task) -> str:
    """The stage a task's time counts for: its name before "/"."""
    return task.name.split("/", 1)[0]


def cohort_key(task: Task) -> tuple | None:
    """The cohort a CPU task runs in (one thread free on several cores), or None: it runs on its own."""
    if task.threads == 1 and len(task.cores) > 1:
        return task.cores, task.nice, task.efficiency, stage_of(task)
    return None


class Cohort:
    """One-thread tasks of one stage free on the same cores at the same nice and efficiency (a rollout's envs on every
    simulation core): they move at one rate (`Cpu.allot`), so they are kept as one. Each member's end is a mark on the
    cohort's progress (seconds of work each member has done since the cohort formed); an event costs O(1) in their
    number instead of O(members)."""

    def __init__(self, key: tuple, seq: int) -> None:
        self.key, self.seq = key, seq
        self.cores, self.nice, self.efficiency, self.stage = key
        self.progress = 0.0
        self.rate = 0.0
        self.size = 0
        self.heap: list[tuple[float, int, Task]] = []  # (finish, seq, task); left ones are dropped when on top
        self.counts: list[tuple[int, int]] = []  # (core, threads) as last allotted

    def push(self, task: Task) -> None:
        task.finish = self.progress + task.work
        heapq.heappush(self.heap, (task.finish, task.seq, task))
        self.size += 1
        task.cohort = self

    def top(self) -> Task:
        """The member that ends first (the ones that left dropped on the way)."""
        while True:
            finish, seq, task = self.heap[0]
            if task.cohort is self and task.seq == seq and task.finish == finish:
                return task
            heapq.heappop(self.heap)

    def leave(self, task: Task) -> None:
        task.cohort = None
        task.work = task.finish - self.progress
        self.size -= 1


class Device:
    """Tasks on a part of the node, each moving at the rate `allot` gives it; `spent` per stage (the part of a
    task's name before "/")."""

    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}  # id -> task, in start order (a completion leaves in O(1))
        self.spent: dict[str, float] = {}
        self.model_s = 0.0  # this machine's seconds spent in the model itself (the driver's own cost, not the run's)

    def add(self, task: Task) -> None:
        self.tasks[id(task)] = task

    def remove(self, task: Task) -> None:
        del self.tasks[id(task)]

    def allot(self) -> None:
        raise NotImplementedError

    def advance(self, dt: float) -> None:
        raise NotImplementedError

    @staticmethod
    def ends(tasks: Iterable[Task]) -> Iterator[tuple[float, Task]]:
        """Seconds until each of these tasks completes at its rate (stopped ones left out), and the task."""
        for task in tasks:
            if task.rate > 0:
                yield max(task.work, 0.0) / task.rate, task

    def running(self) -> Iterator[tuple[float, Task]]:
        return self.ends(self.tasks.values())

    def next_done(self) -> tuple[float, Task] | None:
        """Seconds until the next task completes, and that task."""
        t0 = time.perf_counter()
        best = min(self.running(), key=lambda end: end[0], default=None)
        self.model_s += time.perf_counter() - t0
        return best


class Cpu(Device):
    """See the module docstring: the tasks on a node's cores and the rate each moves at. One-thread tasks free on
    several cores go into `Cohort`s (their rate is one), the rest are `singles`."""

    def __init__(self, cores: int, timeslice: float = 0.0) -> None:
        """timeslice: the CPU a thread loses to switches and cold caches while it shares its core with others, as a
        fraction of its work (measured: a lockstep rollout's CPU per env step over one env per core's, minus 1)."""
        super().__init__()
        self.cores, self.timeslice = cores, timeslice
        self.occupied = [False] * cores  # cores with a thread on them, as last allotted
        self.core_busy = [0.0] * cores  # seconds each core had a thread on it
        self.singles: dict[int, Task] = {}
        self.cohorts: dict[tuple, Cohort] = {}
        self.started = 0  # tasks added so far (their `seq`)

    def add(self, task: Task, seq: int | None = None) -> None:
        super().add(task)
        if seq is None:
            seq, self.started = self.started, self.started + 1
        task.seq = seq
        key = cohort_key(task)
        if key is not None:
            cohort = self.cohorts.get(key)
            if cohort is None:
                cohort = self.cohorts[key] = Cohort(key, seq)
            cohort.push(task)
        else:
            self.singles[id(task)] = task

    def remove(self, task: Task) -> None:
        super().remove(task)
        cohort = task.cohort
        if cohort is None:
            del self.singles[id(task)]
            return
        if cohort_key(task) != cohort.key:  # (its rate was its cohort's all along: moving it took World.change)
            raise RuntimeError(f"virtual time: {task.name} was moved while it ran; World.change moves a running task")
        cohort.leave(task)
        if not cohort.size:
            del self.cohorts[cohort.key]

    def rate(self, task: Task) -> float:
        """A running task's rate, as last allotted."""
        return task.cohort.rate if task.cohort is not None else task.rate

    def allot(self) -> None:
        """Each task's rate from where its threads go and how the cores' time divides: the units (single tasks, and
        cohorts at their first member's place) are placed pinned first, in start order."""
        t0 = time.perf_counter()
        load = [0.0] * self.cores
        threads_on = [0] * self.cores
        placed: list[tuple[Task, int]] = []
        heap: list[tuple[float, int]] = []  # (load, core) of the allowed cores of a run of tasks with the same ones
        heap_cores: tuple[int, ...] | None = None
        units: list[Any] = [*self.singles.values(), *self.cohorts.values()]
        for unit in sorted(units, key=lambda u: (len(u.cores), u.seq)):
            w = weight(unit.nice)
            if isinstance(unit, Cohort):
                unit.counts = fill(load, unit.cores, w, unit.size)
                for core, k in unit.counts:
                    load[core] += k * w
                    threads_on[core] += k
                heap_cores = None
                continue
            if unit.cores != heap_cores:  # (the least-loaded core, lowest index first, as min() over them would)
                heap_cores, heap = unit.cores, [(load[c], c) for c in unit.cores]
                heapq.heapify(heap)
            for _ in range(unit.threads):
                _, core = heapq.heappop(heap)
                load[core] += w
                heapq.heappush(heap, (load[core], core))
                placed.append((unit, core))
                threads_on[core] += 1
        self.occupied = [n > 0 for n in threads_on]

        def share(w: float, core: int) -> float:
            return w / load[core] / (1 + self.timeslice if threads_on[core] > 1 else 1)

        # one-thread tasks free to move between the same cores at the same nice even out over time (the OS migrates
        # them): every cohort of those cores and nice gets its members' mean share; the threads of one
        # multi-threaded task do not: each barrier waits for the one that shares its core
        alike: dict[tuple, list[float]] = {}
        for cohort in self.cohorts.values():
            w = weight(cohort.nice)
            total = alike.setdefault((cohort.cores, cohort.nice), [0.0, 0])
            total[0] += sum(k * share(w, core) for core, k in cohort.counts)
            total[1] += cohort.size
        for cohort in self.cohorts.values():
            shares, members = alike[(cohort.cores, cohort.nice)]
            cohort.rate = shares / members * cohort.efficiency
        slowest: dict[int, float] = {}
        for task, core in placed:
            slowest[id(task)] = min(slowest.get(id(task), math.inf), share(weight(task.nice), core))
        for task in self.singles.values():
            task.rate = task.threads * slowest[id(task)] * task.efficiency
        self.model_s += time.perf_counter() - t0

    def running(self) -> Iterator[tuple[float, Task]]:
        """The singles' ends, then each cohort's first."""
        yield from self.ends(self.singles.values())
        for cohort in self.cohorts.values():
            if cohort.rate > 0:
                task = cohort.top()
                yield max(task.finish - cohort.progress, 0.0) / cohort.rate, task

    def advance(self, dt: float) -> None:
        """Move every task on by `dt` seconds; the CPU each used counts for its stage, waiting threads of a
        multi-threaded task included (they spin)."""
        t0 = time.perf_counter()
        for task in self.singles.values():
            task.work -= task.rate * dt
            stage = stage_of(task)
            self.spent[stage] = self.spent.get(stage, 0.0) + dt * task.rate / task.efficiency
        for cohort in self.cohorts.values():
            cohort.progress += cohort.rate * dt
            self.spent[cohort.stage] = (
                self.spent.get(cohort.stage, 0.0) + dt * cohort.rate / cohort.efficiency * cohort.size
            )
        for core, on in enumerate(self.occupied):
            if on:
                self.core_busy[core] += dt
        self.model_s += time.perf_counter() - t0


def fill(load: list[float], cores: tuple[int, ...], w: float, n: int) -> list[tuple[int, int]]:
    """Threads per core when `n` threads of weight `w` go one by one onto the least-loaded of `cores` (lowest index
    first): all but about 2 per core straight to below the level water-filling would reach (each of those is
    among the first n picks), the rest one by one. O(cores log cores), whatever n."""
    counts, left = dict.fromkeys(cores, 0), n
    if n > 2 * len(cores):  # (fewer go one by one at once)
        loads = sorted(load[c] for c in cores)
        below = 0.0
        for i, low in enumerate(loads):  # the level: the lowest i + 1 cores filled to it hold all n threads' weight
            below += low
            level = (n * w + below) / (i + 1)
            if i + 1 == len(loads) or level <= loads[i + 1]:
                break
        counts = {c: max(0, math.ceil((level - load[c]) / w) - 2) for c in cores}  # (a pick's margin for rounding)
        left = n - sum(counts.values())
        if left < 0:  # (rounding: place them all one by one)
            counts, left = dict.fromkeys(cores, 0), n
    heap = [(load[c] + counts[c] * w, c) for c in cores]
    heapq.heapify(heap)
    for _ in range(left):
        at, core = heapq.heappop(heap)
        counts[core] += 1
        heapq.heappush(heap, (at + w, core))
    return [(c, k) for c, k in counts.items() if k]


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
            stage = stage_of(task)
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
            device.add(task)
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
        device.remove(task)
        device.allot()
        if task.done is not None:
            task.done()
        return True

    def change(self, task: Task, **placed: Any) -> None:
        """Move a running CPU task (its cores, threads, efficiency): out of the CPU's books, changed, back in at its
        place in the start order; the caller allots."""
        seq = task.seq
        self.cpu.remove(task)
        for name, value in placed.items():
            setattr(task, name, value)
        self.cpu.add(task, seq)

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
    # rows: decisions, chunk steps x envs; proximal: those the proximal pass values (ppo.proximal_rows)
    def train(self, rows: int, proximal: int = 0) -> float: ...
    def efficiency(self, stage: str, threads: int) -> float: ...
    def reset(self) -> float: ...


class GpuCosts(Costs, Protocol):
    """A cost model with GPU stages: a call's seconds at an SM share and the SMs it keeps busy (kind: sample, value
    or train; rows: its batch, or the update's decisions)."""

    def on_gpu(self, kind: str, rows: int, share: float, proximal: int = 0) -> Any: ...  # gpu_cost.GpuTime


def gpu_task(name: str, costs: Any, kind: str, rows: int, placement: Any, stage: str, **how: Any) -> Task:
    """A GPU call of `stage` at the SM share its lease holds (none: the whole GPU, time-shared with other such calls;
    its cost as at the whole GPU); `how`: more of the call's kind (an update's `proximal` rows)."""
    lease = placement.pool.leases.get(stage) if placement.pool is not None else None
    share = lease.sm_share if lease is not None else None
    t = costs.on_gpu(kind, rows, share or 1.0, **how)
    return Task(name, t.seconds, 1, (), gpu=True, sm=share, sm_busy=t.sm_busy)


# --- the simulators ----------------------------------------------------------------------------
@dataclass
class VirtualWorker:
    """One env: its observation (a placeholder of the spec's shapes), its action slot, its episode so far."""

    index: int
    spec: EnvSpec
    execute: int  # the actions of a chunk it executes (SimWorker's)
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

    def __init__(
        self,
        world: World,
        costs: Costs,
        spec: EnvSpec,
        num_envs: int,
        execute: int,
        seed: int,
        sim_cores: Sequence[int],
        sim_nice: int,
    ) -> None:
        self.world, self.costs, self.spec, self.execute = world, costs, spec, execute
        self.rng = np.random.default_rng(seed)
        self.sim_nice = sim_nice
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in spec.obs.items()}
        self.workers = [
            VirtualWorker(
                i,
                spec,
                execute,
                obs=zeros,
                cpus=tuple(sim_cores),
                actions=np.zeros((execute, spec.action_dim), np.float32),
            )
            for i in range(num_envs)
        ]
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

        self.world.start(
            *(
                Task(f"simulate/reset{i}", self.costs.reset(), 1, self.workers[i].cpus, self.sim_nice, done=one_done)
                for i in envs
            )
        )
        for i in envs:
            self.workers[i].step = 0
            self.workers[i].length = self.costs.episode_length(i, self.rng)
        while left[0]:
            if not self.world.step():
                raise RuntimeError("virtual time: a reset cannot finish")

    def chunk(self, env: int, cores: tuple[int, ...], done: Callable[[ChunkReport], None]) -> Task:
        """Env `env`'s next chunk as a task; `done` gets its report."""
        w = self.workers[env]
        n = min(self.execute, w.length - w.step)
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
                executed=n,
                rewards=np.zeros(n, np.float32),
                successes=np.zeros(n, bool),
                step_times=costs * ((end - started) / max(costs.sum(), 1e-12)),
                terminated=ended and not truncated,
                truncated=truncated,
                episode=episode,
                final_obs=dict(w.obs) if truncated else None,
                started=started,
                ended=end,
                cpus=cores,
            )
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
            self.world.change(self.running[env], cores=(core,))
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

    def resize(self, cores: Sequence[int], spare: Sequence[int] = (), slots: int | None = None) -> None:
        if self.cores is not None:
            self.cores.resize(cores, spare, slots)
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

    def __init__(
        self, world: World, costs: Costs, policy: ModelPolicy, trainer: "ModelTrainer", placement: Any
    ) -> None:
        self.world, self.costs, self.policy, self.trainer, self.placement = world, costs, policy, trainer, placement
        self.pid = 0
        self.version = 0

    def _run(self, kind: str, n: int) -> None:
        if self.placement.device.type == "cuda":
            self.world.run(gpu_task(f"generate/{kind}", self.costs, kind, n, self.placement, "generate"))
            return
        threads = self.placement.threads("generate")
        work = self.costs.generate(n) if kind == "sample" else self.costs.value(n)
        self.world.run(
            Task(
                f"generate/{kind}",
                work,
                threads,
                tuple(self.placement.cpus("generate")),
                efficiency=self.costs.efficiency("generate", threads),
            )
        )

    def sample(self, obs: dict[str, torch.Tensor]) -> Sampled:
        n = _rows(obs)
        self.version = self.trainer.published
        self._run("sample", n)
        p = self.policy
        return Sampled(
            torch.zeros(n, p.chunk_len, p.env_spec.action_dim),
            {},
            torch.zeros(n, p.chunk_len),
            torch.zeros(n),
            self.version,
        )

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        n = _rows(obs)
        self._run("value", n)
        return torch.zeros(n)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class LentThreads(TrainerThreads):
    """`TrainerThreads` of a modelled trainer process: the placement lends it every core while the rollout idles
    (`Placement.lend_to_trainer`), and a running update moves onto them at once (a real one at its next optimizer
    step), so it never runs more threads than cores."""

    def __init__(self, trainer: "ModelTrainer", lent: int | None) -> None:
        super().__init__(multiprocessing.get_context("spawn"), trainer.own_threads, lent)
        self.trainer = trainer

    def set(self, n: int) -> None:
        super().set(n)
        self.running.value = n
        running = self.trainer.running
        if running is not None and not running.gpu:
            self.trainer.world.change(running, **self.trainer._placed())
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
        # (a bfloat16 policy's update takes the proximal pass over every row of a batch its own weights sampled)
        self.low_precision = (
            policy_dtype(OmegaConf.to_container(placement.cfg.policy, resolve=True), placement.device.type)
            != torch.float32
        )

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

    def train(
        self,
        iteration: int,
        batch: Any,
        decoupled: bool,
        is_clip: float,
        gather: bool = False,
        critic_only: bool = False,
        version: int | None = None,
    ) -> None:
        rows = int(batch.reward.numel())  # decisions (chunk steps x envs): an update computes masked ones too
        proximal = int(
            proximal_rows(
                batch, decoupled, version, self.placement.cfg.algo.get("proximal", "stale"), self.low_precision
            ).sum()
        )

        def trained() -> None:
            self.published += 1
            self.world.events.put(
                TrainerSaid(Trained(iteration, {}, self.published, task.started, self.world.now, self.world.now))
            )
            if gather:
                self.world.events.put(TrainerSaid(State({}, {}, iteration)))
            self.running = None
            if self.queued:
                self._start(self.queued.pop(0))

        if self.placement.device.type == "cuda":
            task = gpu_task("train", self.costs, "train", rows, self.placement, "train", proximal=proximal)
            task.done = trained
        else:
            task = Task("train", self.costs.train(rows, proximal), 1, (), done=trained)
        if self.local:
            self._place(task)
            self.world.run(task)
        elif self.running is None:
            self._start(task)
        else:
            self.queued.append(task)

    def _placed(self) -> dict[str, Any]:
        """The threads, cores and efficiency of the moment (a new plan may have moved them since the update was
        sent; the placement may have lent it every core)."""
        lent = self.shared_threads is not None and self.shared_threads.count != self.own_threads
        threads = self.shared_threads.count if lent else self.own_threads
        return {
            "threads": threads,
            "cores": tuple(self.placement.cores if lent else self.placement.cpus("train")),
            "efficiency": self.costs.efficiency("train", threads),
        }

    def _place(self, task: Task) -> None:
        """An update about to start takes `_placed`'s threads and cores; a GPU call keeps its share."""
        if not task.gpu:
            for name, value in self._placed().items():
                setattr(task, name, value)

    def _start(self, task: Task) -> None:
        self._place(task)
        self.running = task
        self.world.start(task)

    def request_state(self) -> None:
        self.world.events.put(TrainerSaid(State({}, {})))
