"""Utilisation plots from a hand-made trace and hand-made samples: the series hold the expected values, the files
are PNGs, and a figure that cannot be drawn costs one line, not the run."""

from __future__ import annotations

import sys

import numpy as np

from ebrl.telemetry.plots import cpu_busy_series, gpu_series, stage_busy_series, write_plots
from ebrl.telemetry.trace import Trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 100.0  # perf_counter at the run's start; the figures count from it
CPU = [(T0 + 0.5, {0: 0.2, 1: 0.4}), (T0 + 1.0, {0: 1.0, 1: 0.0})]
GPU = [
    (T0, {0: {"util": 40.0, "mem_used": 2.0 * 2**30, "sm_util": 30.0}}),
    (T0 + 0.5, {0: {"util": 60.0, "mem_used": 1.0 * 2**30}}),
]


def ten_seconds() -> Trace:
    """Two sim cores over [T0, T0 + 10]: env0 simulates the first half, env1 never; generation twice in the first
    seconds (overlapping spans in the third); training the last 3 s."""
    trace = Trace()
    trace.add("simulate/env0", "chunk", T0, T0 + 5)
    trace.add("generate", "sample", T0 + 0.5, T0 + 1.0)
    trace.add("generate", "sample", T0 + 2.0, T0 + 2.5)
    trace.add("generate", "value", T0 + 2.25, T0 + 2.75)  # overlaps the one before: counted once
    trace.add("train", "update", T0 + 7, T0 + 10)
    return trace


def test_stage_busy_per_second_bin():
    series = stage_busy_series(ten_seconds(), T0, T0 + 10, sim_cores=2)
    np.testing.assert_allclose(series.t, np.arange(10) + 0.5)  # 10 s / 100 bins is under 1 s: 1 s bins
    np.testing.assert_allclose(series.lines["simulate"], [0.5] * 5 + [0.0] * 5)  # one env on two cores: half of them
    np.testing.assert_allclose(series.lines["generate"], [0.5, 0, 0.75, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(series.lines["train"], [0.0] * 7 + [1.0] * 3)


def test_a_long_run_gets_a_hundred_bins():
    series = stage_busy_series(Trace(), T0, T0 + 500, sim_cores=1)
    assert len(series.t) == 100 and series.t[0] == 2.5  # 5 s bins
    assert all((v == 0).all() for v in series.lines.values())


def test_cpu_busy_per_core_and_mean_in_percent():
    series = cpu_busy_series(CPU, T0)
    np.testing.assert_allclose(series.t, [0.5, 1.0])
    np.testing.assert_allclose(series.lines["core 0"], [20.0, 100.0])
    np.testing.assert_allclose(series.lines["core 1"], [40.0, 0.0])
    np.testing.assert_allclose(series.lines["mean"], [30.0, 50.0])


def test_gpu_utilisation_and_memory():
    percent, memory = gpu_series(GPU, T0)
    np.testing.assert_allclose(percent.t, [0.0, 0.5])
    assert set(percent.lines) == {"gpu0 util", "gpu0 sm_util"}  # no GPM occupancy in any sample: no line
    np.testing.assert_allclose(percent.lines["gpu0 util"], [40.0, 60.0])
    np.testing.assert_allclose(percent.lines["gpu0 sm_util"], [30.0, np.nan])  # absent in the second sample
    np.testing.assert_allclose(memory.lines["gpu0"], [2.0, 1.0])


def test_write_plots_writes_pngs(tmp_path):
    paths = write_plots(tmp_path, ten_seconds(), T0, T0 + 10, 2, CPU, GPU)
    assert [p.name for p in paths] == ["cpu_busy.png", "stage_busy.png", "gpu.png"]
    for path in paths:
        assert path.parent == tmp_path and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_no_gpu_samples_no_gpu_figure(tmp_path):
    paths = write_plots(tmp_path, ten_seconds(), T0, T0 + 10, 2, CPU, [])
    assert [p.name for p in paths] == ["cpu_busy.png", "stage_busy.png"]


def test_a_figure_that_fails_is_one_line(tmp_path, capsys):
    assert write_plots(tmp_path / "gone", ten_seconds(), T0, T0 + 10, 2, CPU) == []  # savefig: no such folder
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("cpu_busy.png not written: FileNotFoundError"), lines


def test_without_matplotlib_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert write_plots(tmp_path, ten_seconds(), T0, T0 + 10, 2, CPU) == []
    assert capsys.readouterr().err.strip() == (
        "no utilisation plots: matplotlib is not installed (pip install -r requirements.txt)"
    )
    assert list(tmp_path.iterdir()) == []


def test_simulate_counts_a_core_busy_while_any_env_waits_for_it():
    trace = Trace()
    for env in range(4):  # four envs in lockstep on two cores for the first 2 s, then one alone for 1 s
        trace.add(f"simulate/env{env}", "chunk", T0, T0 + 2)
    trace.add("simulate/env0", "chunk", T0 + 2, T0 + 3)
    series = stage_busy_series(trace, T0, T0 + 4, sim_cores=2)
    np.testing.assert_allclose(series.lines["simulate"], [1.0, 1.0, 0.5, 0.0])
