"""The GPU sampler on a machine without an NVIDIA driver: NVML's absence reported, not raised."""
import time

import pytest

from ebrl.telemetry.monitor import GpuMonitor


def test_gpu_monitor_without_a_driver_says_why_and_does_not_raise():
    monitor = GpuMonitor(interval_s=0.05)
    if monitor.available:
        pytest.skip("this machine has an NVIDIA driver")
    assert "NVML unavailable" in monitor.reason and "\n" not in monitor.reason
    with monitor:
        time.sleep(0.1)
    assert monitor.samples == [] and monitor.summary() == {} and monitor.read() == {}


def test_gpu_readings_sum_up_per_iteration():
    # the aggregation alone, on readings shaped like NVML's (this machine has no GPU to sample)
    monitor = GpuMonitor(interval_s=0.05)
    monitor.samples = [(0.0, {0: {"util": 40.0, "mem_used": 2.0 * 2**30, "sm_util": 30.0}}),
                       (0.5, {0: {"util": 60.0, "mem_used": 3.0 * 2**30}})]
    assert monitor.read() == {"perf/gpu0_util": 50.0, "perf/gpu0_sm_util": 30.0, "perf/gpu0_mem_gb": 3.0}
    assert monitor.read() == {}  # nothing new since
