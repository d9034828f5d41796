"""Metrics: one JSON line per iteration in the run folder, and W&B when `logger=wandb`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95%


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a success rate: unlike the normal approximation it stays inside [0, 1] and does
    not collapse to a point at 0/n or n/n, which is where small evaluations of RL policies often land."""
    if n < 1:
        raise ValueError(f"n={n}: an interval needs at least one episode")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def sweep_group(hydra_cfg: Any = None) -> str | None:
    """Under a Hydra multirun (`sweep.py -m`, `run.py -m`) "<job>:<sweep folder>", so that W&B groups a sweep's
    trials together; None for a single run. `hydra_cfg`: Hydra's own config node (default: this process's, if any)."""
    from hydra.types import RunMode

    if hydra_cfg is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return f"{hydra_cfg.job.name}:{hydra_cfg.sweep.dir}"


class MetricsLog:
    """Appends to `<run>/metrics.jsonl` (so a resumed run continues the same file) and mirrors to W&B."""

    def __init__(
        self,
        run_dir: Path,
        logger_cfg: dict[str, Any],
        config: dict[str, Any],
        resume_id: str | None = None,
        step_metric: str = "env_steps",
    ):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        self.wandb_id: str | None = None
        self.step_metric = step_metric
        if logger_cfg["name"] == "wandb":
            import wandb

            mode = logger_cfg.get("mode") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self._wandb = wandb.init(
                project=logger_cfg.get("project"),
                entity=logger_cfg.get("entity"),
                group=logger_cfg.get("group") or sweep_group(),
                config=config,
                dir=str(run_dir),
                mode=mode,
                id=resume_id,
                resume="allow" if resume_id else None,
            )
            self.wandb_id = self._wandb.id
            # every metric is plotted against env steps, the x-axis embodied-RL papers use (SFT: the samples seen)
            self._wandb.define_metric(step_metric)
            self._wandb.define_metric("*", step_metric=step_metric)

    def log(self, metrics: dict[str, Any]) -> None:
        line = json.dumps(metrics) + "\n"
        try:
            self._file.write(line)
        except OSError as e:  # (a full disk: the run stops saying so; its checkpoint is on disk)
            from ebrl.errors import DiskFull, free_bytes, is_disk_full, megabytes

            if not is_disk_full(e):
                raise
            raise DiskFull(
                f"the disk is full at {self.path.parent}: {self.path.name} could not take iteration "
                f"{metrics.get('iteration', '?')}'s line ({len(line)} bytes; "
                f"{megabytes(free_bytes(self.path.parent))} free)"
            ) from e
        if self._wandb is not None:
            self._wandb.log(metrics)

    def log_images(self, paths: list[Path], env_steps: int) -> None:
        """Figures of the run (plots/<file stem>) to W&B, at `env_steps`; the files stay in the run folder."""
        if self._wandb is None or not paths:
            return
        import wandb

        self._wandb.log({self.step_metric: env_steps, **{f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}})

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run's totals (summary.json's) as the W&B run summary, and its stage timing as a table
        (time/stages: stage, seconds, share of the wall time)."""
        if self._wandb is None:
            return
        import wandb

        wall = summary["wall_s"] or float("nan")
        table = wandb.Table(
            columns=["stage", "seconds", "share of wall"],
            data=[[stage, s, s / wall] for stage, s in summary["stage_s"].items()],
        )
        self._wandb.log({"env_steps": summary["env_steps"], "time/stages": table})
        flat = {k: v for k, v in summary.items() if not isinstance(v, dict)}
        flat.update({f"{k}/{name}": x for k, d in summary.items() if isinstance(d, dict) for name, x in d.items()})
        self._wandb.summary.update({f"summary/{k}": v for k, v in flat.items()})

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
