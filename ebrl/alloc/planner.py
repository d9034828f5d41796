"""Split a node between simulate, generate and train so that the pipeline (its slowest stage, or the cycle of env
groups through simulate and generate) is as fast as the profile allows, and re-split during training when measured
rates drift from the profile, with hysteresis so that one slow iteration does not move workers around.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ebrl.alloc.profile import STAGES, StageProfile
from ebrl.errors import BadInput

EPS = 1e-9  # slack on sums of amounts: 0.75 + 0.25 must fit in 1
# CPU cores of their own that generate and train each need on a GPU node: kernel launches, pickling batches through
# pipes, weight copies and the Python of their loops run on the CPU
GPU_STAGE_CORES = 1
CYCLE = "the group cycle"  # what Plan.limited_by names when the cycle of groups binds, not a stage


class PlanError(BadInput, ValueError):
    """No split of the node's resources hosts the stages."""


@dataclass(frozen=True)
class Totals:
    """What the planner may hand out on one node."""

    cores: int  # CPU cores EBRL may use
    gpus: int = 0  # 0: a CPU-only node, where generate and train take time-sliced core shares
    sm_granule: float = 0.01  # SM shares come in these steps: 8/132 for green contexts on Hopper, 0.01 for MPS
    core_granule: float = 0.25  # core shares of generate and train on a CPU-only node come in these steps
    gpu_stage_cores: int = GPU_STAGE_CORES  # GPU node: whole cores each of generate and train keeps from simulate

    @property
    def max_sim_cores(self) -> int:
        """The most cores simulate may take on a GPU node: all but the supervisor's and generate's and train's."""
        return self.cores - 1 - 2 * self.gpu_stage_cores


@dataclass(frozen=True)
class Plan:
    """Amounts per stage (sim cores; SM or core shares), the generation batch and groups, and their predicted rates."""

    x: dict[str, float]
    batch: int
    groups: int  # num_envs // batch: the env groups that cycle through simulate and generate
    rates: dict[str, float]  # env steps/s per stage

    @property
    def throughput(self) -> float:
        """Env steps/s of the pipeline: its slowest stage's, or the group cycle's if that is lower (nan if any is)."""
        return float(np.min([*self.rates.values(), self.cycle]))

    @property
    def cycle(self) -> float:
        """Env steps/s the group cycle allows: groups / (1/rate_simulate + 1/rate_generate)."""
        return float(_cycle(self.groups, self.rates["simulate"], self.rates["generate"]))

    @property
    def bottleneck(self) -> str:
        """The slowest stage (the first in pipeline order on a tie)."""
        return min(self.rates, key=self.rates.__getitem__)

    @property
    def limited_by(self) -> str:
        """What binds throughput: CYCLE ("the group cycle") when it is below every stage's rate, else the bottleneck."""
        return CYCLE if self.cycle < min(self.rates.values()) else self.bottleneck


