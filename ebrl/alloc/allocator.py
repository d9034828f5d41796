"""The allocator of a pipelined run: which stage profile, which plan, what each iteration measured, when to re-plan.

The stages' amounts become leases here (`cpu_sets`): on CPU, simulate gets the first ceil(x_sim) cores, train the
last ones and generate those before train's (a fractional amount shares its core; the simulators run niced, so
the policy's stages get a shared core first). On a GPU node simulate gets cores, and generate and train SM shares
of the GPU and cores of their own for their CPU side. The run's placement (ebrl/runtime/placement.py) applies them.

A stage's measured rate is the env steps/s it would sustain alone on its amount. On CPU it comes from CPU time:
cost = CPU-seconds the stage's processes used per env step, rate = amount / cost (so a stage that waits, e.g.
for a full queue, is not read as slow). On a GPU node generate and train are GPU work: rate = env steps/s / the
stage's busy fraction of the wall time (from the trace), at its SM share (the whole GPU while calibrating).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf

from ebrl.alloc.planner import (
    CYCLE,
    GPU_STAGE_CORES,
    Decision,
    ElasticController,
    Plan,
    PlanError,
    StaticController,
    Totals,
    evaluate,
    groups_text,
)
from ebrl.alloc.profile import STAGES, ProfileError, StageProfile, linear_profile, profile_path
from ebrl.checks import rank_cores
from ebrl.config import ConfigError
from ebrl.shape import RolloutShape

REPO = Path(__file__).resolve().parents[2]
# the iteration whose costs calibrate a run without a profile: the first one pays for warm-up (process start,
# first-call allocations; docs/internals/schedules.md, "Measured choices")
CALIBRATE_AT = 2


def profile_key(cfg: Any) -> dict[str, Any]:
    """What a stage profile was measured for: policy and preset, env and task, hw and the cores it gave (hw=cpu
    is whatever machine runs it), env count."""
    return {
        "policy": cfg.policy.name,
        "preset": cfg.policy.get("preset", ""),
        "env": cfg.env.name,
        "task": run_tasks(cfg),
        "hw": cfg.hw.name,
        "cores": len(rank_cores(cfg)),
        "num_envs": int(cfg.env.num_envs),
    }


def run_tasks(cfg: Any) -> str:
    """What a run steps: env.task, or a multi-task run's tasks joined by "+" (its stages cost what that mix costs)."""
    if cfg.env.get("tasks") is None:
        return str(cfg.env.get("task", ""))
    from ebrl.envs.tasks import task_list

    return "+".join(task_list(OmegaConf.to_container(cfg.env, resolve=True)))


def profiles_root(cfg: Any) -> Path:
    root = Path(cfg.allocator.profiles_dir).expanduser()
    return root if root.is_absolute() else REPO / root


def find_profile(cfg: Any) -> tuple[StageProfile | None, str]:
    """The run's stage profile and a line saying where it came from; (None, why) when there is none."""
    key = profile_key(cfg)
    if cfg.allocator.profile:
        path = Path(cfg.allocator.profile).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"allocator.profile={cfg.allocator.profile}: no such file; give a stage profile "
                f"written by sweep.py, or null to look in {profiles_root(cfg)}"
            )
    else:
        path = profile_path(profiles_root(cfg), key)
        if not path.is_file():
            return None, (
                f"no stage profile at {path}: planning from the costs measured in iteration {CALIBRATE_AT} "
                "(python sweep.py -m measures one)"
            )
    try:
        profile = StageProfile.load(path)
    except ProfileError as e:
        raise ConfigError(str(e)) from None
    differ = profile.matches(key)
    if differ:
        have = ", ".join(f"{k}={profile.key.get(k)}" for k in differ)
        want = ", ".join(f"{k}={key[k]}" for k in differ)
        raise ConfigError(
            f"stage profile {path} was measured for {have}, and this run has {want}; run "
            "python sweep.py -m with this run's overrides, or set allocator.profile to a matching file"
        )
    return profile, f"stage profile: {path}"


