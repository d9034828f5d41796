"""A controlled foreign load beside a benchmark: busy processes at nice 0, as a user's node has (a data loader, a
second job, a compile), started and stopped around a measurement."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator, Sequence

BUSY = "while True: pass"


@contextlib.contextmanager
def foreign_load(processes: int, cores: Sequence[int] | None = None) -> Iterator[list[int]]:
    """`processes` single-threaded busy loops at nice 0 for the duration; `cores`: process i pinned to
    cores[i % len(cores)] (None: where the kernel puts them). Yields their pids."""
    def start(i: int) -> subprocess.Popen:
        def at_nice_0() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
            except PermissionError:  # (a benchmark run under nice, without the right to lower it: its own)
                pass
            if cores:
                os.sched_setaffinity(0, {cores[i % len(cores)]})
        return subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=at_nice_0, stdin=subprocess.DEVNULL)

    busy = [start(i) for i in range(processes)]
    try:
        yield [p.pid for p in busy]
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
