"""Stage profiles: the env steps/s each stage sustains for an amount of its resource and a generation batch.

A profile is measured once per (policy, preset, env, task, hw) and stored as YAML; the planner only ever asks it
`rate(stage, x, batch)`, so a measured grid and the built-in calibration's linear stand-in are interchangeable.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ebrl.errors import BadInput

STAGES = ("simulate", "generate", "train")
RESOURCES = ("cores", "sm", "core_share")
VERSION = 1
KEY_FIELDS = ("policy", "preset", "env", "task", "hw")  # the fields that name a profile's file
GRID_FRACTIONS = 8  # linear_profile's points for a shared resource: max_x/8, 2*max_x/8, ..., max_x
# Above the measured range with a single point there is no last segment to read an efficiency from: more cores
# step more envs independently, while a bigger SM or core share rarely speeds one batch up in proportion.
SINGLE_POINT_EFFICIENCY = {"simulate": 1.0}
OTHER_SINGLE_POINT_EFFICIENCY = 0.5


class ProfileError(BadInput, ValueError):
    """A profile that cannot answer: an unknown stage, a malformed file or point."""


@dataclass(frozen=True)
class Point:
    """One measurement: `stage` sustained `rate` env steps/s with `x` of its resource at generation batch `batch`."""

    stage: str
    x: float
    batch: int
    rate: float


class StageProfile:
    """Measured rates per stage on a grid of (x, batch), with the metadata that says what was measured where.

    `key` names the workload (policy, preset, env, task, hw, num_envs); `resource` says per stage what x counts:
    "cores" (integer CPU cores), "sm" (SM share of one GPU) or "core_share" (time-sliced fraction of cores).
    """

    def __init__(
        self, points: Sequence[Point], key: Mapping[str, Any] | None = None, resource: Mapping[str, str] | None = None
    ) -> None:
        self.key = dict(key or {})
        self.resource = dict(resource or {})
        for stage, kind in self.resource.items():
            if kind not in RESOURCES:
                raise ProfileError(f"resource[{stage!r}]={kind!r}: expected one of {', '.join(RESOURCES)}")
        # Plain floats and ints, so that YAML round-trips numpy scalars from a measurement
        self.points = tuple(Point(p.stage, float(p.x), int(p.batch), float(p.rate)) for p in points)
        grid: dict[str, dict[int, dict[float, float]]] = {}
        for p in self.points:
            if not (p.x > 0 and math.isfinite(p.x) and p.batch >= 1 and p.rate > 0 and math.isfinite(p.rate)):
                raise ProfileError(f"point {p}: needs a finite x > 0, batch >= 1 and a finite rate > 0")
            curve = grid.setdefault(p.stage, {}).setdefault(p.batch, {})
            if p.x in curve:
                raise ProfileError(f"two points for {p.stage} at x={p.x:g}, batch={p.batch}")
            curve[p.x] = p.rate
        # stage -> (sorted batches, per batch (sorted xs, their rates))
        self._grid = {
            stage: (
                sorted(curves),
                [(sorted(curves[b]), [curves[b][x] for x in sorted(curves[b])]) for b in sorted(curves)],
            )
            for stage, curves in grid.items()
        }

    @property
    def stages(self) -> list[str]:
        """Stages with points, the pipeline's stages first."""
        return sorted(self._grid, key=lambda s: (STAGES.index(s) if s in STAGES else len(STAGES), s))

    def batches(self, stage: str) -> list[int]:
        """The generation batches `stage` was measured at, ascending."""
        return list(self._curves(stage)[0])

    def rate(self, stage: str, x: float, batch: int) -> float:
        """Env steps/s `stage` sustains with `x` of its resource at generation batch `batch`.

        Bilinear on the measured grid: piecewise linear in x at each measured batch (within the xs that batch
        has), then linear in batch between the two measured batches around `batch`; a batch outside the measured
        ones is clamped to the nearest. In x beyond the measured range, per batch:
        - below the least x, proportional toward 0: rate(x_min) * x / x_min;
        - above the largest x, the extra amount x - x_max yields `e` times the per-unit rate at x_max:
          rate(x_max) * (1 + e * (x / x_max - 1)). If the last two points show the rate grow by a factor f while x
          grows by g, e = min(f / g, 1): scaling that was sublinear stays so, and superlinear is not trusted.
          With a single point, e = 1 for simulate (envs on more cores step independently) and 0.5 otherwise.
          Applying e to the excess only keeps the rate continuous at x_max (e = 1 is plain proportional scaling).
        """
        batches, curves = self._curves(stage)
        i = bisect.bisect_left(batches, batch)
        if i < len(batches) and batches[i] == batch:
            return _along_x(stage, *curves[i], x)
        if i == 0 or i == len(batches):
            return _along_x(stage, *curves[min(i, len(batches) - 1)], x)
        b0, b1 = batches[i - 1], batches[i]
        r0, r1 = _along_x(stage, *curves[i - 1], x), _along_x(stage, *curves[i], x)
        return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)

    def corrected(self, factors: Mapping[str, float]) -> StageProfile:
        """A copy whose rates of stage s are multiplied by factors.get(s, 1.0): measured over predicted."""
        return StageProfile(
            [replace(p, rate=p.rate * factors.get(p.stage, 1.0)) for p in self.points], self.key, self.resource
        )

    def matches(self, key: Mapping[str, Any]) -> list[str]:
        """The fields of `key` whose values differ from this profile's key (compared as text), or that it lacks."""
        return [k for k, v in key.items() if k not in self.key or str(self.key[k]) != str(v)]

    def save(self, path: Path | str) -> Path:
        """Write the profile as YAML (creating the folder) and return the path."""
        path = Path(path)
        data = {
            "version": VERSION,
            "key": self.key,
            "resource": self.resource,
            "points": {
                stage: [{"x": p.x, "batch": p.batch, "rate": p.rate} for p in self.points if p.stage == stage]
                for stage in self.stages
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
        return path

    @classmethod
    def load(cls, path: Path | str) -> StageProfile:
        """Read a profile written by `save`; anything else raises ProfileError naming the file."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ProfileError(f"{path}: not YAML ({' '.join(str(e).split())})") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: not a stage profile (expected a mapping with version, key, resource, points)")
        if data.get("version") != VERSION:
            raise ProfileError(f"{path}: version {data.get('version')!r}, expected {VERSION}")
        missing = [f for f in ("key", "resource", "points") if not isinstance(data.get(f), dict)]
        if missing:
            raise ProfileError(f"{path}: missing or not a mapping: {', '.join(missing)}")
        try:
            points = [Point(stage, p["x"], p["batch"], p["rate"]) for stage, ps in data["points"].items() for p in ps]
            return cls(points, data["key"], data["resource"])
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{path}: malformed point ({e!r}); each needs x, batch and rate") from None

    def _curves(self, stage: str) -> tuple[list[int], list[tuple[list[float], list[float]]]]:
        if stage not in self._grid:
            raise ProfileError(f"profile has no points for stage {stage!r}; it has: {', '.join(self.stages) or 'none'}")
        return self._grid[stage]


def _along_x(stage: str, xs: list[float], rates: list[float], x: float) -> float:
    """One batch's curve at x, extrapolated as StageProfile.rate documents."""
    if x <= xs[0]:
        return rates[0] * max(x, 0.0) / xs[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            efficiency = SINGLE_POINT_EFFICIENCY.get(stage, OTHER_SINGLE_POINT_EFFICIENCY)
        else:
            efficiency = min((rates[-1] / rates[-2]) / (xs[-1] / xs[-2]), 1.0)
        return rates[-1] * (1 + efficiency * (x / xs[-1] - 1))
    i = bisect.bisect_right(xs, x)
    x0, x1, r0, r1 = xs[i - 1], xs[i], rates[i - 1], rates[i]
    return r0 + (r1 - r0) * (x - x0) / (x1 - x0)


def profile_path(root: Path, key: Mapping[str, Any]) -> Path:
    """Where the profile of `key` lives: root/{policy}-{preset}_{env}-{task}_{hw}.yaml, odd characters as '_'."""
    missing = [f for f in KEY_FIELDS if f not in key]
    if missing:
        raise ProfileError(f"profile key lacks {', '.join(missing)}; a profile's name needs {', '.join(KEY_FIELDS)}")
    safe = {f: re.sub(r"[^A-Za-z0-9._-]", "_", str(key[f])) for f in KEY_FIELDS}
    return Path(root) / f"{safe['policy']}-{safe['preset']}_{safe['env']}-{safe['task']}_{safe['hw']}.yaml"


def linear_profile(
    costs: Mapping[str, float],
    batches: Sequence[int],
    resource: Mapping[str, str],
    key: Mapping[str, Any],
    max_x: Mapping[str, float],
    kernel: Mapping[str, float] | None = None,
) -> StageProfile:
    """The built-in calibration's profile from each stage's cost alone, assuming every stage scales linearly.

    costs[s] is the seconds one unit of s's resource spends per env step (e.g. CPU-seconds per env step on one
    core), so rate(x) = x / costs[s]: at x = 1..max_x cores for simulate, at GRID_FRACTIONS even fractions of
    max_x for the others, the same at every batch in `batches`. A GPU stage's time at max_x is its kernels' (the
    share `kernel[s]` of it, which stretches as the SM share shrinks) and the host's issuing them (which does not):
    its time per env step at x is max_x / rate(max_x) x ((1 - k) + k max_x / x). The measured profile replaces it
    where the scaling is not linear (batching gains, memory-bound kernels, contended cores).
    """
    if not batches:
        raise ProfileError("batches: needs at least one generation batch")
    points = []
    for stage, cost in costs.items():
        top = max_x.get(stage, 0)
        if not (cost > 0 and math.isfinite(cost)):
            raise ProfileError(f"costs[{stage!r}]={cost}: needs finite seconds per env step > 0")
        if not (top >= 1 if stage == "simulate" else top > 0):
            raise ProfileError(f"max_x[{stage!r}]={top}: needs {'>= 1 core' if stage == 'simulate' else '> 0'}")
        xs = (
            range(1, int(top) + 1)
            if stage == "simulate"
            else [top * k / GRID_FRACTIONS for k in range(1, GRID_FRACTIONS + 1)]
        )
        k = (kernel or {}).get(stage)
        if k is None:
            points += [Point(stage, x, b, x / cost) for x in xs for b in batches]
        else:
            if not 0 < k <= 1:
                raise ProfileError(f"kernel[{stage!r}]={k}: the share of the stage's time its kernels fill, in (0, 1]")
            points += [Point(stage, x, b, 1 / (cost / top * ((1 - k) + k * top / x))) for x in xs for b in batches]
    return StageProfile(points, key, resource)