def totals_of(cfg: Any, cores: int) -> Totals:
    if not cfg.hw.gpus:
        return Totals(cores=cores)
    # MPS takes whole percent (a run refuses green contexts, whose granule is 8 SMs on Hopper: config.py); a rank
    # with too few cores to keep one each for generate and train lets them share what simulate leaves
    stage_cores = GPU_STAGE_CORES if cores >= 2 + 2 * GPU_STAGE_CORES else 0
    return Totals(cores=cores, gpus=int(cfg.hw.gpus), sm_granule=0.01, gpu_stage_cores=stage_cores)


def cpu_sets(
    x: Mapping[str, float], cores: Sequence[int], gpu: bool = False, gpu_stage_cores: int = GPU_STAGE_CORES
) -> dict[str, list[int]]:
    """Core sets per stage from the amounts. Simulate: the first ceil(x_sim) cores. On CPU, train the last
    ceil(x_train) cores and generate the ceil(x_gen) before them: the two are on every env's critical path and
    must not queue behind each other on one core, while the simulators, niced, yield any core they share with
    them (docs/internals/schedules.md, "Measured choices"). On
    a GPU node generate and train run on the GPU and need cores for their CPU side: train gets the last
    gpu_stage_cores cores, generate the others simulate leaves, its own and the supervisor's (whose process
    generates, unless generation has one of its own); with too few left the two share them."""
    cores, ceil = list(cores), lambda a: min(len(cores), max(1, math.ceil(a - 1e-9)))
    n_sim = ceil(x["simulate"])
    if gpu:
        rest = cores[n_sim:] or cores[-1:]
        n_train = min(gpu_stage_cores, len(rest) - 1)  # generate keeps at least one
        if n_train < 1:
            return {"simulate": cores[:n_sim], "generate": rest, "train": rest}
        return {"simulate": cores[:n_sim], "generate": rest[:-n_train], "train": rest[-n_train:]}
    n_train, n_gen = ceil(x["train"]), ceil(x["generate"])
    end = len(cores) - n_train  # generate ends where train starts, or shares train's cores when none are left
    generate = cores[end - n_gen : end] if end >= n_gen else cores[len(cores) - n_gen :]
    return {"simulate": cores[:n_sim], "generate": generate, "train": cores[len(cores) - n_train :]}


def stage_rates(
    x: Mapping[str, float],
    steps_per_s: float,
    cpu_share: Mapping[str, float],
    busy: Mapping[str, float],
    cores: int,
    gpu: bool,
) -> dict[str, float]:
    """Each stage's measured rate at its amount x (see the module docstring). cpu_share: each stage's processes'
    CPU-seconds / (cores x wall); busy: the trace's busy fractions."""
    rates = {}
    for stage in STAGES:
        if gpu and stage != "simulate":
            fraction = busy.get(stage, 0.0)
            rates[stage] = steps_per_s / fraction if fraction > 0 else math.inf
            continue
        cost = cpu_share.get(stage, 0.0) * cores / steps_per_s if steps_per_s > 0 else 0.0
        rates[stage] = x[stage] / cost if cost > 0 else math.inf
    return rates


FOREIGN_CORES = 0.25  # other processes' load on the run's cores below this many cores is noise, not load


def held_cores(foreign: float) -> int:
    """The cores other processes hold, of their measured load (`foreign`, in cores): a thread team of ours leaves
    them these, since a thread that shares a core with another process holds up every barrier of the team
    (docs/internals/schedules.md, "Measured choices")."""
    return round(foreign) if foreign >= FOREIGN_CORES else 0


