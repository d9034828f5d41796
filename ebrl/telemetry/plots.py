"""Utilisation plots written into the run folder when a run ends: where the cores and the stages spent the run.

cpu_busy.png (busy % of each core), stage_busy.png (busy fraction of simulate / generate / train, by
`Trace.busy`'s convention) and, where GPU samples exist, gpu.png. Every x-axis is seconds since the run
started on the one `time.perf_counter()` clock that the trace and the samplers share, so the figures line up.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ebrl.telemetry.report import console
from ebrl.telemetry.trace import Trace

STAGE_BINS = 100  # time bins over the run in stage_busy.png ...
MIN_BIN_S = 1.0  # ... none shorter than this: a bin must hold a few chunks to say how busy a stage was
LEGEND_CORES = 16  # more cores than this: one legend entry for them all (a 100-core legend hides the plot)


@dataclass
class Series:
    """One panel's data: bin or sample times (s since the run started) and one y array per legend entry."""

    t: np.ndarray
    lines: dict[str, np.ndarray]


def cpu_busy_series(samples: list[tuple[float, dict[int, float]]], origin: float) -> Series:
    """CpuSampler samples as busy % per core ("core <i>") and over the cores ("mean"); each sample covers the
    interval that ends at its time."""
    cores = sorted(samples[0][1]) if samples else []
    t = np.array([stamp - origin for stamp, _ in samples])
    lines = {f"core {core}": np.array([100.0 * reading[core] for _, reading in samples]) for core in cores}
    if lines:
        lines["mean"] = np.mean(list(lines.values()), axis=0)
    return Series(t, lines)


def stage_busy_series(trace: Trace, origin: float, end: float, sim_cores: int) -> Series:
    """Consecutive bins of the run (STAGE_BINS of them, none under MIN_BIN_S): generate and train as the share of
    each bin they ran (`Trace.busy`), simulate as the share of the `sim_cores` simulation cores that had an env in
    a chunk to run, min(envs in a chunk, cores) / cores over time. Unlike Trace.busy's mean occupancy this stays
    within [0, 1] when more envs than cores step at once (lockstep schedules), and reads 1 when every sim core has
    work whichever schedule hands the cores out."""
    length = max(end - origin, 0.0)
    bins = max(1, int(length / max(MIN_BIN_S, length / STAGE_BINS) + 1e-9))  # equal bins, each >= MIN_BIN_S
    edges = np.linspace(origin, end, bins + 1)
    busy = [trace.busy(a, b, sim_cores) for a, b in zip(edges[:-1], edges[1:])]
    lines = {s: np.array([b[s] for b in busy]) for s in ("generate", "train")}
    lines = {"simulate": _core_occupancy(trace, edges, sim_cores), **lines}
    return Series(0.5 * (edges[:-1] + edges[1:]) - origin, lines)


def _core_occupancy(trace: Trace, edges: np.ndarray, cores: int) -> np.ndarray:
    """Per bin of `edges`, the mean over time of min(simulate spans open, cores) / cores (the trace's timeline
    takes the min per bin of its own, 0.05 s at first)."""
    seconds = [trace.timeline.occupied(a, b, cores)["cores"] for a, b in zip(edges[:-1], edges[1:])]
    return np.array(seconds) / (np.diff(edges) * max(cores, 1))


def gpu_series(samples: list[tuple[float, dict[int, dict[str, float]]]], origin: float) -> tuple[Series, Series]:
    """GpuMonitor samples as (utilisation %: util and, where GPM gave them, SM util and occupancy per GPU;
    memory used, GB per GPU). A figure a GPU reported only in some samples is NaN in the others."""
    t = np.array([stamp - origin for stamp, _ in samples])
    percent: dict[str, np.ndarray] = {}
    memory: dict[str, np.ndarray] = {}
    for gpu in sorted(samples[0][1]) if samples else []:
        for name in ("util", "sm_util", "sm_occupancy"):
            values = np.array([reading[gpu].get(name, np.nan) for _, reading in samples], dtype=float)
            if not np.isnan(values).all():
                percent[f"gpu{gpu} {name}"] = values
        memory[f"gpu{gpu}"] = np.array([reading[gpu]["mem_used"] / 2**30 for _, reading in samples])
    return Series(t, percent), Series(t, memory)


