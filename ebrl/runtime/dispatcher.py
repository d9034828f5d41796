"""Step-level orchestration (docs/internals/design.md, "The loop"): the thread that runs the simulators' chunks, and the
pool of simulation cores it hands out.

Inside a chunk every env steps on its own, in its own process, without a barrier; a chunk that ends frees its core
at once, even while the main thread generates. With core rebinding (`CorePool`) an env runs its chunk only while it
holds a simulation core, every thread of its process pinned to it.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing
import multiprocessing.connection
import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Sequence

from ebrl.config import CORE_ORDERS
from ebrl.envs.worker import ChunkReport, SimWorkerPool
from ebrl.runtime.messages import State, Trained


class ReadyQueue:
    """The envs with a chunk to run, by priority: a heap per group (`by_group`; else one for all) of (-estimate,
    arrival, env), where an entry whose env left or was queued anew is skipped when it comes up; and per group its
    envs ready or running (`left`), kept as they come and go."""

    def __init__(self, by_group: bool) -> None:
        self.by_group = by_group
        self.entries: dict[int, tuple] = {}  # the ready envs, in arrival order -> their live entry
        self.heaps: dict[Any, list[tuple]] = {}
        self.arrivals = 0
        self.left: Counter = Counter()
        self.counted: dict[int, Any] = {}  # env -> the group it counts for in `left`

    def push(self, env: int, group: Any, estimate: float) -> None:
        self.counted[env] = group
        self.left[group] += 1
        self.arrivals += 1
        self.queue(env, group, estimate, self.arrivals)

    def queue(self, env: int, group: Any, estimate: float, arrival: int) -> None:
        entry = (-estimate, arrival, env)
        self.entries[env] = entry
        heapq.heappush(self.heaps.setdefault(group if self.by_group else None, []), entry)

    def top(self, key: Any) -> tuple | None:
        """The live entry of the highest priority under `key` (a group, or None for all), None when there is none."""
        heap = self.heaps[key]
        while heap and self.entries.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop(self) -> tuple[int, Any]:
        """The env to run next (see `CorePool`) and its heap's key."""
        rank = (lambda k: (self.left[k], self.top(k)[:2])) if self.by_group else None
        key = min((k for k in self.heaps if self.top(k) is not None), key=rank)
        _, _, env = heapq.heappop(self.heaps[key])
        del self.entries[env]
        return env, key

    def ran(self, env: int) -> None:
        """Env `env`'s chunk ended: it no longer counts for its group."""
        self.left[self.counted.pop(env)] -= 1


