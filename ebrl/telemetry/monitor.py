"""Background samplers over a run: GPU totals per device (NVML) and CPU busy per core (psutil).

Samples are stamped with `time.perf_counter()`, the clock of the stage trace (ebrl/telemetry/trace.py), so
utilisation and stage busy intervals can be plotted on one axis (ebrl/telemetry/plots.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from ebrl.telemetry.timers import CpuMonitor


class _Sampler:
    """A daemon thread that appends (perf_counter, reading) every `interval_s` between start and stop."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> Any:
        raise NotImplementedError

    def _pause_s(self) -> float:
        """Seconds to wait between readings (0 when the reading itself spans the interval)."""
        return self.interval_s

    def _loop(self) -> None:
        while not self._stop.wait(self._pause_s()):
            reading = self._read()
            self.samples.append((time.perf_counter(), reading))

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling; returns once the thread is gone (at most one interval later)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "_Sampler":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CpuSampler(_Sampler):
    """Busy fraction of each core over every `interval_s`: the time series behind cpu_busy.png. The per-iteration
    metrics (perf/cpu<i>_busy) come from a CpuMonitor of their own, so neither resets the other's counters."""

    def __init__(self, cores: list[int], interval_s: float = 0.5) -> None:
        super().__init__(interval_s)
        self.samples: list[tuple[float, dict[int, float]]] = []  # (perf_counter, {core: busy since the last sample})
        self._cpu = CpuMonitor(cores)

    def _read(self) -> dict[int, float]:
        return dict(zip(self._cpu.cores, self._cpu.per_core()))


def open_nvml() -> tuple[Any, str]:
    """pynvml after nvmlInit, and ""; or None and why NVML is unavailable. NVML counts and reads the GPUs without
    initialising CUDA, so it is safe before `pin_gpu`."""
    try:
        import pynvml
    except ImportError:
        return None, "NVML unavailable: the pynvml module is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: no library, no driver, or a driver that refuses
        if type(e).__name__ == "NVMLError_LibraryNotFound":
            return None, (
                "NVML unavailable: libnvidia-ml.so.1 is not there (no NVIDIA driver, or a container "
                "started without the driver's utility libraries: NVIDIA_DRIVER_CAPABILITIES=compute,utility)"
            )
        return None, f"NVML unavailable ({type(e).__name__}: {e})"
    return pynvml, ""


def nvml_indices(nvml: Any, entries: Sequence[str] | None) -> list[int]:
    """The node's numbers (NVML's, in bus order) of the GPUs CUDA_VISIBLE_DEVICES `entries` name (indices in bus
    order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them, or GPU-UUID prefixes); None: every GPU. A MIG instance, of
    which NVML reads no utilisation, or an entry that names no GPU, is left out."""
    count = nvml.nvmlDeviceGetCount()
    if entries is None:
        return list(range(count))
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    found = []
    for entry in (e.strip() for e in entries):
        named = (
            [int(entry)]
            if entry.isdigit() and int(entry) < count
            else [i for i, uuid in enumerate(uuids) if entry.startswith("GPU-") and uuid.startswith(entry)]
        )
        if len(named) == 1 and named[0] not in found:
            found.append(named[0])
    return found


def gpu_uuids() -> list[str] | None:
    """The UUIDs of every GPU of this machine in NVML's order (CUDA_VISIBLE_DEVICES aside); None without NVML."""
    nvml, _ = open_nvml()
    if nvml is None:
        return None
    try:
        return [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()


def gpu_free_bytes(entry: str) -> int | None:
    """Free memory of the GPU a CUDA_VISIBLE_DEVICES entry names (an index or a GPU-UUID), from NVML (no CUDA
    context); None without NVML."""
    nvml, _ = open_nvml()
    if nvml is None:
        return None
    try:
        handle = (
            nvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit() else nvml.nvmlDeviceGetHandleByUUID(entry)
        )
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).free)
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()