def _draw(
    ax: Any, series: Series, ylabel: str, title: str, where: str, styles: dict[str, dict[str, Any]] | None = None
) -> None:
    """Every line of `series` on `ax` as steps (`where`: "pre" for a sample, the mean over the interval that ends at
    its time; "mid" for a bin around its centre), with `styles[label]` where given; labelled axes, title, legend."""
    for label, values in series.lines.items():
        ax.step(series.t, values, where=where, **{"label": label, "linewidth": 1.2, **(styles or {}).get(label, {})})
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series.lines:  # beside the axes: utilisation often sits at the top, where a legend inside would cover it
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def plot_cpu_busy(series: Series, path: Path) -> None:
    """cpu_busy.png: busy % of each core of the run over time."""
    import matplotlib.pyplot as plt

    cores = [label for label in series.lines if label != "mean"]
    styles: dict[str, dict[str, Any]] = {"mean": {"color": "black", "linewidth": 2.5, "alpha": 0.4, "zorder": 1}}
    for i, label in enumerate(cores):
        styles[label] = {"linewidth": 0.8, "alpha": 0.7}
        if len(cores) > LEGEND_CORES:
            styles[label]["label"] = "each core" if i == 0 else "_nolegend_"
    fig, ax = plt.subplots(figsize=(10, 4))
    _draw(ax, series, "busy (%)", f"CPU busy per core ({len(cores)} cores)", "pre", styles=styles)
    ax.set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_stage_busy(series: Series, path: Path, sim_cores: int) -> None:
    """stage_busy.png: busy fraction of each stage over time."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    width = series.t[1] - series.t[0] if len(series.t) > 1 else MIN_BIN_S
    styles = {"simulate": {"label": f"simulate (share of the {sim_cores} sim cores with an env to run)"}}
    _draw(ax, series, "busy fraction", f"Stage busy over time ({width:.1f} s bins)", "mid", styles=styles)
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gpu(series: tuple[Series, Series], path: Path) -> None:
    """gpu.png: device utilisation (top) and memory used (bottom) of each GPU over time."""
    import matplotlib.pyplot as plt

    percent, memory = series
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    _draw(top, percent, "%", "GPU utilisation (NVML; SM figures where GPM is supported)", "pre")
    top.set_ylim(0, 105)
    top.set_xlabel("")  # the shared axis is labelled below
    _draw(bottom, memory, "memory used (GB)", "GPU memory", "pre")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_lines(
    path: Path,
    lines: dict[str, tuple[np.ndarray, np.ndarray]],
    xlabel: str,
    ylabel: str,
    title: str,
    log_y: bool = False,
    ylim: tuple[float, float] | None = None,
) -> Path | None:
    """A figure of (x, y) lines (a loss curve, success against env steps), written to `path`; None and one console
    line when it cannot be drawn."""
    try:
        with warnings.catch_warnings():  # (see write_plots)
            warnings.filterwarnings("ignore", message="The value of the smallest subnormal")
            _draw_lines(path, lines, xlabel, ylabel, title, log_y, ylim)
    except Exception as e:  # noqa: BLE001  (a figure is a by-product)
        console.print(
            f"{path.name} not written: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
            soft_wrap=True,
            markup=False,
        )
        return None
    return path


def _draw_lines(
    path: Path,
    lines: dict[str, tuple[np.ndarray, np.ndarray]],
    xlabel: str,
    ylabel: str,
    title: str,
    log_y: bool,
    ylim: tuple[float, float] | None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for label, (x, y) in lines.items():
        ax.plot(x, y, label=label, linewidth=1.5, marker="o" if len(x) < 40 else None, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(
    run_dir: Path,
    trace: Trace,
    origin: float,
    end: float,
    sim_cores: int,
    cpu_samples: list[tuple[float, dict[int, float]]],
    gpu_samples: list[tuple[float, dict[int, dict[str, float]]]] | None = None,
) -> list[Path]:
    """Write the figures this run has data for into `run_dir` and return their paths. A figure that fails (or
    matplotlib missing) costs one console line, never the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display
    except ImportError:
        console.print(
            "no utilisation plots: matplotlib is not installed (pip install -r requirements.txt)", soft_wrap=True
        )
        return []
    figures: list[tuple[str, Callable[[Path], None]]] = [
        ("cpu_busy.png", lambda p: plot_cpu_busy(cpu_busy_series(cpu_samples, origin), p)),
        ("stage_busy.png", lambda p: plot_stage_busy(stage_busy_series(trace, origin, end, sim_cores), p, sim_cores)),
    ]
    if gpu_samples:
        figures.append(("gpu.png", lambda p: plot_gpu(gpu_series(gpu_samples, origin), p)))
    written = []
    for name, draw in figures:
        path = run_dir / name
        try:
            with warnings.catch_warnings():
                # torch.set_flush_denormal (experiment.py) makes numpy's finfo, which matplotlib asks for, find no
                # subnormal floats and warn; nothing here depends on them
                warnings.filterwarnings("ignore", message="The value of the smallest subnormal")
                draw(path)
        except Exception as e:  # noqa: BLE001  (a plot is a by-product; the run's results are already saved)
            reason = " ".join(str(e).split())[:200]
            console.print(f"{name} not written: {type(e).__name__}: {reason}", soft_wrap=True, markup=False)
            continue
        written.append(path)
    return written