class CorePool:
    """The simulation cores: an env runs only while it holds one. A freed core goes to the ready env with the longest
    estimated step time (EMA of its measured steps; never-measured envs first); with `order="readiness"` to a ready
    env of the group closest to its chunk boundary (fewest of its envs still to run: ready or running), the longest
    estimate first within it.

    `spare`: the cores the plan gave the policy's stages, lent to the simulators (work-conserving placement: a share
    is a priority, not a fence). An env gets one only when every simulation core is taken; there it runs niced, so
    generation and training still get the core first; and when a simulation core frees with no env ready, the env
    longest on a spare core moves onto it (`promote`), so that no env straggles on a core the policy is using.

    `slots`: the envs a core (simulation or spare) runs at once, 1 on a quiet machine. Where other processes hold
    cores, a simulator niced below them gets a tenth of a core it shares with one, and only many simulators at once
    win their share back (the kernel weighs every runnable thread by its nice): `Placement.sim_slots`."""

    def __init__(
        self,
        cores: Sequence[int],
        alpha: float = 0.3,
        order: str = "longest",
        spare: Sequence[int] = (),
        slots: int = 1,
    ) -> None:
        if not cores:
            raise ValueError("a core pool needs at least one core")
        if order not in CORE_ORDERS:
            raise ValueError(f"order={order!r}: one of {', '.join(CORE_ORDERS)}")
        self.cores: list[int] = list(cores)
        self.own = set(self.cores)
        self.spare: list[int] = [c for c in spare if c not in self.own]
        self.slots = slots
        self.free: list[int] = self._places()  # simulation cores first (`_take`)
        self.core_of: dict[int, int] = {}  # env -> the core it holds
        self.queue = ReadyQueue(by_group=order == "readiness")  # the envs with a chunk to run
        self.group_of: dict[int, Any] = {}  # env -> its group (as `push` said)
        self.ema: dict[int, float] = {}
        self.alpha, self.order = alpha, order
        self.decisions: deque[tuple[int, int, float, float]] = deque(maxlen=100_000)  # env, core, its est., max rival
        self.lent = 0  # chunks started on a spare core
        self.promoted = 0  # envs moved from a spare core onto a simulation core

    def estimate(self, env: int) -> float:
        return self.ema.get(env, math.inf)

    def observe(self, env: int, step_s: float) -> None:
        old = self.ema.get(env)
        self.ema[env] = step_s if old is None else (1 - self.alpha) * old + self.alpha * step_s
        if env in self.queue.entries:  # (its place in the queue moves with its estimate)
            self.queue.queue(env, self.group_of[env], self.ema[env], self.queue.entries[env][1])

    @property
    def ready(self) -> dict[int, tuple]:
        """The envs with a chunk to run, in arrival order."""
        return self.queue.entries

    def push(self, env: int, group: Any = None) -> None:
        """Env `env` has a chunk to run; `group`: the envs whose chunk step it completes with (by readiness, the
        group with the fewest of them left goes first)."""
        self.group_of[env] = group
        self.queue.push(env, group, self.estimate(env))

    def _places(self) -> list[int]:
        """Every place an env may run: each simulation core, then each spare one, `slots` times."""
        return [core for _ in range(self.slots) for core in [*self.cores, *self.spare]]

    def release(self, env: int) -> int:
        core = self.core_of.pop(env)
        self.queue.ran(env)
        # (a core taken away by `resize`, or a place beyond its slots now, is not handed on)
        places = self.slots if core in self.own or core in self.spare else 0
        if self.free.count(core) + list(self.core_of.values()).count(core) < places:
            self.free.append(core)
        return core

    def resize(self, cores: Sequence[int], spare: Sequence[int] = (), slots: int | None = None) -> None:
        """Simulate on these cores (and borrow `spare`) from now on, `slots` envs at once on each (None: as before);
        an env holding a core that was taken away finishes its chunk there."""
        if not cores:
            raise ValueError("a core pool needs at least one core")
        held = Counter(self.core_of.values())
        self.cores = list(cores)
        self.own = set(self.cores)
        self.spare = [c for c in spare if c not in self.own]
        self.slots = self.slots if slots is None else slots
        self.free = []
        for core in self._places():
            if held[core]:
                held[core] -= 1
            else:
                self.free.append(core)

    def dispatch(self) -> list[tuple[int, int]]:
        """Hand free cores to ready envs (see the class docstring; ties: first come), simulation cores first."""
        out = []
        while self.free and self.ready:
            # by readiness the group with the fewest envs still to run (ready or running: one that moves from ready
            # to a core still counts) goes first; then the longest estimate, then the first to come
            env, key = self.queue.pop()
            # the estimates it was chosen over: of every ready env, or by readiness of those of its group
            rival = self.queue.top(key)
            core = self._take()
            self.lent += core not in self.own
            self.core_of[env] = core
            self.decisions.append((env, core, self.estimate(env), -rival[0] if rival else -math.inf))
            out.append((env, core))
        return out

    def promote(self) -> list[tuple[int, int]]:
        """With no env ready: move envs running on a spare core onto free simulation cores, the longest estimate
        first; (env, its new core) for each."""
        out = []
        while not self.ready and (own := [c for c in self.free if c in self.own]):
            lent = [e for e, c in self.core_of.items() if c not in self.own]
            if not lent:
                break
            env = max(lent, key=self.estimate)
            self.free.remove(own[0])
            self.free.append(self.core_of[env])
            self.core_of[env] = own[0]
            self.promoted += 1
            out.append((env, own[0]))
        return out

    def _take(self) -> int:
        """A free core, a simulation core when one is free."""
        core = next((c for c in self.free if c in self.own), self.free[0])
        self.free.remove(core)
        return core


@dataclass(frozen=True)
class ChunkEnded:
    """The dispatcher's report: env `env`'s chunk ended (or failed: `report.failed`)."""

    env: int
    report: ChunkReport


@dataclass(frozen=True)
class TrainerSaid:
    """A trainer's message, as the dispatcher read it from the trainer process (or a local trainer posted it)."""

    message: Trained | State


@dataclass(frozen=True)
class Broke:
    """The dispatcher, or the trainer, failed; the main thread raises `error`."""

    error: BaseException


Event = ChunkEnded | TrainerSaid | Broke