class GpuMonitor(_Sampler):
    """Device totals per GPU from NVML: utilization.gpu (%), memory used (bytes) and, where GPM is supported (Hopper
    and later), SM utilisation and SM occupancy (%) between two consecutive samples; of the GPUs `gpus` names (a
    rank's own, as its CUDA_VISIBLE_DEVICES entries: `nvml_indices`; None: every GPU), each under its node's number.

    NVML attributes all MPS clients to the MPS server process, and its totals cover the whole device, so the GPU busy
    time of each stage comes from the application's own trace, not from here. Without NVML `available` is False,
    `reason` says why, and start/stop do nothing: a run goes on without GPU figures.
    """

    def __init__(self, interval_s: float = 0.5, gpus: Sequence[str] | None = None) -> None:
        super().__init__(interval_s)
        self.samples: list[tuple[float, dict[int, dict[str, float]]]] = []
        self.available = False
        self.reason = ""
        self.handles: dict[int, Any] = {}  # the node's number -> NVML handle
        self.gpm: dict[int, bool] = {}
        self._gpm_last: dict[int, Any] = {}
        self._read_from = 0  # samples already summed up by `read`
        pynvml, self.reason = open_nvml()
        if pynvml is None:
            return
        self._nvml = pynvml
        self.handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in nvml_indices(pynvml, gpus)}
        if not self.handles:
            self.reason = f"NVML lists no GPU that CUDA_VISIBLE_DEVICES={','.join(gpus or ())} names (a MIG instance?)"
            return
        self.gpm = {i: self._gpm_supported(h) for i, h in self.handles.items()}
        self.available = True

    def _gpm_supported(self, handle: Any) -> bool:
        try:
            return bool(self._nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:  # an older driver has no GPM entry points
            return False

    def start(self) -> None:
        if self.available:
            super().start()

    def stop(self) -> None:
        super().stop()
        for sample in self._gpm_last.values():
            self._nvml.nvmlGpmSampleFree(sample)
        self._gpm_last.clear()

    def _gpm_read(self, index: int) -> dict[str, float]:
        """SM utilisation and occupancy between the previous GPM sample of this GPU and now ({} on the first)."""
        nvml = self._nvml
        sample = nvml.nvmlGpmSampleAlloc()
        nvml.nvmlGpmSampleGet(self.handles[index], sample)
        last, self._gpm_last[index] = self._gpm_last.get(index), sample
        if last is None:
            return {}
        query = nvml.c_nvmlGpmMetricsGet_t()
        query.version = nvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 2
        query.sample1, query.sample2 = last, sample
        query.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        query.metrics[1].metricId = nvml.NVML_GPM_METRIC_SM_OCCUPANCY
        try:
            nvml.nvmlGpmMetricsGet(query)
        finally:
            nvml.nvmlGpmSampleFree(last)
        return {"sm_util": query.metrics[0].value, "sm_occupancy": query.metrics[1].value}

    def _read(self) -> dict[int, dict[str, float]]:
        nvml = self._nvml
        out = {}
        for i, handle in self.handles.items():
            reading = {
                "util": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "mem_used": float(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            }
            if self.gpm[i]:
                try:
                    reading.update(self._gpm_read(i))
                except nvml.NVMLError:
                    self.gpm[i] = False  # supported but refused (e.g. GPM off in a VM): totals only from now on
            out[i] = reading
        return out

    def read(self) -> dict[str, float]:
        """Metrics over the samples since the last read: perf/gpu<i>_util, _sm_util (GPM), _mem_gb (peak)."""
        fresh, self._read_from = self.samples[self._read_from :], len(self.samples)
        out: dict[str, float] = {}
        for gpu in fresh[0][1] if fresh else ():
            for name in ("util", "sm_util"):
                values = [reading[gpu][name] for _, reading in fresh if name in reading[gpu]]
                if values:
                    out[f"perf/gpu{gpu}_{name}"] = sum(values) / len(values)
            out[f"perf/gpu{gpu}_mem_gb"] = max(reading[gpu]["mem_used"] for _, reading in fresh) / 2**30
        return out

    def summary(self) -> dict[int, dict[str, float]]:
        """Per GPU: the mean of each figure over the samples, and the peak memory used."""
        values: dict[int, dict[str, list[float]]] = {}
        for _, reading in self.samples:
            for gpu, figures in reading.items():
                for name, value in figures.items():
                    values.setdefault(gpu, {}).setdefault(name, []).append(value)
        return {
            gpu: {
                **{f"mean_{k}": sum(v) / len(v) for k, v in figures.items()},
                "peak_mem_used": max(figures["mem_used"]),
            }
            for gpu, figures in values.items()
        }
