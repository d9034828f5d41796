"""Offline stage profiles: one sweep trial (`trial`) and the Hydra callback that turns the trials into a profile.

Every trial is a short run of the pipelined schedule with each stage's amount pinned to the trial's share of the
node; it writes `stage_rates.json` (the stages' measured rates at those amounts, see ebrl.alloc.allocator) to its
job folder and returns the end-to-end env steps/s for Optuna to maximise. At the end of the multirun
`WriteStageProfile` gathers the trials' points into the stage profile that run.py's allocator looks for.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from ebrl.alloc.allocator import profile_key, profiles_root
from ebrl.alloc.profile import STAGES, Point, StageProfile, profile_path
from ebrl.checks import rank_cores
from ebrl.runs.experiment import Experiment
from ebrl.shape import RolloutShape

RATES_FILE = "stage_rates.json"


def trial_amounts(cfg: DictConfig, cores: int) -> dict[str, float]:
    """The sweep's shares as allocator amounts: cores for simulate (and, on CPU, for generate and train), SM
    shares of one GPU for generate and train on a GPU node."""
    s = cfg.sweep
    policy_scale = 1.0 if cfg.hw.gpus else cores
    return {
        "simulate": max(0.25, round(s.simulate * cores, 2)),
        "generate": round(s.generate * policy_scale, 3),
        "train": round(s.train * policy_scale, 3),
    }


def trial(cfg: DictConfig, run_dir: Path | None = None) -> float:
    """One sweep trial: run with the amounts pinned, record the stages' rates, return env steps/s."""
    cores = len(rank_cores(cfg))
    amounts = trial_amounts(cfg, cores)
    with open_dict(cfg):
        for stage, amount in amounts.items():
            cfg.allocator[stage] = amount
    run = Experiment.from_config(cfg, run_dir)
    summary = run.train()
    rates = summary.measured.rates(amounts, cores, bool(cfg.hw.gpus))
    record = {
        "key": profile_key(cfg),
        "batch": RolloutShape.of(cfg).envs_per_group,
        "amounts": amounts,
        "rates": rates,
        "env_steps_per_s": summary.rollout_steps_per_s,
        "resource": {s: "cores" if s == "simulate" or not cfg.hw.gpus else "sm" for s in STAGES},
    }
    (run.run_dir / RATES_FILE).write_text(json.dumps(record, indent=2))
    return summary.rollout_steps_per_s


def profile_from_trials(records: list[dict[str, Any]]) -> StageProfile:
    """The trials' measured points (points at the same amount and batch averaged) as one stage profile."""
    if not records:
        raise ValueError("no sweep trial left stage rates: nothing to build a profile from")
    samples: dict[tuple[str, float, int], list[float]] = {}
    for r in records:
        for stage in STAGES:
            rate = r["rates"][stage]
            if rate != float("inf") and rate > 0:
                samples.setdefault((stage, float(r["amounts"][stage]), int(r["batch"])), []).append(rate)
    points = [Point(stage, x, batch, statistics.mean(v)) for (stage, x, batch), v in sorted(samples.items())]
    return StageProfile(points, key=records[0]["key"], resource=records[0]["resource"])


def sweep_progress(done: int, total: int | None, value: float | None, best: float | None, width: int = 20) -> str:
    """One console line per finished trial: a bar of trials done (of `total`, when the sweeper has a fixed count),
    the trial's env steps/s and the best so far."""
    if total:
        filled = min(width, round(width * done / total))
        head = f"sweep [{'#' * filled}{'-' * (width - filled)}] trial {done}/{total}"
    else:
        head = f"sweep: trial {done}"
    if value is None:
        return f"{head}: failed (its job folder has the error)"
    return f"{head}: {value:.1f} env steps/s (best {best:.1f})"


class WriteStageProfile(Callback):
    """During `python sweep.py -m`, a progress line per trial; at the end, the stage profile from every trial of the
    sweep folder."""

    def __init__(self) -> None:
        self.done = 0
        self.best: float | None = None

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self.done += 1
        try:
            value = float(job_return.return_value)  # raises for a failed trial
        except Exception:  # noqa: BLE001  (a failed trial is reported, the sweep goes on)
            value = None
        if value is not None:
            self.best = value if self.best is None else max(self.best, value)
        total = OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
        print(sweep_progress(self.done, total, value, self.best), flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob(f"*/{RATES_FILE}"))]
        if not records:
            print(f"sweep: no trial in {sweep_dir} finished; no stage profile written")
            return
        profile = profile_from_trials(records)
        path = profile.save(profile_path(profiles_root(config), profile.key))
        best = max(records, key=lambda r: r["env_steps_per_s"])
        print(
            f"sweep: stage profile from {len(records)} trials written to {path}; best trial "
            f"{best['env_steps_per_s']:.1f} env steps/s at "
            + ", ".join(f"{s} {best['amounts'][s]:g}" for s in STAGES)
            + f", batch {best['batch']}"
        )
