"""The one runtime of the five schedules (docs/internals/design.md, "The schedules" and "The loop").

`scheduler=colocated | disaggregated | hybrid | async | ebrl` are settings of this one driver, read into a
`Schedule`:

- `overlap`: the trainer trains on iteration i-1 while rollout i collects (the rollout runs at most `max_ahead`
  iterations ahead of the finished updates). Weights come back with a version and are swapped at a chunk boundary;
  every chunk records its version; at training time chunks older than `max_staleness` versions (by default
  max_ahead: none) are masked out and counted, and the loss is decoupled PPO (GRPO's ratio alike). Without it, a
  rollout waits for the previous update (synchronous).
- `groups`: the envs split into groups; a group whose chunk ended queues for generation, which serves every queued
  group in one batch while the others simulate. One group = lockstep.
- `core_rebinding`: the dispatcher owns the simulation cores; an env runs its chunk only while it holds one (every
  thread of its process pinned to it), handed out by `core_order`. Off: every ready env is submitted at once and the
  OS places them.
- `trainer`: `local` trains in the supervisor on the policy generation samples with, on every core (colocated);
  `process` in a process of its own. Generation is `local` (the supervisor) or `process` likewise
  (`scheduler.generation`).
- `sim_nice`: the simulators' nice value; generation and training (nice 0) take a shared core first.
- `work_conserving` (the placement's): the simulators also run on the cores a plan gave generation and training,
  whenever those leave them idle; while the rollout has nothing to run, a trainer process trains on every core.
- `train_share`: the share of the cores given to the trainer alone (disaggregated; on GPUs the second GPU); null:
  it shares every core. The placement (ebrl/runtime/placement.py) turns it into core sets.

colocated is `overlap` off, one group, no core rebinding and a local trainer: every env runs its chunk, generation
waits for the last one, and after the rollout the update runs in the supervisor. algo=grpo runs under every
schedule: a segment is one episode per env from its group's seeded reset.

Inside a chunk every env steps on its own (its chunk runs in its process without a barrier); the observations,
rewards and dones cross through each env's shared-memory slot.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ebrl.envs.worker import ChunkReport, SimWorkerPool
from ebrl.policies.base import Policy
from ebrl.rl.grpo import group_seeds
from ebrl.rl.rollout import ChunkStep, RolloutStats, batch_obs, batch_shapes
from ebrl.runtime.dispatcher import Broke, ChunkEnded, CorePool, Dispatcher, Event, TrainerSaid
from ebrl.runtime.generation import make_generation
from ebrl.runtime.loop import Group, RolloutLoop, Rules, Serving, Shipment
from ebrl.runtime.messages import State, Trained
from ebrl.runtime.placement import Placement
from ebrl.runtime.trainer import make_trainer_stage
from ebrl.shape import RolloutShape
from ebrl.telemetry.trace import Trace


@dataclass(frozen=True)
class Schedule:
    """The switches of one mode (read from `scheduler.*`)."""

    overlap: bool
    groups: int
    core_rebinding: bool
    core_order: str  # which ready env a freed core goes to (dispatcher.CorePool)
    max_ahead: int
    max_staleness: int
    queue_size: int | None  # groups that may wait for generation at once; null: all
    train_share: float | None  # share of the cores for the trainer alone; null: it shares every core
    decoupled: bool  # with overlap: decoupled PPO (clip around the proximal policy, weight to the behaviour one)
    is_clip: float  # truncation of the behaviour importance weight (decoupled PPO)
    train_threads: int | None
    sim_nice: int
    trainer: str  # local | process

    @classmethod
    def from_config(cls, scheduler: dict[str, Any]) -> "Schedule":
        return cls(**{name: scheduler[name] for name in cls.__dataclass_fields__})

    @property
    def ahead(self) -> int:
        """How many iterations the rollout may run ahead of the last finished update: `max_ahead` with overlap
        (1: rollout i collects while iteration i-1 trains), none without."""
        return self.max_ahead if self.overlap else 0


class Observations:
    """Policy batches of the envs' observations, each with its env's instruction tokens (tokenized once); `shared`:
    in shared memory, for generation's own process to read without a copy."""

    def __init__(self, policy: Policy, pool: SimWorkerPool, shared: bool = False) -> None:
        self.pool, self.shared = pool, shared
        tokens, mask = policy.tokenize([w.spec.instruction for w in pool.workers])
        self.tokens, self.mask = torch.from_numpy(tokens), torch.from_numpy(mask)

    def of(self, envs: Sequence[int]) -> dict[str, torch.Tensor]:
        """The envs' current observations (one copy out of shared memory)."""
        envs = list(envs)
        return self.batch([self.pool.workers[i].obs for i in envs], envs)

    def batch(self, per_env: list[dict[str, np.ndarray]], envs: list[int]) -> dict[str, torch.Tensor]:
        return batch_obs(per_env, self.tokens, self.mask, envs, self.shared)


