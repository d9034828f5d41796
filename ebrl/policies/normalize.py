"""A checkpoint's normalisation statistics: state normalised on the way in, actions un-normalised on the way out.

A pretrained policy acts in the space its training data was normalised to. Two writers, two conventions, each
reproduced as its own code computes it (the source decides, so a checkpoint acts as it was trained):
- openpi: `assets/<asset_id>/norm_stats.json`, {"norm_stats": {"state": {mean, std, q01, q99}, "actions": {...}}};
  mean/std: (x - mean) / (std + 1e-6), back x * (std + 1e-6) + mean; quantiles: (x - q01) / (q99 - q01 + 1e-6) * 2 - 1,
  back (x + 1) / 2 * (q99 - q01 + 1e-6) + q01 (openpi/transforms.py, Normalize and Unnormalize). Stats may be wider
  than the data (openpi pads them): they are cut to the data's dims.
- lerobot: `policy_preprocessor.json` names a `normalizer_processor` step whose tensors
  (`observation.state.mean`, `action.q01`, ...) lie in a safetensors file beside it, and `policy_postprocessor.json`
  an `unnormalizer_processor`; mean/std: (x - mean) / (std + eps), back x * std + mean; quantiles:
  2 (x - q01) / d - 1, back (x + 1) d / 2 + q01 with d = q99 - q01, eps where d == 0 (lerobot/processor/
  normalize_processor.py, eps from the step's config, 1e-8 by default).
Which mode (mean_std or quantiles) is the checkpoint's: pi0 uses mean/std, pi0.5 quantiles (lerobot's
normalization_mapping, openpi's use_quantile_norm), and `policy.norm_mode` may say otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ebrl.config import ConfigError

MODES = ("mean_std", "quantiles")
CONVENTIONS = ("openpi", "lerobot")
OPENPI_EPS = 1e-6
STAT_NAMES = ("mean", "std", "q01", "q99")


@dataclass
class Stats:
    """One feature's statistics (float64 numpy arrays; absent ones are None)."""

    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    def dims(self) -> int:
        return len(next(a for a in (self.mean, self.std, self.q01, self.q99) if a is not None))


@dataclass
class NormStats:
    """State and action statistics, the convention of the code that wrote them, and where they came from."""

    state: Stats
    action: Stats
    convention: str
    source: str
    eps: float = 1e-8  # lerobot's epsilon (openpi's is fixed at 1e-6)
    modes: dict[str, str] = field(default_factory=dict)  # the writer's own {"state"|"action": mode}, if it says


def _stats(entry: dict, source: str, name: str) -> Stats:
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: {name} is not a table of statistics")
    return Stats(
        **{k: np.asarray(entry[k], dtype=np.float64).reshape(-1) for k in STAT_NAMES if entry.get(k) is not None}
    )


def read_openpi(path: Path) -> NormStats:
    """openpi's norm_stats.json (keys "state" and "actions")."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.norm_stats={path} is not a readable JSON file ({type(e).__name__})") from None
    return openpi_stats(table, str(path))


def openpi_stats(table: dict, source: str) -> NormStats:
    """The statistics of an openpi norm_stats.json's contents (a checkpoint of ours carries them so)."""
    table = table.get("norm_stats", table)
    missing = [k for k in ("state", "actions") if k not in table]
    if missing:
        raise ConfigError(
            f"policy.norm_stats={source} has no {' or '.join(missing)} statistics (keys: "
            f"{', '.join(table) or 'none'}); openpi's norm_stats.json has 'state' and 'actions'"
        )
    return NormStats(
        _stats(table["state"], source, "state"), _stats(table["actions"], source, "actions"), "openpi", source
    )


def openpi_table(stats: NormStats) -> dict:
    """openpi's norm_stats.json contents of statistics in openpi's convention (`in_convention`)."""
    assert stats.convention == "openpi"
    return {
        "norm_stats": {
            name: {
                k: getattr(getattr(stats, key), k).tolist()
                for k in STAT_NAMES
                if getattr(getattr(stats, key), k) is not None
            }
            for key, name in (("state", "state"), ("action", "actions"))
        }
    }


