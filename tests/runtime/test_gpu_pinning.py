"""GPUs are counted without CUDA: once a process's CUDA initialises, CUDA_VISIBLE_DEVICES no longer applies to it, and
`pin_gpu` sets it for each rank after `validate` has counted the node's GPUs."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.node import cuda_device_count, visible_gpu_count
from ebrl.telemetry.monitor import gpu_uuids, open_nvml
from tests.conftest import compose_config

UUIDS = ["GPU-0aa3c1d2-7e51-4f0c-9b6e-1d2f3a4b5c6d", "GPU-0ab8e2f1-0c3d-4a5e-8f7a-9b0c1d2e3f4a",
         "GPU-9cc4d3e2-1b2c-4d3e-8f9a-0b1c2d3e4f5a"]


def refusing(name: str, touched: list[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        touched.append(name)
        raise AssertionError(f"torch.cuda.{name} was called while validating")

    return call


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has CUDA GPUs")
def test_validating_a_gpu_config_touches_no_cuda(monkeypatch):
    touched: list[str] = []
    for name in ("is_available", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, name, refusing(name, touched))
    with pytest.raises(ConfigError) as info:
        validate(compose_config("hw=h200x1"))
    assert str(info.value) == "hw=h200x1 needs 1 CUDA GPU and this machine has none"
    assert touched == [] and not torch.cuda.is_initialized()


@pytest.mark.parametrize("visible, count", [
    (None, 3),  # unset: every GPU
    ("1", 1),  # a rank pinned to its GPU
    (" 2 , 0", 2),
    ("", 0),  # set and empty: none
    ("0,7,1", 1),  # the first entry that names no GPU ends the list
    ("1,1", 0),  # a GPU named twice: none
    ("GPU-9cc4", 1),  # a unique UUID prefix
    ("GPU-0a", 0),  # an ambiguous one names no GPU
    ("GPU-0ab8e2f1-0c3d-4a5e-8f7a-9b0c1d2e3f4a,0", 2),
    ("GPU-0ab8,1", 0),  # the same GPU by UUID and index
    ("MIG-3f2a1b0c-aaaa-bbbb-cccc-0123456789ab", 1),
])
def test_the_visible_gpus_are_counted_as_cuda_counts_them(visible, count):
    assert visible_gpu_count(visible, UUIDS) == count


@pytest.mark.skipif(open_nvml()[0] is not None, reason="this machine has an NVIDIA driver")
def test_without_a_driver_there_are_no_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_uuids() is None and cuda_device_count() == 0
