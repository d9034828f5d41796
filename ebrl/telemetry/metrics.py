"""Metrics: one JSON line per iteration in the run folder, and W&B when `logger=wandb`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends to `<run>/metrics.jsonl` (so a resumed run continues the same file) and mirrors to W&B."""

    def __init__(self, run_dir: Path, logger_cfg: dict[str, Any], config: dict[str, Any], resume_id: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._wandb = None
        self.wandb_id: str | None = None
        if logger_cfg["name"] == "wandb":
            import wandb

            mode = logger_cfg.get("mode") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self._wandb = wandb.init(
                project=logger_cfg.get("project"),
                entity=logger_cfg.get("entity"),
                group=logger_cfg.get("group"),
                config=config,
                dir=str(run_dir),
                mode=mode,
                id=resume_id,
                resume="allow" if resume_id else None,
            )
            self.wandb_id = self._wandb.id
            # every metric is plotted against env steps, the x-axis embodied-RL papers use
            self._wandb.define_metric("env_steps")
            self._wandb.define_metric("*", step_metric="env_steps")

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics)

    def log_images(self, paths: list[Path], env_steps: int) -> None:
        """Figures of the run (plots/<file stem>) to W&B, at `env_steps`; the files stay in the run folder."""
        if self._wandb is None or not paths:
            return
        import wandb

        self._wandb.log({"env_steps": env_steps, **{f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}})

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