def lerobot_tensors(stats: NormStats) -> dict[str, torch.Tensor]:
    """The tensors of a lerobot normalizer step's state file (`observation.state.mean`, `action.q01`, ...) of
    statistics in lerobot's convention (`in_convention`)."""
    assert stats.convention == "lerobot"
    return {
        f"{feature}.{k}": torch.tensor(getattr(getattr(stats, key), k), dtype=torch.float32)
        for key, feature in (("state", "observation.state"), ("action", "action"))
        for k in STAT_NAMES
        if getattr(getattr(stats, key), k) is not None
    }


def in_convention(stats: NormStats, convention: str, eps: float = 1e-8) -> NormStats:
    """The same normalisation written for another writer's formulas (module docstring): the std and q99 are shifted
    so that the other convention divides by what this one divides by (openpi's 1e-6 against lerobot's eps), exactly
    but for an eps where an un-normalisation multiplies (below 1e-6 of the stats' scale). `eps`: lerobot's."""
    if convention == stats.convention and (convention == "openpi" or eps == stats.eps):
        return stats
    old = OPENPI_EPS if stats.convention == "openpi" else stats.eps
    new = OPENPI_EPS if convention == "openpi" else eps
    out = {}
    for key in ("state", "action"):
        f = getattr(stats, key)
        q99 = f.q99
        if f.q01 is not None and f.q99 is not None:  # the span each divides by: openpi's + 1e-6, lerobot's eps at 0
            span = (
                f.q99 - f.q01 + OPENPI_EPS
                if stats.convention == "openpi"
                else np.where(f.q99 == f.q01, old, f.q99 - f.q01)
            )
            q99 = f.q01 + span - (OPENPI_EPS if convention == "openpi" else 0.0)
        out[key] = Stats(f.mean, None if f.std is None else f.std + old - new, f.q01, q99)
    return NormStats(out["state"], out["action"], convention, stats.source, eps=eps, modes=dict(stats.modes))


def norm_modes(stats: NormStats, norm_mode: str | None, default: str) -> tuple[str, str]:
    """(state mode, action mode) a policy normalises with: `policy.norm_mode`, else the writer's own, else the
    family's `default`."""
    return tuple(norm_mode or stats.modes.get(key) or default for key in ("state", "action"))  # type: ignore


LEROBOT_MODES = {"MEAN_STD": "mean_std", "QUANTILES": "quantiles"}


