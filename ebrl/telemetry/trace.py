"""Busy intervals of every stage, on one clock, written as a Chrome/Perfetto trace.

Every process of a node reads `time.perf_counter()` (CLOCK_MONOTONIC on Linux), so the intervals a
simulator process, the generation loop and the trainer process report can be set side by side.
Lanes: "simulate/env<i>" (one per environment), "generate", "train". Open `trace.json` in
https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


class Trace:
    """Collects spans in memory; `busy` summarises them, `write` saves the Chrome trace."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        self.spans.append(Span(lane, name, start, end, args))

    def mark(self) -> int:
        """Where the spans added from now on begin. A span is added once it ended, so every span that ends
        after this moment lies past the mark: `busy(..., since=mark)` need not scan the whole run."""
        return len(self.spans)

    def window(self, start: float, end: float, since: int = 0) -> list[Span]:
        """The spans (added at or after `since`) that overlap [start, end], clipped to it."""
        return [Span(s.lane, s.name, max(s.start, start), min(s.end, end), s.args)
                for s in self.spans[since:] if s.end > start and s.start < end]

    def busy(self, start: float, end: float, sim_cores: int, since: int = 0) -> dict[str, float]:
        """Busy fraction of each stage over [start, end]: the union of its spans over the window's length;
        simulation as the mean occupancy of `sim_cores` cores (sum of env chunk time / (cores x window))."""
        length = max(end - start, 1e-9)
        spans = self.window(start, end, since)
        out: dict[str, float] = {}
        sim = sum(s.end - s.start for s in spans if s.stage == "simulate")
        out["simulate"] = sim / (length * max(sim_cores, 1))
        for stage in ("generate", "train"):
            out[stage] = _union(sorted((s.start, s.end) for s in spans if s.stage == stage)) / length
        return out

    def write(self, path: Path, origin: float | None = None) -> None:
        """Chrome trace events ("X", microseconds from `origin`), one thread row per lane."""
        if origin is None:
            origin = min((s.start for s in self.spans), default=0.0)
        lanes = sorted({s.lane for s in self.spans}, key=_lane_order)
        tid = {lane: i for i, lane in enumerate(lanes)}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[lane], "args": {"name": lane}} for lane in lanes
        ]
        events += [
            {"ph": "X", "name": s.name, "cat": s.stage, "pid": 0, "tid": tid[s.lane],
             "ts": (s.start - origin) * 1e6, "dur": (s.end - s.start) * 1e6, "args": s.args}
            for s in self.spans
        ]
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for a, b in intervals:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _lane_order(lane: str) -> tuple[int, int, str]:
    stage, _, rest = lane.partition("/")
    rank = {"train": 0, "generate": 1, "simulate": 2}.get(stage, 3)
    number = int(rest[3:]) if rest.startswith("env") and rest[3:].isdigit() else 0
    return rank, number, lane