class Dispatcher:
    """The thread that runs chunks: it waits on every simulator pipe and the trainer process's, so a finished
    chunk frees its core and the next ready env starts at once, even while the main thread generates.

    The main thread hands it envs whose actions are written (`ready`) and reads what happened from `events`:
    `ChunkEnded`, `TrainerSaid` or `Broke`. `waitables` are the trainer's pipes (none for a trainer in this process).
    """

    def __init__(
        self, pool: SimWorkerPool, cores: CorePool | None, events: queue.SimpleQueue[Event], trainer: Any = None
    ) -> None:
        self.pool, self.cores, self.events, self.trainer = pool, cores, events, trainer
        self._lock = threading.Lock()
        self._ready: list[int] = []  # without a core pool: envs to submit at once
        self._running: dict[Any, int] = {}  # worker connection -> env
        self._wake_recv, self._wake_send = multiprocessing.Pipe(duplex=False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ebrl-dispatcher", daemon=True)
        self._thread.start()

    def ready(self, envs: Sequence[int]) -> None:
        """These envs' actions are in their slots (one group's, which completes its chunk step with them): run their
        chunks as cores allow."""
        with self._lock:
            for env in envs:
                if self.cores is None:
                    self._ready.append(env)
                else:
                    self.cores.push(env, envs[0])
        self._wake()

    def resize(self, cores: Sequence[int], spare: Sequence[int] = (), slots: int | None = None) -> None:
        """Hand chunks out on these sim cores (lending `spare` ones), `slots` envs at once on each, from now on (with
        a core pool; without one, nothing to do here)."""
        if self.cores is not None:
            with self._lock:
                self.cores.resize(cores, spare, slots)
            self._wake()

    def swap_trainer(self, trainer: Any) -> None:
        """Wait on this trainer process's pipes from the next round on (a respawn's successor); messages of the one
        before are dropped from then on (it has answered everything it was sent)."""
        with self._lock:
            self.trainer = trainer
        self._wake()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake()
        except OSError:
            pass
        self._thread.join(10.0)

    def _wake(self) -> None:
        self._wake_send.send_bytes(b"!")

    def _start_ready(self) -> None:
        with self._lock:
            if self.cores is None:
                starting, self._ready, moving = [(env, None) for env in self._ready], [], []
            else:
                starting = self.cores.dispatch()
                moving = self.cores.promote()
        for env, core in moving:  # (running: its affinity moves it at once)
            self.pool.workers[env].bind([core])
        for env, core in starting:
            worker = self.pool.workers[env]
            if core is not None:
                worker.bind([core])
            worker.submit(worker.execute)
            self._running[worker.connection] = env

    def _until_overdue(self) -> float | None:
        """Seconds until a running chunk's progress is worth checking again (None: no timeout or none runs)."""
        limit = self.pool.chunk_timeout_s
        checks = [] if limit is None else [self.pool.workers[env].until_check(limit) for env in self._running.values()]
        return min((c for c in checks if c is not None), default=None)

    def _overdue(self) -> list[Any]:
        """Connections of chunks that made no progress within the pool's chunk timeout (`Progress`; their wait_chunk
        then finds them hung and replaces them)."""
        limit = self.pool.chunk_timeout_s
        if limit is None:
            return []
        return [conn for conn, env in self._running.items() if self.pool.workers[env].hung(limit) is not None]

    def _run(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    trainer = self.trainer
                results, died = trainer.waitables if trainer is not None else (None, None)
                self._start_ready()
                ready = multiprocessing.connection.wait(
                    [*self._running, *([results, died] if trainer is not None else []), self._wake_recv],
                    timeout=self._until_overdue(),
                )
                # a chunk without progress is taken as hung: wait_chunk replaces it and reports a failed chunk
                for conn in list(dict.fromkeys([*ready, *self._overdue()])):
                    if conn is self._wake_recv:
                        while conn.poll():
                            conn.recv_bytes()
                    elif trainer is not None and (conn is results or (conn is died and not results.poll())):
                        if trainer is self.trainer:  # (else it was replaced while we waited)
                            self.events.put(TrainerSaid(trainer.receive()))
                    elif conn in self._running:
                        self._chunk_ended(self._running.pop(conn))
        except Exception as e:  # noqa: BLE001  (the main thread raises it)
            if not self._stopping:
                self.events.put(Broke(e))

    def _chunk_ended(self, env: int) -> None:
        report = self.pool.wait_chunk(env)
        if self.cores is not None:
            with self._lock:
                self.cores.release(env)
                if report.executed:
                    self.cores.observe(env, float(report.step_times.mean()))
        self.events.put(ChunkEnded(env, report))