def plan(
    profile: StageProfile,
    totals: Totals,
    num_envs: int,
    batches: Sequence[int] | None = None,
    fixed: Mapping[str, float] | None = None,
) -> Plan:
    """The amounts and generation batch that maximise the predicted throughput, by exhaustive grid search.

    Throughput is the least stage rate, capped by the closed network asymptotic bound of the G = num_envs / batch
    groups that cycle through simulate and generate, G / (1/rate_simulate + 1/rate_generate): generation overlaps
    simulation only across groups, so one group serialises them (docs/internals/schedules.md, "Measured choices"; from 2
    groups on the bound is at least the slower stage's rate and never binds).

    CPU-only node: all three take core shares (multiples of core_granule; simulate at least 1 core) summing to at
    most `cores`: shares time-slice cores, so few cores still host every stage, and the simulators, which run
    niced, also fill what the policy's stages leave of a shared core (see ebrl.alloc.allocator.cpu_sets).
    GPU node: simulate takes 1..totals.max_sim_cores whole cores (one stays with the supervisor and gpu_stage_cores
    with each of generate and train), generate and train SM shares of one GPU (multiples of sm_granule) summing to
    at most 1. The batch is one of `batches` (default: the profile's generate batches) that divides num_envs.
    `fixed` pins stages' amounts. Ties go to the larger second-smallest stage rate, then the smaller batch, then the
    larger third rate, then smaller amounts (simulate, generate, train).
    """
    gpu = _check_totals(totals, num_envs)
    fixed = dict(fixed or {})
    _check_profile(profile, gpu)
    options = _options(totals, gpu, fixed)
    best: tuple[tuple[float, ...], dict[str, float], int] | None = None
    for batch in _batch_candidates(profile, num_envs, batches):
        found = _best_at(profile, totals.cores, gpu, options, batch, num_envs // batch)
        if found is not None and (best is None or found[0] > best[0]):
            best = (*found, batch)
    if best is None:
        room = "1 GPU's SM" if gpu else f"{totals.cores} cores"
        raise PlanError(f"fixed={fixed} leaves no room for the other stages in {room}")
    return evaluate(profile, best[1], best[2], num_envs // best[2])


def evaluate(profile: StageProfile, x: Mapping[str, float], batch: int, groups: int) -> Plan:
    """The plan of these amounts, batch and group count, with the rates `profile` predicts for them."""
    return Plan(dict(x), batch, groups, {s: profile.rate(s, x[s], batch) for s in STAGES})


def _cycle(groups: int, simulate: float | np.ndarray, generate: float | np.ndarray) -> np.ndarray:
    """groups / (1/simulate + 1/generate), elementwise: 0 if a rate is 0, inf if both are inf, nan if one is."""
    with np.errstate(divide="ignore"):
        return groups / (1 / np.asarray(simulate, dtype=float) + 1 / np.asarray(generate, dtype=float))


def _check_totals(totals: Totals, num_envs: int) -> bool:
    """Whether this is a GPU node; raises PlanError if the node cannot host the three stages."""
    if totals.gpus < 0:
        raise PlanError(f"totals.gpus={totals.gpus}: needs 0 (CPU-only node) or more")
    if num_envs < 1:
        raise PlanError(f"num_envs={num_envs}: needs at least 1 env")
    if totals.gpus:
        if not 0 < totals.sm_granule <= 1:
            raise PlanError(f"totals.sm_granule={totals.sm_granule}: needs a share of one GPU in (0, 1]")
        if totals.gpu_stage_cores < 0:
            raise PlanError(f"totals.gpu_stage_cores={totals.gpu_stage_cores}: needs 0 or more cores")
        if totals.max_sim_cores < 1:
            need, each = totals.cores - totals.max_sim_cores + 1, totals.gpu_stage_cores
            raise PlanError(
                f"totals.cores={totals.cores}: a GPU node needs {need} cores (1 to simulate, 1 for the "
                f"supervisor, {each} each for generate and train)"
            )
        return True
    if not totals.core_granule > 0:
        raise PlanError(f"totals.core_granule={totals.core_granule}: needs a core share > 0")
    need = 1 + 2 * totals.core_granule
    if totals.cores < need:
        raise PlanError(
            f"totals.cores={totals.cores}: a CPU-only node needs {need:g} cores "
            f"(1 to simulate, {totals.core_granule:g} each to generate and train)"
        )
    return False


def _check_profile(profile: StageProfile, gpu: bool) -> None:
    """A profile measured on other hardware counts another resource: its rates would not mean anything here."""
    shares = ("sm",) if gpu else ("core_share", "cores")  # on a CPU-only node both count cores
    for stage, accepted in zip(STAGES, (("cores",), shares, shares)):
        kind = profile.resource.get(stage, accepted[0])
        if kind not in accepted:
            node = "a GPU node" if gpu else "a CPU-only node"
            raise PlanError(
                f"profile.resource[{stage!r}]={kind!r}, but on {node} {stage} takes "
                f"{' or '.join(map(repr, accepted))}: calibrate on this hardware"
            )


def _options(totals: Totals, gpu: bool, fixed: dict[str, float]) -> dict[str, np.ndarray]:
    """Each stage's candidate amounts, ascending: its grid, or its pinned amount."""
    unknown = sorted(set(fixed) - set(STAGES))
    if unknown:
        raise PlanError(f"fixed: unknown stage(s) {', '.join(unknown)}; expected {', '.join(STAGES)}")
    granule = totals.sm_granule if gpu else totals.core_granule
    shares = np.round(np.arange(1, math.floor((1 if gpu else totals.cores) / granule + EPS) + 1) * granule, 12)
    if gpu:  # whole cores, what the supervisor, generate and train keep aside
        sim = np.arange(1, totals.max_sim_cores + 1, dtype=float)
    else:
        sim = np.round(np.arange(1, totals.cores + EPS, totals.core_granule), 12)
    options = {"simulate": sim, "generate": shares, "train": shares}
    for stage, amount in fixed.items():
        if gpu and stage == "simulate" and not (amount == int(amount) and 1 <= amount <= totals.max_sim_cores):
            raise PlanError(f"fixed['simulate']={amount}: needs whole cores in 1..{totals.max_sim_cores}")
        if not amount > 0:
            raise PlanError(f"fixed[{stage!r}]={amount}: needs an amount > 0")
        options[stage] = np.array([float(amount)])
    return options


def _batch_candidates(profile: StageProfile, num_envs: int, batches: Sequence[int] | None) -> list[int]:
    """Generation batches to try: those given (or profiled for generate) that divide num_envs."""
    candidates = sorted(set(profile.batches("generate") if batches is None else batches))
    valid = [b for b in candidates if b >= 1 and num_envs % b == 0]
    if not valid:
        raise PlanError(
            f"no generation batch in {candidates} divides num_envs={num_envs}: "
            f"pick num_envs a multiple of one, or profile a batch that divides it"
        )
    return valid


def _best_at(
    profile: StageProfile, cores: int, gpu: bool, options: dict[str, np.ndarray], batch: int, groups: int
) -> tuple[tuple[float, ...], dict[str, float]] | None:
    """The best amounts at one batch with their tie-breaking key (larger is better), or None if nothing fits.

    Every (simulate, generate) pair is tried; for train, the largest rate among the amounts that still fit is
    best whatever the other two rates are (raising one of three rates never worsens their sorted tuple, and the
    group cycle does not depend on train), so a running argmax over train's grid replaces the third loop.
    """
    xs, xg, xt = (options[s] for s in STAGES)
    rs, rg, rt = (np.array([profile.rate(s, x, batch) for x in options[s]]) for s in STAGES)
    room = np.broadcast_to((1.0 if gpu else cores - xs[:, None]) - xg[None, :], (len(xs), len(xg)))
    fits = np.searchsorted(xt, room + EPS, side="right")  # how many train amounts fit next to (s, g)
    if not fits.any():
        return None
    running_best = np.zeros(len(xt), dtype=int)  # argmax of rt[:i + 1], the smallest amount on a tie
    for i in range(1, len(xt)):
        running_best[i] = i if rt[i] > rt[running_best[i - 1]] else running_best[i - 1]
    si, gi = np.nonzero(fits)
    ti = running_best[fits[si, gi] - 1]
    lo, mid, hi = np.sort(np.stack([rs[si], rg[gi], rt[ti]]), axis=0)
    throughput = np.minimum(lo, _cycle(groups, rs[si], rg[gi]))
    k = np.lexsort((xt[ti], xg[gi], xs[si], -hi, -mid, -throughput))[0]
    x = {"simulate": float(xs[si[k]]), "generate": float(xg[gi[k]]), "train": float(xt[ti[k]])}
    return (float(throughput[k]), float(mid[k]), -batch, float(hi[k]), -xs[si[k]], -xg[gi[k]], -xt[ti[k]]), x


@dataclass(frozen=True)
class Decision:
    """One re-plan: at which observation, from which plan to which, why, and the predicted relative gain."""

    step: int
    old: Plan
    new: Plan
    reason: str
    gain: float  # predicted throughput of new over old, minus 1, under the corrected profile


class ElasticController:
    """Re-plans while training when measured stage rates show that another split would be faster.

    Exact semantics, per call of `observe` (step 1, 2, ...):
    - ratio[s] = measured[s] / the profile's prediction for s at the current plan; the correction factor of s is
      an EMA of it: f[s] <- (1 - ema) * f[s] + ema * ratio[s], starting at 1. Unmeasured stages keep theirs.
    - The observation votes for a re-plan when the best plan under the profile corrected by this observation's
      own ratios, and the best plan under the profile corrected by the EMA factors, each beat the current plan
      (predicted under the same correction) by more than `min_gain`, relatively.
    - On the `window`-th consecutive vote the controller switches to the EMA-corrected best plan; an observation
      that does not vote resets the count.
    - The `cooldown` observations after a switch are ignored (no EMA update, no vote): the re-bound stages are
      still warming up. So two switches are at least cooldown + window observations apart.
    Hence a blip of any size votes at most once (the next observation's own ratios do not vote), and never
    re-plans when window >= 2; a sustained shift re-plans on exactly its `window`-th observation when the EMA's
    first step already predicts more than `min_gain` (ema * shift large enough), later otherwise.
    """

    def __init__(
        self,
        profile: StageProfile,
        totals: Totals,
        num_envs: int,
        window: int = 3,
        min_gain: float = 0.10,
        cooldown: int = 2,
        ema: float = 0.5,
        *,
        batches: Sequence[int] | None = None,
        fixed: Mapping[str, float] | None = None,
    ) -> None:
        if window < 1 or cooldown < 0 or min_gain < 0 or not 0 < ema <= 1:
            raise ValueError(
                f"window={window}, cooldown={cooldown}, min_gain={min_gain}, ema={ema}: "
                f"need window >= 1, cooldown >= 0, min_gain >= 0 and ema in (0, 1]"
            )
        self.profile, self.totals, self.num_envs = profile, totals, num_envs
        self.window, self.min_gain, self.cooldown, self.ema = window, min_gain, cooldown, ema
        self.batches, self.fixed = batches, fixed
        self.current = plan(profile, totals, num_envs, batches, fixed)
        self.decisions: list[Decision] = []
        self.factors = {s: 1.0 for s in STAGES}  # EMA of measured over predicted rate, per stage
        self.step = 0
        self._votes = 0
        self._settling = 0  # observations still to ignore after a switch

    def observe(self, measured: Mapping[str, float], busy: Mapping[str, float] | None = None) -> Decision | None:
        """Take one observation of the stages' rates at the current plan; return the Decision if it re-plans.

        measured[s]: env steps/s stage s sustained (steps done / time it was busy). busy[s]: the fraction of
        wall time s was busy, only quoted in the decision's reason.
        """
        self.step += 1
        if self._settling:
            self._settling -= 1
            return None
        ratios = dict(self.factors)
        for stage, rate in measured.items():
            if stage not in self.factors:
                raise ValueError(f"measured[{stage!r}]: unknown stage; expected {', '.join(STAGES)}")
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"measured[{stage!r}]={rate}: needs a finite rate > 0 (env steps/s)")
            ratios[stage] = rate / self.profile.rate(stage, self.current.x[stage], self.current.batch)
            self.factors[stage] += self.ema * (ratios[stage] - self.factors[stage])
        own_gain = self._compare(ratios)[0]
        gain, now, candidate = self._compare(self.factors)
        self._votes = self._votes + 1 if min(own_gain, gain) > self.min_gain else 0
        if self._votes < self.window:
            return None
        decision = Decision(self.step, now, candidate, self._reason(now, candidate, gain, busy), gain)
        self.current, self._votes, self._settling = candidate, 0, self.cooldown
        self.decisions.append(decision)
        return decision

    def _compare(self, factors: Mapping[str, float]) -> tuple[float, Plan, Plan]:
        """Relative gain of the best plan over the current one, both under the profile corrected by `factors`."""
        corrected = self.profile.corrected(factors)
        now = evaluate(corrected, self.current.x, self.current.batch, self.current.groups)
        best = plan(corrected, self.totals, self.num_envs, self.batches, self.fixed)
        return best.throughput / now.throughput - 1, now, best

    def _reason(self, old: Plan, new: Plan, gain: float, busy: Mapping[str, float] | None) -> str:
        busy_text = f"; busy {', '.join(f'{s} {b:.0%}' for s, b in busy.items())}" if busy else ""
        if old.limited_by == CYCLE:
            limit = (
                f"{CYCLE} (simulate {_rate(old.rates['simulate'])} + generate {_rate(old.rates['generate'])} "
                f"in {groups_text(old.groups)}) limits to {_rate(old.cycle)} env steps/s "
                f"(vs train {_rate(old.rates['train'])}{busy_text})"
            )
        else:
            neck = old.bottleneck
            others = ", ".join(f"{s} {_rate(old.rates[s])}" for s in STAGES if s != neck)
            limit = f"{neck} is the bottleneck ({_rate(old.rates[neck])} env steps/s vs {others}{busy_text})"
        share = "SM share" if self.totals.gpus else "core share"
        labels = {"simulate": "sim cores", "generate": f"generate {share}", "train": f"train {share}"}
        changes = [f"{labels[s]} {old.x[s]:.3g} -> {new.x[s]:.3g}" for s in STAGES if old.x[s] != new.x[s]]
        if old.batch != new.batch:
            changes.append(f"batch {old.batch} -> {new.batch}")
        return (
            f"{limit} for {self.window} observations; {', '.join(changes)}: predicted {_rate(old.throughput)} -> "
            f"{_rate(new.throughput)} env steps/s ({gain:+.0%})"
        )


class StaticController:
    """The control: plans once from the profile and never re-plans; ElasticController's interface."""

    def __init__(
        self,
        profile: StageProfile,
        totals: Totals,
        num_envs: int,
        *,
        batches: Sequence[int] | None = None,
        fixed: Mapping[str, float] | None = None,
    ) -> None:
        self.current = plan(profile, totals, num_envs, batches, fixed)
        self.decisions: list[Decision] = []

    def observe(self, measured: Mapping[str, float], busy: Mapping[str, float] | None = None) -> None:
        """Ignore the observation: a static split never moves."""
        return None


def groups_text(groups: int) -> str:
    """The group count in words: '1 group', '2 groups'."""
    return f"{groups} group{'s' if groups != 1 else ''}"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"