@dataclass(frozen=True)
class Measured:
    """What one iteration (or a run, `mean`) measured, per stage: env steps/s end to end, the CPU share of the
    stage's processes (CPU-seconds / (cores x wall)), and the share of the wall time the stage was busy (the trace's;
    simulate: per simulation core); `foreign`: the cores' busy time that none of the run's processes used, in cores
    (other load on a shared node)."""

    steps_per_s: float
    cpu_share: dict[str, float]
    busy: dict[str, float]
    foreign: float = 0.0

    @classmethod
    def mean(cls, parts: Sequence["Measured"], steps_per_s: float) -> "Measured":
        """The parts' shares averaged, at the run's rate."""

        def avg(get: Any) -> dict[str, float]:
            keys = {k for p in parts for k in get(p)}
            return {k: sum(get(p).get(k, 0.0) for p in parts) / len(parts) for k in keys} if parts else {}

        return cls(
            steps_per_s,
            avg(lambda p: p.cpu_share),
            avg(lambda p: p.busy),
            sum(p.foreign for p in parts) / len(parts) if parts else 0.0,
        )

    def rates(self, x: Mapping[str, float], cores: int, gpu: bool) -> dict[str, float]:
        return stage_rates(x, self.steps_per_s, self.cpu_share, self.busy, cores, gpu)


