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
    assert monitor.samples == [] and monitor.summary() == {}
