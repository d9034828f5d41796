"""Busy intervals of every stage, on one clock, written as a Chrome/Perfetto trace.

Every process of a node reads `time.perf_counter()` (CLOCK_MONOTONIC on Linux), so the intervals a
simulator process, the generation loop and the trainer process report can be set side by side.
Lanes: "simulate/env<i>" (one per environment), "generate", "train". Open `trace.json` in
https://ui.perfetto.dev or chrome://tracing.

A run adds one span per env per chunk for as long as it runs, so nothing keeps them all: `stream_to` writes each
span to the file as it is added, the spans themselves are kept only since the iteration before the last `mark`
(for the per-iteration figures), and the whole run's figures (`busy` without `since`, the plots) come from a
`Timeline` of each stage's seconds in fixed bins, which merges neighbours once it holds MAX_BINS of them.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

STAGES = ("simulate", "generate", "train")
BIN_S = 0.05  # the timeline's first bin width; below the plots' (>= 1 s) and the chunks' resolution
MAX_BINS = 1 << 16  # then bins pair up (width doubles): about 55 min at 0.05 s, 6 MB of floats at most


@dataclass
class Span:
    lane: str  # "simulate/env3", "generate", "train"
    name: str  # "chunk", "sample", "update", "publish"
    start: float  # perf_counter seconds
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return self.lane.split("/", 1)[0]


class Timeline:
    """Each stage's busy seconds per fixed-width bin, from the first span's start on (bins are added either side
    as spans need them). A bin's simulate seconds add up every env's; generate's and train's are capped at the bin's
    width when read, as the union of their spans."""

    def __init__(self, width: float = BIN_S) -> None:
        self.width = width
        self.t0: float | None = None
        self.seconds = np.zeros((len(STAGES), 0))

    def add(self, stage: str, start: float, end: float) -> None:
        if stage not in STAGES or end <= start:
            return
        if self.t0 is None:
            self.t0 = start
        first, last = self._index(start), self._index(end)
        if first < 0:  # a span that began before the first one seen: bins in front
            self.seconds = np.concatenate([np.zeros((len(STAGES), -math.floor(first))), self.seconds], 1)
            self.t0 -= -math.floor(first) * self.width
            first, last = self._index(start), self._index(end)
        if math.ceil(last) > self.seconds.shape[1]:
            grow = max(math.ceil(last) - self.seconds.shape[1], self.seconds.shape[1] // 2, 64)
            self.seconds = np.concatenate([self.seconds, np.zeros((len(STAGES), grow))], 1)
        row, lo, hi = self.seconds[STAGES.index(stage)], math.floor(first), math.ceil(last)
        # the first and last bins get the part of them the span covers, the ones between a whole width each (one
        # slice: a span as long as the envs sharing a core make it costs no Python per bin)
        for k in {lo, hi - 1}:
            row[k] += (min(last, k + 1) - max(first, k)) * self.width
        row[lo + 1 : hi - 1] += self.width
        while self.seconds.shape[1] > MAX_BINS:
            self._coarsen()

    def occupied(self, start: float, end: float, sim_cores: int) -> dict[str, float]:
        """Over [start, end]: simulate's seconds summed over the envs, generate's and train's busy seconds, and
        simulate's core-seconds min(envs in a chunk, cores) (each bin's mean)."""
        out = {"simulate": 0.0, "generate": 0.0, "train": 0.0, "cores": 0.0}
        if self.t0 is None or end <= start:
            return out
        lo, hi = max(self._index(start), 0.0), min(self._index(end), float(self.seconds.shape[1]))
        for k in range(math.floor(lo), math.ceil(hi)):
            share = min(hi, k + 1) - max(lo, k)  # of bin k inside the window
            if share <= 0:
                continue
            sim, gen, train = self.seconds[:, k]
            out["simulate"] += share * sim
            out["generate"] += share * min(gen, self.width)
            out["train"] += share * min(train, self.width)
            out["cores"] += share * min(sim, sim_cores * self.width)
        return out

    def _index(self, t: float) -> float:
        """Bin position of time t; within 1e-9 of a bin edge it is the edge (spans at round times stay in theirs)."""
        x = (t - self.t0) / self.width
        return float(round(x)) if abs(x - round(x)) < 1e-9 else x

    def _coarsen(self) -> None:
        n = self.seconds.shape[1]
        if n % 2:
            self.seconds = np.concatenate([self.seconds, np.zeros((len(STAGES), 1))], 1)
        self.seconds = self.seconds[:, 0::2] + self.seconds[:, 1::2]
        self.width *= 2


class Trace:
    """Spans of every stage: streamed to trace.json (`stream_to`) or kept for `write`, summarised by `busy`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """clock: what the spans' times are read from (a run's is perf_counter, one clock for every process; the
        at-scale benchmark's is virtual)."""
        self.clock = clock
        self.origin = clock()  # trace.json's time 0 when streamed (made before any stage runs)
        self.spans: list[Span] = []  # since the mark before the last one (all of them when nothing marks)
        self.base = 0  # the index of spans[0] among every span added
        self.last_mark = 0
        self.timeline = Timeline()
        self.lanes: dict[str, int] = {}  # lane -> tid
        self.file: IO[str] | None = None
        self.gave_up = False  # the streamed file could not be written: no trace this run
        self.lock = threading.Lock()  # (the pipelined schedule adds from its dispatcher thread too)

    def add(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        span = Span(lane, name, start, end, args)
        with self.lock:
            self.spans.append(span)
            self.timeline.add(span.stage, start, end)
            if self.file is not None:
                try:
                    self._stream(span)
                except OSError as e:
                    self._give_up(e)

    def mark(self) -> int:
        """Where the spans added from now on begin. A span is added once it ended, so every span that ends
        after this moment lies past the mark: `busy(..., since=mark)` need not scan the whole run. Spans from
        before the previous mark are let go."""
        with self.lock:
            drop = self.last_mark - self.base
            if drop > 0:
                del self.spans[:drop]
                self.base = self.last_mark
            self.last_mark = self.base + len(self.spans)
            return self.last_mark

    def window(self, start: float, end: float, since: int = 0) -> list[Span]:
        """The spans (added at or after `since`, which must not lie before the previous mark) that overlap
        [start, end], clipped to it."""
        if since < self.base:
            raise ValueError(f"spans before index {self.base} were let go (since={since}); use the timeline")
        return [
            Span(s.lane, s.name, max(s.start, start), min(s.end, end), s.args)
            for s in self.spans[since - self.base :]
            if s.end > start and s.start < end
        ]

    def busy(self, start: float, end: float, sim_cores: int, since: int | None = None) -> dict[str, float]:
        """Busy fraction of each stage over [start, end]: the union of its spans over the window's length;
        simulation as the mean occupancy of `sim_cores` cores (sum of env chunk time / (cores x window)).
        With `since` from the spans themselves, else from the timeline (to its bins' resolution)."""
        length = max(end - start, 1e-9)
        if since is None:
            seconds = self.timeline.occupied(start, end, sim_cores)
            return {
                "simulate": seconds["simulate"] / (length * max(sim_cores, 1)),
                "generate": seconds["generate"] / length,
                "train": seconds["train"] / length,
            }
        spans = self.window(start, end, since)
        out: dict[str, float] = {}
        sim = sum(s.end - s.start for s in spans if s.stage == "simulate")
        out["simulate"] = sim / (length * max(sim_cores, 1))
        for stage in ("generate", "train"):
            out[stage] = _union(sorted((s.start, s.end) for s in spans if s.stage == stage)) / length
        return out

    def seconds(self, start: float, end: float, since: int) -> dict[str, float]:
        """Over [start, end], from the spans added at or after `since`: the seconds each stage ran (the union of its
        spans; simulate: of every env's), and `train_alone`, those in which training ran and neither simulation nor
        generation did (the rollout waited for it)."""
        spans = self.window(start, end, since)
        merged = {stage: _merge(sorted((s.start, s.end) for s in spans if s.stage == stage)) for stage in STAGES}
        out = {stage: sum(b - a for a, b in intervals) for stage, intervals in merged.items()}
        rollout = _merge(sorted(merged["simulate"] + merged["generate"]))
        out["train_alone"] = out["train"] - _overlap(merged["train"], rollout)
        return out

    def stream_to(self, path: Path) -> None:
        """Write every span to `path` from now on (those kept so far first), as a Chrome trace's JSON array,
        microseconds from `origin`; `write` closes it."""
        with self.lock:
            self.file = path.open("w")
            self.file.write("[\n")
            for span in self.spans:
                self._stream(span)

    def write(self, path: Path, origin: float | None = None) -> None:
        """Close the streamed trace (its lanes' names go last), or write the kept spans to `path` ("X" events,
        microseconds from `origin`, by default the first span's start), one thread row per lane."""
        with self.lock:
            if self.file is not None:
                names = [
                    json.dumps(_name_event(lane, self.lanes[lane])) for lane in sorted(self.lanes, key=_lane_order)
                ]
                try:
                    self.file.write(",\n".join(names) + "\n]\n")  # (every span's line ended with a comma)
                    self.file.close()
                except OSError as e:
                    self._give_up(e)
                self.file = None
                return
            if self.gave_up:
                return
        if origin is None:
            origin = min((s.start for s in self.spans), default=0.0)
        lanes = sorted({s.lane for s in self.spans}, key=_lane_order)
        tid = {lane: i for i, lane in enumerate(lanes)}
        events = [_name_event(lane, tid[lane]) for lane in lanes]
        events += [_span_event(s, tid[s.lane], origin) for s in self.spans]
        path.write_text(json.dumps(events))

    def _give_up(self, error: OSError) -> None:
        """A streamed trace that cannot be written (a full disk): one line, and the run goes on without it."""
        from ebrl.telemetry.report import console

        name = getattr(self.file, "name", "trace.json")
        try:
            self.file.close()
        except OSError:
            pass
        self.file, self.gave_up = None, True
        console.print(
            f"warning: {name} could not be written ({error.strerror or error}); the run goes on without "
            "its trace (the metrics and checkpoints are apart)",
            soft_wrap=True,
        )

    def _stream(self, span: Span) -> None:
        tid = self.lanes.setdefault(span.lane, len(self.lanes))
        self.file.write(json.dumps(_span_event(span, tid, self.origin)) + ",\n")


def read_spans(path: Path) -> list[Span]:
    """The spans of a trace.json (times in seconds from its origin), lanes by name."""
    events = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return [
        Span(names[e["tid"]], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e.get("args", {}))
        for e in events
        if e["ph"] == "X"
    ]


def _span_event(s: Span, tid: int, origin: float) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": s.name,
        "cat": s.stage,
        "pid": 0,
        "tid": tid,
        "ts": (s.start - origin) * 1e6,
        "dur": (s.end - s.start) * 1e6,
        "args": s.args,
    }


def _name_event(lane: str, tid: int) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals, those that overlap joined."""
    out: list[tuple[float, float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merge(intervals))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length two merged interval lists have in common."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _lane_order(lane: str) -> tuple[int, int, str]:
    stage, _, rest = lane.partition("/")
    rank = {"train": 0, "generate": 1, "simulate": 2}.get(stage, 3)
    number = int(rest[3:]) if rest.startswith("env") and rest[3:].isdigit() else 0
    return rank, number, lane
