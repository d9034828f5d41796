"""Where the CPU went: each core's busy fraction (`CpuMonitor`) and each group of processes' CPU share
(`ProcessCpu`). Each stage's own time comes from the trace (ebrl/telemetry/trace.py), on one clock for every process."""

from __future__ import annotations

import time

import psutil


class CpuMonitor:
    """Busy fraction of the given cores between two calls to `read` (from /proc via psutil)."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores
        self._last = psutil.cpu_times(percpu=True)

    def per_core(self) -> list[float]:
        """Busy fraction of each core (in `cores` order) since the previous call."""
        now = psutil.cpu_times(percpu=True)
        busy = []
        for core in self.cores:
            a, b = self._last[core], now[core]
            total = sum(b) - sum(a)
            idle = (b.idle + getattr(b, "iowait", 0.0)) - (a.idle + getattr(a, "iowait", 0.0))
            busy.append(0.0 if total <= 0 else 1.0 - idle / total)
        self._last = now
        return busy

    def read(self) -> dict[str, float]:
        busy = self.per_core()
        out = {"perf/cpu_busy": sum(busy) / max(len(busy), 1)}
        out.update({f"perf/cpu{core}_busy": b for core, b in zip(self.cores, busy)})
        return out


def busy_cores(cores: list[int], seconds: float) -> float:
    """The given cores' busy time over the next `seconds`, in cores, this process sleeping meanwhile: before a run
    starts anything, the load other processes put on its cores."""
    monitor = CpuMonitor(cores)
    time.sleep(seconds)
    return sum(monitor.per_core())


class ProcessCpu:
    """CPU seconds (user + system) each group of processes used between two calls to `read`, as a
    share of the cores: where the machine's CPU went, whatever the schedule overlapped. A process
    that ended counts what it used up to the last read; one added later counts from its `add`."""

    def __init__(self, groups: dict[str, list[int]], cores: int) -> None:
        self.procs = {name: [psutil.Process(pid) for pid in pids] for name, pids in groups.items()}
        self.cores = cores
        self.foreign = 0.0  # cores other processes kept busy in the last iteration (Placement.measured)
        self._last = self._times()  # per pid
        self._t = time.perf_counter()
        self.wall = 0.0  # the seconds the last `shares` covered

    def add(self, name: str, pid: int) -> None:
        """Count `pid` in group `name` from now on (a respawned worker)."""
        proc = psutil.Process(pid)
        self.procs.setdefault(name, []).append(proc)
        self._last.update(self._times([proc]))

    def _times(self, procs: list[psutil.Process] | None = None) -> dict[int, float]:
        out = {}
        for p in procs if procs is not None else [p for group in self.procs.values() for p in group]:
            try:
                out[p.pid] = sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return out

    def shares(self) -> dict[str, float]:
        """Each group's CPU seconds since the last call, over (cores x wall): {group: share}."""
        now, t = self._times(), time.perf_counter()
        wall = self.wall = max(t - self._t, 1e-9)
        out = {}
        for name, procs in self.procs.items():
            used = sum(now[p.pid] - self._last.get(p.pid, now[p.pid]) for p in procs if p.pid in now)
            out[name] = used / (wall * self.cores)
        self._last, self._t = now, t
        return out

    def read(self) -> dict[str, float]:
        """`shares` as metrics, `perf/cpu_share_<group>`."""
        return {f"perf/cpu_share_{name}": share for name, share in self.shares().items()}