class Allocator:
    """Plans the stages' amounts of a pipelined run and re-plans them (allocator=elastic); see the module docstring.

    Without a stage profile the first iterations run with every stage on every core, and the costs measured in
    iteration CALIBRATE_AT give a linear profile. Pinned amounts (allocator.simulate/generate/train) are never moved.
    """

    def __init__(self, cfg: Any, cores: Sequence[int]) -> None:
        self.cfg, self.cores = cfg, list(cores)
        self.gpu = bool(cfg.hw.gpus)
        self.totals = totals_of(cfg, len(self.cores))
        self.shape = RolloutShape.of(cfg)  # (its envs and generation batch: num_envs / scheduler.groups)
        self.fixed = {s: float(cfg.allocator[s]) for s in STAGES if cfg.allocator[s] is not None}
        self.profile, self.source = (None, "every amount pinned") if len(self.fixed) == 3 else find_profile(cfg)
        self.controller: ElasticController | StaticController | None = None
        self.current: Plan | None = None
        self.decisions: list[Decision] = []
        self.observations = 0
        # of each GPU stage's time on the whole GPU, the share its kernels fill the SMs (the rest, the host issuing
        # them, does not stretch on a smaller share), and where that comes from: the calibration's profile sizes the
        # SM shares by it (`kernel_time`); none: every GPU stage's time stretches in proportion
        self.kernel: dict[str, float] = {}
        self.kernel_source = ""
        if len(self.fixed) == 3:
            self.current = Plan(
                x=dict(self.fixed),
                batch=self.shape.envs_per_group,
                groups=self.shape.envs // self.shape.envs_per_group,
                rates={s: math.nan for s in STAGES},
            )
        elif self.profile is not None:
            self._start(self.profile)

    def _start(self, profile: StageProfile) -> None:
        kind = ElasticController if self.cfg.allocator.name == "elastic" else StaticController
        a = self.cfg.allocator
        extra = (
            dict(window=a.window, min_gain=a.min_gain, cooldown=a.cooldown, ema=a.ema)
            if kind is ElasticController
            else {}
        )
        try:
            # a profile measured at several generation batches (a sweep over scheduler.groups) lets the plan pick
            # the batch too; otherwise it stays num_envs / scheduler.groups
            batches = None if len(profile.batches("generate")) > 1 else [self.shape.envs_per_group]
            self.controller = kind(profile, self.totals, self.shape.envs, batches=batches, fixed=self.fixed, **extra)
        except PlanError as e:
            raise ConfigError(str(e)) from None
        self.current = self.controller.current

    def size_by_kernels(self, kernel: Mapping[str, float], source: str) -> None:
        """Before calibration on a GPU node: of each GPU stage's time on the whole GPU, the share its kernels fill
        (`self.kernel`; a stage the host alone bounds keeps a sliver), and where that comes from."""
        self.kernel = {s: min(1.0, max(float(k), 1e-3)) for s, k in kernel.items()}
        self.kernel_source = source

    @property
    def leases(self) -> dict[str, list[int]] | None:
        """Core sets per stage of the current plan; None while calibrating (every stage on every core)."""
        if self.current is None:
            return None
        return cpu_sets(self.current.x, self.cores, self.gpu, self.totals.gpu_stage_cores)

    def observe(self, m: Measured) -> tuple[str | None, dict[str, float]]:
        """Read one iteration's measurements; returns a line to print when the plan changed, and `alloc/` metrics."""
        self.observations += 1
        line = None
        if self.current is None:  # calibrating: every stage ran on every core, and on a GPU node on the whole GPU
            resource = {s: "cores" if s == "simulate" or not self.gpu else "sm" for s in STAGES}
            every = {s: float(len(self.cores)) if resource[s] == "cores" else 1.0 for s in STAGES}
            rates = m.rates(every, len(self.cores), self.gpu)
            costs = {s: every[s] / r for s, r in rates.items() if math.isfinite(r) and r > 0}
            if len(costs) < len(STAGES) or self.observations < CALIBRATE_AT:
                return None, {}
            kernel = self.kernel if self.gpu else {}
            self.profile = linear_profile(
                costs, [self.shape.envs_per_group], resource, profile_key(self.cfg), every, kernel
            )
            self._start(self.profile)
            unit = "CPU ms per env step of simulate, GPU ms of the others" if self.gpu else "CPU ms per env step"
            line = (
                f"allocator: calibrated from iteration {self.observations} ({unit}: "
                + ", ".join(f"{s} {1e3 * c:.2f}" for s, c in costs.items())
                + f"); plan {describe(self.current)}"
                + (
                    f"; other processes kept {m.foreign:.1f} of the {len(self.cores)} cores busy (measured beside "
                    "them; the supervisor's and a lent trainer's thread teams leave them their cores)"
                    if m.foreign >= FOREIGN_CORES
                    else ""
                )
                + (f"; SM shares by kernel time: {kernel_text(costs, kernel)} ({self.kernel_source})" if kernel else "")
            )
            return line, self._metrics(rates)
        rates = m.rates(self.current.x, len(self.cores), self.gpu)
        if self.controller is not None:
            decision = self.controller.observe({s: r for s, r in rates.items() if math.isfinite(r)}, m.busy)
            if decision is not None:
                self.decisions.append(decision)
                self.current = decision.new
                line = f"allocator: {decision.reason}"
        return line, self._metrics(rates)

    def _metrics(self, rates: Mapping[str, float]) -> dict[str, float]:
        out = {f"alloc/{s}": float(self.current.x[s]) for s in STAGES}
        out.update({f"alloc/rate_{s}": float(r) for s, r in rates.items() if math.isfinite(r)})
        if self.profile is not None:
            out["alloc/predicted_steps_per_s"] = evaluate(
                self.profile, self.current.x, self.current.batch, self.current.groups
            ).throughput
        out["alloc/replans"] = float(len(self.decisions))
        return out


def kernel_text(costs: Mapping[str, float], kernel: Mapping[str, float]) -> str:
    """'generate's kernels 2.68 of its 5.05 GPU ms per env step, train's ...': what sized the SM shares."""
    return ", ".join(
        f"{s}'s kernels {1e3 * costs[s] * k:.2f} of its {1e3 * costs[s]:.2f} GPU ms per env step"
        for s, k in kernel.items()
        if s in costs
    )


def describe(p: Plan) -> str:
    limit = (
        f"limited by {CYCLE}: {groups_text(p.groups)}" if p.limited_by == CYCLE else f"{p.bottleneck} the bottleneck"
    )
    return (
        ", ".join(f"{s} {p.x[s]:g}" for s in STAGES)
        + f", generation batch {p.batch}"
        + (
            f" (predicted {p.throughput:.1f} env steps/s, {limit})"
            if all(math.isfinite(r) for r in p.rates.values())
            else ""
        )
    )