class Ledger:
    """Iterations on their way: shipped to the trainer (with the rollout's stats and the shipping's figures), then
    trained (results the caller has not taken), then returned."""

    def __init__(self) -> None:
        self.shipped: dict[int, tuple[RolloutStats, dict[str, float]]] = {}
        self.results: dict[int, tuple[RolloutStats, dict[str, float]]] = {}
        self.returned = 0  # iterations handed to the caller

    def ship(self, shipment: Shipment) -> None:
        self.shipped[shipment.iteration] = (
            shipment.stats,
            {"sched/dropped_chunks": float(shipment.dropped), "sched/staleness_mean": shipment.staleness},
        )

    def trained(self, iteration: int, metrics: dict[str, float]) -> None:
        stats, shipped = self.shipped.pop(iteration)
        self.results[iteration] = (stats, {**metrics, **shipped})


def _rows(sizes: list[int]) -> list[slice]:
    """Consecutive row ranges of these sizes in a batch."""
    ends = np.cumsum([0, *sizes])
    return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]


def _rows_of(obs: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in obs.items()}


def real_stages(
    conf: dict[str, Any],
    pool: SimWorkerPool,
    policy: Policy,
    placement: Placement,
    cores: CorePool | None,
    resume: str | None,
    init: str | None,
    seed: int,
) -> tuple[Any, Any, Dispatcher]:
    """The trainer, generation and the dispatcher thread of a run: processes, threads and the simulators' pipes."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    trainer = make_trainer_stage(conf, pool.spec, policy, placement, lambda m: events.put(TrainerSaid(m)), resume, init)
    try:
        generation = make_generation(conf, pool.spec, policy, placement, trainer.weights, seed + 2)
    except BaseException:
        trainer.close()
        raise
    return trainer, generation, Dispatcher(pool, cores, events, trainer.process)


class Scheduler:
    """The driver of every schedule: it takes the dispatcher's events, feeds them to the loop (`RolloutLoop`), and
    carries out the loop's answers: values and samples through generation, actions into the shared slots, envs to the
    dispatcher, shipments to the trainer. See the module docstring."""

    def __init__(
        self,
        pool: SimWorkerPool,
        policy: Policy,
        conf: dict[str, Any],
        placement: Placement,
        base_version: int = 0,
        resume: str | None = None,
        seed: int = 0,
        critic_warmup: int = 0,
        init: str | None = None,
        stages: Callable[..., tuple[Any, Any, Any]] = real_stages,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """critic_warmup: the run's first updates that train the value head alone (a run from `init`); init: the
        checkpoint file the policy's first weights came from (a trainer process reads them from it too). `stages`
        builds the trainer, generation and dispatcher (`real_stages`' arguments), `clock` stamps the trace: a run's
        are real; the at-scale benchmark's (ebrl/forecast/virtual.py) are modelled, in virtual time."""
        self.pool, self.policy, self.placement, self.seed = pool, policy, placement, seed
        self.critic_warmup = critic_warmup
        self.schedule = s = Schedule.from_config(conf["scheduler"])
        episodic = conf["algo"]["name"] == "grpo"  # one whole episode per env from its group's seeded reset
        shape = RolloutShape.of(conf, placement.ranks.world, pool.spec.max_episode_steps, policy.execute)
        self.loop = RolloutLoop(
            shape.envs,
            s.groups,
            Rules(
                shape.chunks,
                int(conf["iterations"]) - base_version,
                s.ahead,
                s.max_staleness,
                s.queue_size,
                base_version,
                episodic,
                shape.group_size,
            ),
            shared_obs=s.trainer == "process",
        )
        self.observations = Observations(policy, pool, shared=placement.generation == "process")
        self.trace = Trace(clock)
        self.ledger = Ledger()
        self.last_shapes: dict[str, tuple[int, ...]] = {}  # of the last batch sent to training
        # rank 0's trainer sends its state after each update a checkpoint is due at (FSDP: every rank's trainer
        # gathers it then, together), so a checkpoint holds exactly the weights of its iteration
        self.checkpoint_every = int(conf["checkpoint_every"])
        cores = (
            CorePool(placement.cpus("simulate"), order=s.core_order, spare=placement.spare())
            if s.core_rebinding
            else None
        )
        self.trainer, self.generation, self.dispatcher = stages(
            conf, pool, policy, placement, cores, resume, init, seed
        )

    # --- the caller's view ----------------------------------------------------------------------
    @property
    def base_version(self) -> int:
        return self.loop.rules.base_version

    def next_iteration(self) -> tuple[RolloutStats, dict[str, float]]:
        """Drive the loop until the next iteration's update finished; its rollout stats and metrics."""
        want = self.ledger.returned
        while want not in self.ledger.results:
            self._step()
        self.ledger.returned += 1
        return self.ledger.results.pop(want)

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
        self.trainer.request_state()
        while self.trainer.state is None:
            try:
                self._handle(self.dispatcher.events.get(timeout=1.0))
            except queue.Empty:
                if not self.dispatcher.alive and self.trainer.process is not None:
                    # it stopped on an error (the run is stopping): read the trainer here
                    self._trainer_message(self.trainer.process.receive())
        state, self.trainer.state = self.trainer.state, None
        return state

    def unreturned(self) -> list[tuple[RolloutStats, dict[str, float]]]:
        """The results of updates the trainer finished that `next_iteration` has not handed out yet, in order; handed
        out now (a run stopping counts them)."""
        results = self.ledger.results
        out = [results.pop(k) for k in sorted(results)]
        self.ledger.returned += len(out)
        return out

    def simulate_on(self, cpus: Sequence[int], spare: Sequence[int] = (), slots: int | None = None) -> None:
        """Simulate on these cores, borrowing `spare` ones, from now on (the placement's new plan): the core pool's
        cores, `slots` envs at once on each (None: as before), or, without core rebinding, every simulator's
        affinity."""
        self.dispatcher.resize(list(cpus), list(spare), slots)
        if self.dispatcher.cores is None:
            for worker in self.pool.workers:
                worker.bind([*cpus, *spare])

    def regroup(self, groups: int) -> None:
        """Serve generation in `groups` groups (batches of num_envs / groups envs, an allocator's new plan) from the
        next segment boundary that every group can reach (RolloutLoop.regroup); no more groups than the envs split
        into (GRPO: whole groups of algo.group_size)."""
        self.loop.regroup(min(groups, self.loop.units))

    def wait_trainer_switch(self, timeout: float = 600.0) -> None:
        """Block until a started successor trainer has taken over (tests; a run's end)."""
        if self.trainer.successor_ready(timeout):
            self._hand_over()

    def close(self) -> None:
        self.dispatcher.stop()
        self.generation.close()
        self.trainer.close()

    # --- the loop ------------------------------------------------------------------------------
    def _step(self) -> None:
        """Hand training over to a successor that is ready, serve the queued groups (if any) and ship what they
        completed, then handle what the dispatcher reported meanwhile (waiting for at least one event when there was
        nothing to serve)."""
        if self.trainer.successor_ready():
            self._hand_over()
        serving = self.loop.serve()
        if serving is not None:
            for shipment in self._serve(serving):
                self._ship(shipment)
        events = self.dispatcher.events
        self.placement.lend_to_trainer(self.trainer, self.loop.idle)  # (before blocking: the rollout may be idle now)
        self._handle(events.get() if not self.loop.queue else events.get_nowait() if not events.empty() else None)
        while not events.empty():
            self._handle(events.get_nowait())
        self.placement.lend_to_trainer(self.trainer, self.loop.idle)

    def _handle(self, event: Event | None) -> None:
        if isinstance(event, ChunkEnded):
            self._chunk_reported(event.env, event.report)
        elif isinstance(event, TrainerSaid):
            self._trainer_message(event.message)
        elif isinstance(event, Broke):  # the dispatcher or the trainer failed
            raise event.error

    def _chunk_reported(self, env: int, report: ChunkReport) -> None:
        if report.failed is None:
            self.trace.add(
                f"simulate/env{env}",
                "chunk",
                report.started,
                report.ended,
                steps=report.executed,
                step_s=float(report.step_times.sum()),
                cpus=list(report.cpus),
                version=int(self.loop.group_of[env].pending.version[0]),
            )
        self.loop.reported(env, report)

    def _serve(self, serving: Serving) -> list[Shipment]:
        """Serve these groups in one generation batch: finish their chunk steps (cutoff and bootstrap values), swap
        in newer weights at this chunk boundary, and sample the next chunks; an episodic (GRPO) segment needs no
        bootstrap value, and its envs first reset from their group's seed. Returns the iterations that shipped."""
        shipped: list[Shipment | None] = []
        episodic = self.loop.rules.episodic
        if episodic:  # whole episodes: nothing to bootstrap
            shipped += [self.loop.finish_segment(g, torch.zeros(len(g.envs))) for g in serving.ending]
            self._reset(serving.beginning)
        t0 = self.trace.clock()
        with torch.no_grad():  # (not inference mode: a trainer in this process trains on what this samples)
            cut = serving.cut
            if cut:  # values of the obs episodes were cut off on, by the weights that acted
                finals = self.observations.batch(
                    [o for g in cut for o in g.cut_obs], [g.envs[j] for g in cut for j in g.steps[-1].cut]
                )
                values = self.generation.value(finals)
                for g, rows in zip(cut, _rows([len(g.cut_obs) for g in cut])):
                    g.set_cutoff_values(values[rows], _rows_of(finals, rows))
            held = [] if episodic else serving.held
            if held:  # a segment's bootstrap value, by the weights that acted, without sampling
                obs = self.observations.of([i for g in held for i in g.envs])
                values = self.generation.value(obs)
                for g, rows in zip(held, _rows([len(g.envs) for g in held])):
                    shipped.append(self.loop.finish_segment(g, values[rows], _rows_of(obs, rows)))
            starting = serving.starting
            if starting:
                shipped += self._sample(starting, [] if episodic else serving.ending)
            self.loop.served(serving)
        self.trace.add(
            "generate",
            "sample",
            t0,
            self.trace.clock(),
            groups=[g.index for g in serving.groups],
            version=self.generation.version,
            pid=self.generation.pid,
        )
        return [s for s in shipped if s is not None]

    def _sample(self, starting: list[Group], ending: list[Group]) -> list[Shipment | None]:
        """Sample the starting groups' next chunks in one batch (newer weights first: a chunk boundary) and hand their
        envs to the dispatcher; a group whose segment ends here takes its bootstrap value from this sample."""
        shipped = []
        obs = self.observations.of([i for g in starting for i in g.envs])
        out = self.generation.sample(obs)
        executed = out.chunk[:, : self.policy.execute].float()  # (the rest of each chunk is never run)
        version = self.base_version + out.version
        for g, rows in zip(starting, _rows([len(g.envs) for g in starting])):
            if g in ending:  # its segment's bootstrap value: from this sample's prefix
                shipped.append(self.loop.finish_segment(g, out.value[rows], _rows_of(obs, rows)))
            run = self.loop.started(
                g,
                ChunkStep(
                    obs=_rows_of(obs, rows),
                    chunk=out.chunk[rows],
                    extras=_rows_of(out.extras, rows),
                    log_prob=out.log_prob[rows],
                    value=out.value[rows],
                    version=torch.full((len(g.envs),), version, dtype=torch.long),
                ),
            )
            for i, actions in zip(g.envs, executed[rows].numpy()):
                self.pool.workers[i].actions[: len(actions)] = actions
            self.dispatcher.ready(run)
        return shipped

    def _reset(self, groups: list[Group]) -> None:
        """Start each env of these groups' episode from its GRPO group's seed for the segment it begins (the run's
        iteration), all envs at once; a simulator replaced in the reset counts as a failure of its group's segment."""
        envs = [i for g in groups for i in g.envs]
        if not envs:
            return
        seeds = {}
        for g in groups:
            of_segment = group_seeds(
                self.seed, self.base_version + g.segment, len(self.pool.workers), self.loop.rules.unit
            )
            seeds.update({i: of_segment[i] for i in g.envs})
        t0 = self.trace.clock()
        before = len(self.pool.failures)
        self.pool.reset(envs, [seeds[i] for i in envs])
        t1 = self.trace.clock()
        for _, env, _ in self.pool.failures[before:]:
            self.loop.group_of[env].stats.failures += 1
        for i in envs:
            self.trace.add(f"simulate/env{i}", "reset", t0, t1)

    def _ship(self, shipment: Shipment) -> None:
        """Send one iteration to the trainer (a checkpoint due after it: with its state to come back)."""
        self.ledger.ship(shipment)
        self.last_shapes = batch_shapes(shipment.batch)
        k = self.base_version + shipment.iteration + 1  # the run's count after this update
        gather = k % self.checkpoint_every == 0 or k == self.base_version + self.loop.rules.iterations
        s = self.schedule
        # (the trainer has finished the updates before this one: it starts from the weights of version k - 1)
        self.trainer.train(
            shipment.iteration,
            shipment.batch,
            decoupled=s.overlap and s.decoupled,
            is_clip=s.is_clip,
            gather=gather,
            critic_only=k <= self.critic_warmup,
            version=k - 1,
        )

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
        self.trace.add("train", "publish", message.published, message.end, iteration=iteration, version=message.version)
        metrics = {**message.metrics, "sched/weights_version": float(self.base_version + message.version)}
        cores = self.dispatcher.cores
        if cores is not None and cores.spare:  # what the simulators borrowed so far (work-conserving)
            metrics.update({"sched/lent_chunks": float(cores.lent), "sched/promoted_envs": float(cores.promoted)})
        self.ledger.trained(iteration, metrics)
        self.loop.trained()