def read_lerobot(folder: Path) -> NormStats:
    """The normaliser step of a lerobot `policy_preprocessor.json` and its tensors."""
    from safetensors.torch import load_file

    pre = folder / "policy_preprocessor.json"
    try:
        steps = json.loads(pre.read_text())["steps"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{pre} is not a lerobot processor file ({type(e).__name__})") from None
    step = next((s for s in steps if s.get("registry_name") == "normalizer_processor"), None)
    if step is None or not step.get("state_file"):
        raise ConfigError(f"{pre} has no normalizer_processor step with statistics; give policy.norm_stats=<file>")
    tensors = load_file(str(folder / step["state_file"]))
    config = step.get("config", {})
    mapping = config.get("norm_map", {})

    def feature(key: str) -> Stats:
        found = {
            name: tensors[f"{key}.{name}"].double().numpy().reshape(-1)
            for name in STAT_NAMES
            if f"{key}.{name}" in tensors
        }
        if not found:
            raise ConfigError(
                f"{folder / step['state_file']} has no statistics for {key} (it has: "
                f"{', '.join(sorted({k.rsplit('.', 1)[0] for k in tensors}))})"
            )
        return Stats(**found)

    modes = {
        ours: LEROBOT_MODES[mapping[theirs]]
        for ours, theirs in (("state", "STATE"), ("action", "ACTION"))
        if mapping.get(theirs) in LEROBOT_MODES
    }
    return NormStats(
        feature("observation.state"),
        feature("action"),
        "lerobot",
        str(folder / step["state_file"]),
        eps=float(config.get("eps", 1e-8)),
        modes=modes,
    )


def read_norm_stats(path: str | Path) -> NormStats:
    """policy.norm_stats: an openpi norm_stats.json, a lerobot policy_preprocessor.json, or a folder holding either
    (a lerobot checkpoint, or an openpi one with assets/<asset_id>/norm_stats.json)."""
    p = Path(path).expanduser()
    if p.is_file():
        return read_lerobot(p.parent) if p.name == "policy_preprocessor.json" else read_openpi(p)
    found = find_norm_stats(p)
    if found is None:
        raise ConfigError(
            f"policy.norm_stats={path}: no norm_stats.json or policy_preprocessor.json there; give the file"
        )
    return read_norm_stats(found)


def find_norm_stats(folder: Path) -> Path | None:
    """A checkpoint folder's statistics file: lerobot's processor file (unless its normaliser holds none: a policy
    trained without statistics), else openpi's one assets/*/norm_stats.json (None when there is none; one line when
    there are several to choose from)."""
    if (folder / "policy_preprocessor.json").is_file() and _has_statistics(folder / "policy_preprocessor.json"):
        return folder / "policy_preprocessor.json"
    if (folder / "norm_stats.json").is_file():
        return folder / "norm_stats.json"
    found = sorted((folder / "assets").glob("*/norm_stats.json")) if folder.is_dir() else []
    if len(found) > 1:
        raise ConfigError(
            f"{folder / 'assets'} holds statistics of {len(found)} datasets "
            f"({', '.join(f.parent.name for f in found)}): choose one with policy.norm_stats=<file>"
        )
    return found[0] if found else None


def _has_statistics(processor: Path) -> bool:
    try:
        steps = json.loads(processor.read_text())["steps"]
    except (OSError, ValueError, KeyError):
        return True  # (read_lerobot says what is wrong with it)
    return any(s.get("registry_name") == "normalizer_processor" and s.get("state_file") for s in steps)


class Normalizer:
    """x -> normalised and back, for state and action, in one mode each and the writer's convention. Float32 math on
    whatever device x is on; the statistics are cut to (or must cover) the data's dims."""

    def __init__(self, stats: NormStats, state_mode: str, action_mode: str) -> None:
        for key, mode in (("state", state_mode), ("action", action_mode)):
            if mode not in MODES:
                raise ConfigError(f"policy.norm_mode={mode!r} is not available; accepted: {', '.join(MODES)}")
            need = ("mean", "std") if mode == "mean_std" else ("q01", "q99")
            feature = getattr(stats, key)
            if any(getattr(feature, n) is None for n in need):
                raise ConfigError(
                    f"{stats.source} has no {'/'.join(need)} for {key}, which {mode} normalisation "
                    f"needs; set policy.norm_mode to what the checkpoint was trained with"
                )
        self.stats, self.modes = stats, {"state": state_mode, "action": action_mode}
        self._cache: dict[tuple[str, str, str, torch.device], torch.Tensor] = {}

    def dims(self, key: str) -> int:
        return getattr(self.stats, key).dims()

    def _stat(self, key: str, name: str, dims: int, device: torch.device) -> torch.Tensor:
        cache_key = (key, name, str(dims), device)
        if cache_key not in self._cache:
            values = getattr(getattr(self.stats, key), name)
            if len(values) < dims:
                raise ConfigError(f"{self.stats.source}: {key} statistics have {len(values)} dims, the data {dims}")
            self._cache[cache_key] = torch.as_tensor(values[:dims], dtype=torch.float32, device=device)
        return self._cache[cache_key]

    def _scale_shift(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(offset, denominator for normalising, factor for un-normalising): normalised = (x - offset) / denom
        (times 2 minus 1 for quantiles), back = normalised * factor + offset."""
        dims, device, openpi = x.shape[-1], x.device, self.stats.convention == "openpi"
        if self.modes[key] == "mean_std":
            mean, std = self._stat(key, "mean", dims, device), self._stat(key, "std", dims, device)
            return mean, std + (OPENPI_EPS if openpi else self.stats.eps), std + OPENPI_EPS if openpi else std
        q01, q99 = self._stat(key, "q01", dims, device), self._stat(key, "q99", dims, device)
        span = (
            q99 - q01 + OPENPI_EPS
            if openpi
            else torch.where(q99 == q01, torch.full_like(q01, self.stats.eps), q99 - q01)
        )
        return q01, span, span

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        offset, denom, _ = self._scale_shift(key, x)
        z = (x.float() - offset) / denom
        return z * 2.0 - 1.0 if self.modes[key] == "quantiles" else z

    def unnormalize(self, key: str, z: torch.Tensor) -> torch.Tensor:
        offset, _, factor = self._scale_shift(key, z)
        z = z.float()
        if self.modes[key] == "quantiles":
            z = (z + 1.0) / 2.0
        return z * factor + offset
