"""What runs after each iteration of `Experiment.train`, one small object per concern, called in order on the
iteration's `Finished` record (docs/internals/design.md, "A run"):

1. `Replan`: the allocator reads the iteration's measurements, and the placement applies a new plan before the next
   iteration;
2. `RankMetrics`: with several ranks, the run's figures from every rank's (gathered to rank 0, combined);
3. `Experiment._record`: the run's env steps counted, the metrics logged;
4. `Measure`: the summary's totals over the iterations after warm-up (the stages' figures over the steady ones);
5. `Progress`: the progress bar;
6. `NanGuard`: updates with NaN/inf gradients in a row; too many stop the run;
7. `Checkpoints`: a checkpoint when one is due and the updates are finite.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ebrl.alloc.allocator import Measured
from ebrl.node import Ranks
from ebrl.runtime.distributed import combine, gather_metrics
from ebrl.runtime.errors import RunStopped
from ebrl.telemetry.metrics import wilson_interval
from ebrl.telemetry.report import ProgressBar, console


@dataclass
class Finished:
    """One finished iteration: `metrics` are this rank's figures, `run` the run's (every rank's combined, once
    `RankMetrics` ran; this rank's with one rank)."""

    number: int  # the run's iteration count after it
    started: float  # perf_counter() at its start
    metrics: dict[str, Any]
    run: dict[str, Any] = field(default_factory=dict)
    measured: Measured | None = None  # this rank's figures per stage, as the allocator reads them


Hook = Callable[[Finished], None]


class Replan:
    """The allocator observes each iteration; the placement applies a new plan before the next one runs."""

    def __init__(self, placement: Any) -> None:
        self.placement = placement

    def __call__(self, it: Finished) -> None:
        decision, alloc_metrics = self.placement.observe(it.measured)  # each rank plans its own node's share
        it.metrics.update(alloc_metrics)
        if decision is not None:
            it.metrics["alloc/decision"] = decision
            console.print(decision, soft_wrap=True)


class RankMetrics:
    """The run's figures: with several ranks, every rank's gathered and combined, and the run's rate taken over
    the time between two gathers (a rank that waited there for the others may find its next update already done
    and measure an iteration of almost no time)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.last_gather: float | None = None

    def __call__(self, it: Finished) -> None:
        if not self.ranks.distributed:
            it.run = it.metrics
            return
        it.run = combine(gather_metrics(it.metrics, self.ranks))
        now = time.perf_counter()
        span, self.last_gather = now - (self.last_gather or it.started), now
        it.run["time/iteration_s"] = span
        it.run["perf/env_steps_per_s"] = it.run["perf/iteration_env_steps"] / span


class Measure:
    """The summary's totals: env steps, wall time and CPU busy over the iterations after the first (it warms up:
    process start, caches); each stage's busy share, CPU share and rate over the steady ones (`steady`); the success
    of the last iteration that finished episodes."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.steps, self.wall = 0, 0.0
        self.stage_steps, self.stage_wall = 0, 0.0  # the steady iterations', which the stages' figures cover
        self.sim_cpu = 0.0  # the simulators' CPU seconds (user + system), resets and their plumbing included
        self.busy: list[float] = []
        self.stage_busy: dict[str, list[float]] = {}
        self.per_stage: list[Measured] = []  # this rank's
        self.success_rate, self.mean_return = float("nan"), float("nan")
        self.outcomes: list[tuple[int, int]] = []  # (successes, episodes) of each iteration that finished any

    def steady(self, number: int) -> bool:
        """Whether iteration `number` counts for the stages' figures: not the first (it warms up), nor, of three or
        more, the last, which simulates nothing where the schedule runs a rollout ahead (its rollout ran in the one
        before, and no next one starts), so its env steps would be charged to the simulation of the others."""
        if self.iterations <= 2:
            return number > 1 or self.iterations == 1
        return 1 < number < self.iterations

    def __call__(self, it: Finished) -> None:
        m = it.run
        if it.number > 1 or self.iterations == 1:
            self.steps += int(m["perf/iteration_env_steps"])
            self.wall += m["time/iteration_s"]
            self.busy.append(m["perf/cpu_busy"])
        if self.steady(it.number):
            self.stage_steps += int(m["perf/iteration_env_steps"])
            self.stage_wall += m["time/iteration_s"]
            self.sim_cpu += m.get("perf/sim_cpu_s", 0.0)
            if it.measured is not None:
                self.per_stage.append(it.measured)
            for key, value in m.items():
                if key.startswith(("perf/busy_", "perf/cpu_share_")):
                    self.stage_busy.setdefault(key[5:], []).append(value)
        if "env/success_rate" in m:
            self.success_rate, self.mean_return = m["env/success_rate"], m["env/return"]
            self.outcomes.append((round(m["env/successes"]), round(m["env/episodes"])))

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall if self.wall else 0.0

    @property
    def sim_cpu_ms_per_step(self) -> float:
        """What simulation cost the run per env step, in CPU ms (nan where the simulators share the supervisor's
        process: env.serial)."""
        return 1e3 * self.sim_cpu / self.stage_steps if self.stage_steps and self.sim_cpu else float("nan")

    @property
    def cpu_busy(self) -> float:
        return float(np.mean(self.busy)) if self.busy else float("nan")

    def success_at_ends(self, most: int = 3) -> tuple[Success | None, Success | None]:
        """The success rate over the episodes of the first and of the last `most` iterations that finished any
        (fewer where the run has fewer than twice as many: the two never share an iteration)."""
        if not self.outcomes:
            return None, None
        k = max(1, min(most, len(self.outcomes) // 2))
        return Success.of(self.outcomes[:k]), Success.of(self.outcomes[-k:])

    def stage_means(self) -> dict[str, float]:
        return {key: float(np.mean(values)) for key, values in self.stage_busy.items()}

    def measured(self) -> Measured:
        """The stages' figures over the steady iterations, at their rate."""
        return Measured.mean(self.per_stage, self.stage_steps / self.stage_wall if self.stage_wall else 0.0)


@dataclass(frozen=True)
class Success:
    """A success rate over the episodes of some iterations, with its 95% Wilson interval."""

    rate: float
    low: float
    high: float
    episodes: int
    iterations: int

    @classmethod
    def of(cls, outcomes: list[tuple[int, int]]) -> "Success":
        wins, n = sum(s for s, _ in outcomes), sum(e for _, e in outcomes)
        return cls(wins / n, *wilson_interval(wins, n), episodes=n, iterations=len(outcomes))


class Progress:
    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar

    def __call__(self, it: Finished) -> None:
        self.bar.update(it.run)


class NanGuard:
    """Updates with NaN/inf gradients (their steps were skipped): while they go on no checkpoint is written
    (`streak`), and after `limit` in a row the run stops."""

    def __init__(self, limit: int, last_checkpoint: Path, lr: float) -> None:
        self.limit, self.last_checkpoint, self.lr = limit, last_checkpoint, lr
        self.streak = 0

    def __call__(self, it: Finished) -> None:
        self.streak = self.streak + 1 if it.run.get("train/nonfinite_steps", 0) > 0 else 0
        if self.streak >= self.limit:
            first = it.number - self.limit + 1
            kept = (
                "checkpoints/last.pt is from before them"
                if self.last_checkpoint.exists()
                else "no checkpoint was written before them"
            )
            raise RunStopped(
                f"{self.limit} updates in a row had NaN/inf gradients (iterations {first}-{it.number}, "
                f"algo.max_nonfinite_updates={self.limit}; their steps were skipped); {kept}; try a "
                f"lower algo.lr than {self.lr:g}"
            )


class Checkpoints:
    """checkpoints/last.pt every `every` iterations and after the last, unless the updates are not finite; rank 0
    writes it (`save`). The other ranks' trainers send no state (ebrl/runtime/trainer.py, `checkpoint_state`)."""

    def __init__(self, every: int, iterations: int, guard: NanGuard, leader: bool, save: Callable[[], Any]) -> None:
        self.every, self.iterations, self.guard, self.leader, self.save = every, iterations, guard, leader, save

    def __call__(self, it: Finished) -> None:
        due = it.number % self.every == 0 or it.number == self.iterations
        if due and not self.guard.streak and self.leader:  # the replicas hold the same weights: rank 0 writes them
            self.save()
