"""The rollout's bookkeeping as a state machine: no threads, no processes, no policy (docs/internals/design.md, "The
loop").

Every schedule runs this one loop; its switches make the schedule. The envs are split into groups. A group
collects one segment at a time: an iteration's `chunks` chunk steps per env, or, `episodic` (GRPO), one whole
episode per env from a seeded reset, at most `chunks` chunk steps long. Each chunk step ends when every env of the
group reported its chunk, and the group then queues for generation. `Runtime` (ebrl/runtime/runtime.py) feeds the
events in and carries out what comes back:

- `reported(env, report)`: an env's chunk ended; once its whole group reported, the chunk step is recorded and the
  group queues (or waits for room, `queue_size`).
- `serve()` -> a `Serving`: the queued groups, served in one generation batch, and for each whether it starts its
  next chunk, waits for an update (it would be more than `ahead` iterations beyond the updates done, or past the
  run's iterations), or parks at a regroup's segment boundary. The driver values the observations episodes were cut
  off on, samples the starting groups' chunks (`started`, which says which envs run: an episodic env whose episode
  ended sits the rest of its segment out) and the bootstrap values of segments that ended (`finish_segment`), then
  hands the serving back (`served`).
- `finish_segment(group, last_value)` -> a `Shipment` once every group has collected that iteration: the batch for
  the trainer, with the chunk steps beyond `max_staleness` masked out.
- `trained()`: an update finished; the groups that waited for it queue.
- `regroup(groups)`: split the envs anew at the next segment boundary every group can reach.

`colocated` is this loop with one group, `ahead` 0 and a trainer in the supervisor: every env runs its chunk, the
group's chunk step ends when the last one reported (the barrier), and after the last one the update runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ebrl.envs.worker import ChunkReport
from ebrl.rl.rollout import (
    ChunkStep,
    RolloutBatch,
    RolloutStats,
    concat_envs,
    drop_stale,
    pad_steps,
    stack_group_obs,
    stack_steps,
)

Next = Literal["start", "wait", "park"]


@dataclass(frozen=True)
class Rules:
    """The loop's switches: `chunks` chunk steps per segment (episodic: at most); `iterations` this run makes;
    `ahead` iterations the rollout may run beyond the finished updates (0: synchronous); chunk steps more than
    `max_staleness` versions old are masked out; `queue_size` groups may queue for generation at once (None: all);
    `base_version` updates were made before this run (a resumed run), which the chunks' versions count; `episodic`:
    a segment is one episode per env from a seeded reset (GRPO); groups are split in whole `unit`s of envs (GRPO's
    groups of algo.group_size envs that share a start)."""

    chunks: int
    iterations: int
    ahead: int
    max_staleness: int
    queue_size: int | None = None
    base_version: int = 0
    episodic: bool = False
    unit: int = 1


@dataclass
class Group:
    """One group of envs and the segment (one iteration's chunk steps) it is collecting."""

    index: int
    envs: list[int]
    segment: int = 0  # the iteration this group's chunk steps belong to
    steps: list[ChunkStep] = field(default_factory=list)  # recorded chunk steps of the segment
    pending: ChunkStep | None = None  # the chunk step in flight
    reports: dict[int, ChunkReport] = field(default_factory=dict)  # env -> its report, while the others run
    stats: RolloutStats = field(default_factory=RolloutStats)
    cut_obs: list[dict[str, np.ndarray]] = field(default_factory=list)  # final obs of the last step's `cut` rows,
    # valued at the group's next serving
    ended: np.ndarray | None = None  # episodic: whose episode of this segment ended (rows in `envs` order)

    def __post_init__(self) -> None:
        self.ended = np.zeros(len(self.envs), bool)

    def set_cutoff_values(self, values: torch.Tensor, obs: dict[str, torch.Tensor] | None = None) -> None:
        """The values of `cut_obs` (as the policy batch `obs`, kept for a trainer that values them itself): the last
        chunk step's cutoff values."""
        step = self.steps[-1]
        step.cutoff_value[step.cut] = values
        step.cutoff_obs = obs
        self.cut_obs = []


@dataclass
class Serving:
    """The groups served in one generation batch and what each does next."""

    groups: list[Group]
    next: dict[int, Next]  # group index -> what it does after this serving
    ending: list[Group]  # groups whose segment ends with this serving (its last chunk step is recorded)

    @property
    def cut(self) -> list[Group]:
        """Groups with cut-off episodes to value (a group held back and queued again has none left)."""
        return [g for g in self.groups if g.cut_obs]

    @property
    def starting(self) -> list[Group]:
        """Groups that sample their next chunk now (a group whose segment ended gets its bootstrap value from that
        sample: the prefix runs once, with the newest weights)."""
        return [g for g in self.groups if self.next[g.index] == "start"]

    @property
    def held(self) -> list[Group]:
        """Groups whose segment ended and that do not go on now: their bootstrap value comes without a sample."""
        return [g for g in self.ending if self.next[g.index] != "start"]

    @property
    def beginning(self) -> list[Group]:
        """Starting groups whose next chunk is the first of a segment (episodic: their envs reset first)."""
        return [g for g in self.starting if g in self.ending or not g.steps]


@dataclass
class Shipment:
    """One iteration, collected by every group: what the trainer trains on."""

    iteration: int  # this run's count
    batch: RolloutBatch
    stats: RolloutStats
    dropped: int  # chunk steps masked out as stale
    staleness: float  # their mean staleness, in versions


class RolloutLoop:
    """See the module docstring and `Rules`."""

    def __init__(self, num_envs: int, groups: int, rules: Rules, shared_obs: bool = False) -> None:
        """shared_obs: an iteration's observations are put in shared memory (a trainer process reads them)."""
        if num_envs % rules.unit:
            raise ValueError(f"{num_envs} envs do not split into units of {rules.unit}")
        self.num_envs, self.rules, self.shared_obs = num_envs, rules, shared_obs
        self.groups: list[Group] = []
        self.group_of: dict[int, Group] = {}
        self._split(groups, segment=0)
        self.queue: deque[Group] = deque(self.groups)  # every group starts ready: its first obs is in shared memory
        self.overflow: deque[Group] = deque()  # ready, held back: the queue was full
        self.waiting: list[Group] = []  # ready, held back: too far ahead of training
        self.regroup_at: tuple[int, int] | None = None  # (groups, segment) of a requested regroup
        self.parked: list[Group] = []  # groups at that segment, waiting for the others
        # iteration -> group -> its part: the batch without obs, its stats, its chunk steps' obs
        self.segments: dict[int, dict[int, tuple[RolloutBatch, RolloutStats, list]]] = {}
        self.trained_count = 0  # updates finished in this run

    @property
    def idle(self) -> bool:
        """No env has a chunk to run or to be sampled: every group waits for an update (or the run's rollout is
        done), a group parked at a regroup's boundary waiting with them."""
        return bool(self.waiting) and len(self.waiting) + len(self.parked) == len(self.groups)

    @property
    def units(self) -> int:
        """How many groups the envs can be split into at most."""
        return self.num_envs // self.rules.unit

    # --- events ----------------------------------------------------------------------------------
    def reported(self, env: int, report: ChunkReport) -> Group | None:
        """Env `env`'s chunk ended; when it was its group's last, the group's chunk step is recorded, the group
        queues, and it is returned."""
        group = self.group_of[env]
        group.reports[env] = report
        if len(group.reports) < len(group.envs):
            return None
        reports = [group.reports[i] for i in group.envs]
        group.reports = {}
        step, group.pending = group.pending, None
        step.record(reports, group.stats, group.steps)
        group.steps.append(step)
        if self.rules.episodic:  # (an episode cut off by its step limit ends its env's segment: nothing to value)
            group.ended |= step.done.numpy()
        else:
            group.cut_obs = [reports[j].final_obs for j in step.cut]
        self._enqueue(group)
        return group

    def serve(self) -> Serving | None:
        """The queued groups, to serve in one generation batch (None: none queued); their room in the queue goes to
        the groups that found it full."""
        if not self.queue:
            return None
        groups = list(self.queue)
        self.queue.clear()
        self._refill()
        ending = [g for g in groups if self._segment_ends(g)]
        return Serving(groups, {g.index: self._next(g, g in ending) for g in groups}, ending)

    def started(self, group: Group, step: ChunkStep) -> list[int]:
        """The group's next chunk was sampled; returns the envs that run it. An episodic env whose episode ended
        runs nothing more in its segment: it reports an empty chunk at once."""
        group.pending = step
        for env in (e for e, ended in zip(group.envs, group.ended) if ended):
            group.reports[env] = ChunkReport.nothing()
        return [e for e, ended in zip(group.envs, group.ended) if not ended]

    def finish_segment(
        self, group: Group, last_value: torch.Tensor, last_obs: dict[str, torch.Tensor] | None = None
    ) -> Shipment | None:
        """The group collected its segment (`last_value`: the bootstrap value of its envs' current obs, the policy
        batch `last_obs`; episodic: zeros and None, whole episodes need none); once every group did, that iteration
        ships."""
        done = self.segments.setdefault(group.segment, {})
        done[group.index] = (
            stack_steps(group.steps, last_value, last_obs, with_obs=False),
            group.stats,
            [step.obs for step in group.steps],
        )
        group.steps, group.stats = [], RolloutStats()
        group.ended = np.zeros(len(group.envs), bool)
        group.segment += 1
        if len(done) < len(self.groups):
            return None
        iteration = group.segment - 1
        parts = [done[g.index] for g in self.groups]
        del self.segments[iteration]
        longest = max(b.reward.shape[0] for b, _, _ in parts)  # episodic groups may have ended after fewer chunk steps
        batch = concat_envs([pad_steps(b, longest) for b, _, _ in parts])
        batch.obs = stack_group_obs([obs for _, _, obs in parts], longest, self.shared_obs)  # (one copy)
        dropped, staleness = drop_stale(batch, self.rules.base_version + iteration, self.rules.max_staleness)
        return Shipment(iteration, batch, RolloutStats.merged([s for _, s, _ in parts]), dropped, staleness)

    def served(self, serving: Serving) -> None:
        """After the serving: the groups that do not start wait for an update or park at the regroup's boundary."""
        for g in serving.groups:
            if serving.next[g.index] == "park":
                self._park(g)
            elif serving.next[g.index] == "wait":
                self.waiting.append(g)

    def trained(self) -> None:
        """An update finished: the groups held back for it may go on."""
        self.trained_count += 1
        held, self.waiting = self.waiting, []
        for g in held:
            self._enqueue(g)

    def regroup(self, groups: int) -> None:
        """Serve generation in `groups` groups from the next segment boundary that every group can reach: each group
        stops at the end of the segment the furthest group is in until all are there, then the envs are split anew.
        A one-off barrier, paid once per change."""
        if not 1 <= groups <= self.units:
            unit = f" (groups of whole units of {self.rules.unit} envs)" if self.rules.unit > 1 else ""
            raise ValueError(f"{groups} groups of {self.num_envs} envs{unit}: between 1 and {self.units}")
        if groups == len(self.groups) and self.regroup_at is None:
            return
        # a group mid-segment (chunk steps collected or in flight) first finishes it
        target = max(g.segment + (1 if g.steps or g.pending is not None else 0) for g in self.groups)
        self.regroup_at = (groups, target)

    # --- rules -----------------------------------------------------------------------------------
    def _segment_ends(self, group: Group) -> bool:
        """The group's last recorded chunk step ends its segment: `chunks` of them, or (episodic) every env's
        episode ended."""
        if not group.steps:
            return False
        if self.rules.episodic and bool(group.ended.all()):
            return True
        if len(group.steps) < self.rules.chunks:
            return False
        if self.rules.episodic:
            raise RuntimeError(
                f"{int((~group.ended).sum())} of {len(group.envs)} episodes of group {group.index} did "
                f"not end within {self.rules.chunks} chunks (env.max_episode_steps is the limit)"
            )
        return True

    def _next(self, group: Group, ending: bool) -> Next:
        """What a served group does next; `ending`: its segment ends in this serving."""
        segment = group.segment + ending
        if self.regroup_at is not None and (ending or not group.steps) and segment >= self.regroup_at[1]:
            return "park"
        may = segment - self.trained_count <= self.rules.ahead and segment < self.rules.iterations
        return "start" if may else "wait"

    def _room(self) -> int:
        return self.rules.queue_size or len(self.groups)

    def _enqueue(self, group: Group) -> None:
        if len(self.queue) < self._room():
            self.queue.append(group)
        else:
            self.overflow.append(group)

    def _refill(self) -> None:
        """Groups that found the queue full queue now, first come first, as far as it has room."""
        while self.overflow and len(self.queue) < self._room():
            self.queue.append(self.overflow.popleft())

    def _park(self, group: Group) -> None:
        """Hold a group at the regroup's segment boundary; once every group is held, split anew and queue the new
        groups (their envs' observations are in shared memory)."""
        self.parked.append(group)
        if len(self.parked) == len(self.groups):
            groups, segment = self.regroup_at
            self.regroup_at, self.parked = None, []
            self._split(groups, segment)
            self.queue.extend(self.groups)

    def _split(self, groups: int, segment: int) -> None:
        """The envs in `groups` consecutive groups of whole units, all about to start `segment`."""
        unit = self.rules.unit
        self.groups = [
            Group(g, [int(u) * unit + j for u in units for j in range(unit)], segment=segment)
            for g, units in enumerate(np.array_split(np.arange(self.units), groups))
        ]
        self.group_of = {i: g for g in self.groups for i in g.envs}
