"""What the console shows: a progress bar over iterations and the summary table at the end."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)


class ProgressBar:
    """Iterations (or, labelled "eval", episodes) done, with the latest figures beside the bar."""

    def __init__(self, total: int, done: int = 0, enabled: bool = True, label: str = "train") -> None:
        self._progress = None
        if not enabled:
            return
        self._progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=total, completed=done, info="")

    def update(self, metrics: dict[str, Any]) -> None:
        """One training iteration done: its throughput, return and success rate beside the bar."""
        info = f"{metrics['perf/env_steps_per_s']:.0f} steps/s"
        if "env/return" in metrics:
            info += f"  return {metrics['env/return']:.2f}  success {metrics['env/success_rate']:.0%}"
        self.advance(info)

    def advance(self, info: str) -> None:
        """One more done, with `info` beside the bar."""
        if self._progress is not None:
            self._progress.update(self._task, advance=1, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_summary(summary: Any, run_dir: Path) -> None:
    """The table a user reads at the end of a run."""
    table = Table(title="EBRL run summary", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("env steps", f"{summary.env_steps:,}")
    table.add_row("wall time", f"{summary.wall_s:.1f} s")
    table.add_row("env steps/s (end to end, after warm-up)", _fmt(summary.rollout_steps_per_s, ".1f"))
    for name, success in (("first", summary.success_start), ("last", summary.success_end)):
        if success is not None:
            its = "iteration" if success.iterations == 1 else f"{success.iterations} iterations"
            table.add_row(f"success rate, {name} {its} ({success.episodes} episodes, 95% CI)",
                          f"{success.rate:.1%} ({success.low:.0%} to {success.high:.0%})")
    if summary.success_end is None:
        table.add_row("success rate", "n/a (no episode ended)")
    table.add_row("episode return (last iteration)", _fmt(summary.mean_return, ".3f"))
    for stage, seconds in summary.stage_s.items():  # stages may overlap: each as a share of the wall time
        table.add_row(f"time in {stage}", f"{seconds:.1f} s ({seconds / max(summary.wall_s, 1e-9):.0%} of wall)")
    table.add_row("CPU busy (mean over cores)", _fmt(summary.cpu_busy, ".0%"))
    table.add_row("run folder", str(run_dir))
    Console().print(table)


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """A two-column table (metric, value) on stdout, as the run summaries are."""
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def print_eval(summary: Any, run_dir: Path) -> None:
    """The table a user reads at the end of `mode=eval` (an ebrl.runtime.evaluation.EvalSummary)."""
    low, high = summary.success_ci95
    table = Table(title="EBRL evaluation", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("checkpoint", summary.checkpoint)
    table.add_row("trained for", f"{summary.iteration} iterations, {summary.env_steps:,} env steps")
    table.add_row("episodes", f"{summary.episodes}")
    table.add_row("success rate (95% Wilson CI)", f"{summary.success_rate:.1%} ({low:.1%} to {high:.1%})")
    for task, t in getattr(summary, "per_task", {}).items():
        lo, hi = t["success_ci95"]
        table.add_row(f"  {task} ({t['episodes']} episodes)", f"{t['success_rate']:.1%} ({lo:.1%} to {hi:.1%}), "
                      f"return {_fmt(t['mean_return'], '.3f')}")
    table.add_row("episode return (mean)", _fmt(summary.mean_return, ".3f"))
    table.add_row("episode length (mean)", _fmt(summary.mean_length, ".1f"))
    table.add_row("videos", f"{len(summary.videos)} in videos/" if summary.videos else "none")
    table.add_row("wall time", f"{summary.wall_s:.1f} s")
    table.add_row("run folder", str(run_dir))
    Console().print(table)
