"""What the console shows: a progress bar over iterations and the summary table at the end."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)


class ProgressBar:
    """Iterations (or, labelled "eval", episodes) done, with the latest figures beside the bar. The bar animates
    where the console is a terminal; where stdout is not (a job log under SLURM, `nohup`, `> log`, `| tee`), each
    iteration also prints one plain line there, and a line every `heartbeat_s` while an iteration runs longer."""

    def __init__(
        self,
        total: int,
        done: int = 0,
        enabled: bool = True,
        label: str = "train",
        heartbeat_s: float = 60.0,
        stream: Any = None,
    ) -> None:
        self._progress = None
        self._log: BatchLog | None = None
        if not enabled:
            return
        stream = sys.stdout if stream is None else stream
        if not _is_terminal(stream):
            self._log = BatchLog(label, total, done, heartbeat_s, stream)
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
        if self._log is not None:
            line = f"env steps {int(metrics.get('env_steps', 0)):,}  {metrics['perf/env_steps_per_s']:.1f} env steps/s"
            if "env/return" in metrics:
                line += f"  return {metrics['env/return']:.3f}  success {metrics['env/success_rate']:.1%}"
            self._log.done_one(line)
        self.advance(info, log=False)

    def advance(self, info: str, log: bool = True) -> None:
        """One more done, with `info` beside the bar (and on the batch log's line)."""
        if log and self._log is not None:
            self._log.done_one(info)
        if self._progress is not None:
            self._progress.update(self._task, advance=1, info=info)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (a closed or a file-like stream without a terminal)
        return False


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class BatchLog:
    """Plain progress lines for a log that is not a terminal: one per iteration done (`label k/total`, the
    figures, elapsed and ETA), and one every `heartbeat_s` while the next runs longer than that."""

    def __init__(self, label: str, total: int, done: int, heartbeat_s: float, stream: Any) -> None:
        self.label, self.total, self.done, self.first = label, total, done, done
        self.stream, self.heartbeat_s = stream, heartbeat_s
        self.start = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ebrl-batch-log", daemon=True)
        self._thread.start()

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)
            self.last = time.monotonic()

    def done_one(self, figures: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        made = self.done - self.first
        eta = elapsed / made * (self.total - self.done) if made else float("nan")
        self._print(
            f"{self.label} {self.done}/{self.total}  {figures}  elapsed {_clock(elapsed)}  "
            f"ETA {_clock(eta) if eta == eta else '?'}"
        )

    def _beat(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s, 5.0)):
            now = time.monotonic()
            if now - self.last >= self.heartbeat_s and self.done < self.total:
                self._print(
                    f"{self.label} {self.done}/{self.total}  the next still running "
                    f"({_clock(now - self.last)} since the last line)  elapsed {_clock(now - self.start)}"
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


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
            table.add_row(
                f"success rate, {name} {its} ({success.episodes} episodes, 95% CI)",
                f"{success.rate:.1%} ({success.low:.0%} to {success.high:.0%})",
            )
    if summary.success_end is None:
        table.add_row("success rate", "n/a (no episode ended)")
    table.add_row("episode return (last iteration)", _fmt(summary.mean_return, ".3f"))
    for stage, seconds in summary.stage_s.items():  # stages may overlap: each as a share of the wall time
        table.add_row(f"time in {stage}", f"{seconds:.1f} s ({seconds / max(summary.wall_s, 1e-9):.0%} of wall)")
    sim_ms = summary.sim_cpu_ms_per_step
    table.add_row("simulation, CPU per env step (steady iterations)", "n/a" if sim_ms != sim_ms else f"{sim_ms:.2f} ms")
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
    """The table a user reads at the end of `mode=eval` (an ebrl.runs.evaluation.EvalSummary)."""
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
        table.add_row(
            f"  {task} ({t['episodes']} episodes)",
            f"{t['success_rate']:.1%} ({lo:.1%} to {hi:.1%}), return {_fmt(t['mean_return'], '.3f')}",
        )
    table.add_row("episode return (mean)", _fmt(summary.mean_return, ".3f"))
    table.add_row("episode length (mean)", _fmt(summary.mean_length, ".1f"))
    table.add_row("videos", f"{len(summary.videos)} in videos/" if summary.videos else "none")
    table.add_row("wall time", f"{summary.wall_s:.1f} s")
    table.add_row("run folder", str(run_dir))
    Console().print(table)
