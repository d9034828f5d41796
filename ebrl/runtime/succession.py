"""Make before break: a stage's serving process and the successor started to take its place.

An MPS share (and a memory cap) is read when a process's CUDA starts, so a stage's new share is a new process: it
starts in the environment of the moment (the placement sets it, `Placement.spawn_env`) while the old one works on,
and takes over once it said it is ready. Generation and the trainer both hand over this way; what crosses at the
hand-over is theirs (generation: nothing, it maps the published weights; the trainer: its model and Adam state,
between two updates).
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from ebrl.errors import StageFailed
from ebrl.runtime.messages import Ready
from ebrl.runtime.piped import PipedProcess

P = TypeVar("P", bound=PipedProcess)


class Succession(Generic[P]):
    """The serving process (`current`) and a successor (`successor`) started by `respawn`; `switch` makes the ready
    successor serve and calls `on_switch(old_pid, new_pid)`, where the placement moves the stage's lease and CPU
    accounting to it. `start(successor)` starts a process without waiting for it; the first one is waited for."""

    def __init__(
        self,
        start: Callable[[bool], P],
        start_timeout: float = 600.0,
        on_switch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.start, self.start_timeout, self.on_switch = start, start_timeout, on_switch
        self.current: P = start(False)
        self._ready(self.current, start_timeout)
        self.successor: P | None = None
        self.retired: list[P] = []  # stopped predecessors whose pipes another thread may still hold (closed at close)
        self.respawns = 0  # successors started

    def respawn(self) -> None:
        """Start a successor in this process's environment of the moment; one still starting is replaced."""
        if self.successor is not None:
            self.successor.close()
        self.respawns += 1
        self.successor = self.start(True)

    def successor_ready(self, timeout: float = 0.0) -> bool:
        """A started successor said it is ready (waiting up to `timeout`); a successor that failed to start raises
        its stage's error."""
        successor = self.successor
        if successor is None or (timeout == 0 and not successor.results.poll(0)):  # (one that died reads as EOF)
            return False
        try:
            self._ready(successor, timeout)
        except StageFailed:
            self.successor = None
            raise
        return True

    def switch(self) -> P:
        """The ready successor serves from now on; returns the process it replaced, still running (the caller stops
        it)."""
        old, self.current, self.successor = self.current, self.successor, None
        if self.on_switch is not None:
            self.on_switch(old.pid, self.current.pid)
        return old

    def close(self) -> None:
        for process in (self.successor, *self.retired, self.current):
            if process is not None:
                process.close()
        self.successor = None

    @staticmethod
    def _ready(process: P, timeout: float) -> None:
        try:
            process.expect(Ready, timeout)
        except StageFailed:
            process.close()
            raise
