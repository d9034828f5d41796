"""The GPU sampler: NVML's absence reported, not raised (for real: this machine has no NVIDIA driver), and a rank's
own GPUs sampled under their node's numbers (on a fake NVML: this machine has no GPU)."""

import sys
import time
from types import SimpleNamespace

import pytest

from ebrl.telemetry.monitor import GpuMonitor, open_nvml

UUIDS = [
    "GPU-0aa3c1d2-7e51-4f0c-9b6e-1d2f3a4b5c6d",
    "GPU-0ab8e2f1-0c3d-4a5e-8f7a-9b0c1d2e3f4a",
    "GPU-9cc4d3e2-1b2c-4d3e-8f9a-0b1c2d3e4f5a",
    "GPU-77d0a1b2-3c4d-4e5f-8a9b-0c1d2e3f4a5b",
]


class FakeNvml:
    """pynvml's calls GpuMonitor makes, on four GPUs whose utilisation is 10 x their number (no GPM)."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return UUIDS[handle]

    def nvmlGpmQueryDeviceSupport(self, handle: int) -> None:
        raise self.NVMLError("not supported")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=2**30 * (handle + 1))


@pytest.mark.skipif(open_nvml()[0] is not None, reason="this machine has an NVIDIA driver")
def test_gpu_monitor_without_nvmls_library_says_why_and_does_not_raise():
    monitor = GpuMonitor(interval_s=0.05, gpus=["0"])
    assert not monitor.available and "\n" not in monitor.reason
    assert monitor.reason.startswith("NVML unavailable: libnvidia-ml.so.1 is not there"), monitor.reason
    with monitor:
        time.sleep(0.1)
    assert monitor.samples == [] and monitor.summary() == {} and monitor.read() == {}


def test_gpu_monitor_without_the_pynvml_module_says_which_package_brings_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # (import pynvml raises ImportError, as where it is missing)
    monitor = GpuMonitor(interval_s=0.05)
    assert not monitor.available and "pip install nvidia-ml-py" in monitor.reason
    with monitor:
        time.sleep(0.1)
    assert monitor.read() == {}


@pytest.mark.parametrize(
    "visible, sampled",
    [
        (["2"], [2]),  # a rank pinned to its node's GPU 2 (CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA's 2 is NVML's 2)
        (["GPU-0ab8"], [1]),  # by UUID prefix
        (["3", "1"], [3, 1]),  # a one-rank run on two GPUs
        (None, [0, 1, 2, 3]),
    ],
)
def test_a_rank_samples_its_own_gpus_under_their_node_numbers(monkeypatch, visible, sampled):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monitor = GpuMonitor(interval_s=0.02, gpus=visible)
    assert monitor.available and list(monitor.handles) == sampled
    with monitor:
        while len(monitor.samples) < 2:
            time.sleep(0.02)
    figures = monitor.read()
    assert set(figures) == {f"perf/gpu{i}_{name}" for i in sampled for name in ("util", "mem_gb")}
    assert all(figures[f"perf/gpu{i}_util"] == 10.0 * i and figures[f"perf/gpu{i}_mem_gb"] == i + 1 for i in sampled)


def test_a_mig_instance_alone_leaves_the_telemetry_off_with_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monitor = GpuMonitor(gpus=["MIG-3f2a1b0c-aaaa-bbbb-cccc-0123456789ab"])
    assert not monitor.available and "CUDA_VISIBLE_DEVICES=MIG-3f2a" in monitor.reason


def test_gpu_readings_sum_up_per_iteration():
    # the aggregation alone, on readings shaped like NVML's (this machine has no GPU to sample)
    monitor = GpuMonitor(interval_s=0.05)
    monitor.samples = [
        (0.0, {0: {"util": 40.0, "mem_used": 2.0 * 2**30, "sm_util": 30.0}}),
        (0.5, {0: {"util": 60.0, "mem_used": 3.0 * 2**30}}),
    ]
    assert monitor.read() == {"perf/gpu0_util": 50.0, "perf/gpu0_sm_util": 30.0, "perf/gpu0_mem_gb": 3.0}
    assert monitor.read() == {}  # nothing new since
