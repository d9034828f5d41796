"""The trace of a long run: streamed to trace.json, bounded in memory, its whole-run figures from the timeline."""

from __future__ import annotations

import json
import random

import pytest

from ebrl.telemetry.trace import MAX_BINS, Trace, _union, read_spans


def an_iteration(trace: Trace, t: float, envs: int = 4) -> float:
    """One iteration's spans from time t: a chunk per env (overlapping), a generation batch, an update."""
    for env in range(envs):
        trace.add(f"simulate/env{env}", "chunk", t + 0.01 * env, t + 0.3 + 0.01 * env, steps=5)
    trace.add("generate", "sample", t + 0.32, t + 0.4, groups=[0])
    trace.add("train", "update", t + 0.4, t + 0.55, iteration=1)
    return t + 0.6


def test_a_long_run_streams_its_spans_and_keeps_two_iterations_of_them(tmp_path):
    trace = Trace()
    trace.stream_to(tmp_path / "trace.json")
    t, kept = trace.origin, []
    for _ in range(300):
        mark = trace.mark()
        start = t
        t = an_iteration(trace, t)
        assert trace.busy(start, t, 2, since=mark)["train"] == pytest.approx(0.15 / 0.6)  # this iteration's spans
        kept.append(len(trace.spans))
    assert max(kept) <= 2 * 6  # two iterations' spans, whatever the run's length
    with pytest.raises(ValueError, match="were let go"):
        trace.window(trace.origin, t, since=0)
    trace.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())  # what ui.perfetto.dev opens
    assert sum(e["ph"] == "X" for e in events) == 300 * 6 and sum(e["ph"] == "M" for e in events) == 6
    spans = read_spans(tmp_path / "trace.json")
    assert spans[0].lane == "simulate/env0" and spans[0].start == pytest.approx(0.0) and spans[0].args == {"steps": 5}
    # the whole run's figures, from the timeline: as the spans give them
    busy = trace.busy(trace.origin, t, sim_cores=2)
    assert busy["simulate"] == pytest.approx(4 * 0.3 / (0.6 * 2)) and busy["generate"] == pytest.approx(0.08 / 0.6)
    assert busy["train"] == pytest.approx(0.15 / 0.6)


def test_the_timeline_gives_the_spans_figures_and_stays_within_its_bins():
    rng = random.Random(0)
    trace, t, gen = Trace(), 1000.0, []
    for _ in range(4000):  # 4000 chunks of two envs, generation between them: 5 h 30 min, past MAX_BINS bins
        length = rng.uniform(0.5, 5.0)
        for env in range(2):
            trace.add(f"simulate/env{env}", "chunk", t, t + length * (0.5 + 0.5 * env))
        gen.append((t + length, t + length + 0.2))
        trace.add("generate", "sample", *gen[-1])
        t += length + 0.3
    assert trace.timeline.seconds.shape[1] <= MAX_BINS and trace.timeline.width > 0.05
    sims = [s for s in trace.spans if s.stage == "simulate"]
    busy = trace.busy(1000.0, t, sim_cores=2)
    # to a bin at the window's edges (a bin partly inside counts its share of its seconds): 0.4 s here
    tol = 2 * trace.timeline.width / (t - 1000.0)
    assert busy["simulate"] == pytest.approx(sum(s.end - s.start for s in sims) / (2 * (t - 1000.0)), abs=tol)
    assert busy["generate"] == pytest.approx(_union(gen) / (t - 1000.0), abs=tol)
    assert busy == pytest.approx(trace.busy(1000.0, t, sim_cores=2, since=0), abs=tol)  # (nothing marked yet)
