"""GPUs are counted without CUDA: once a process's CUDA initialises, CUDA_VISIBLE_DEVICES no longer applies to it, and
`pin_gpu` sets it for each rank after `validate` has counted the node's GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Callable

import pytest
import torch

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.node import cuda_device_count, visible_gpu_count
from ebrl.telemetry.monitor import gpu_uuids, open_nvml
from tests.conftest import compose_config

UUIDS = [
    "GPU-0aa3c1d2-7e51-4f0c-9b6e-1d2f3a4b5c6d",
    "GPU-0ab8e2f1-0c3d-4a5e-8f7a-9b0c1d2e3f4a",
    "GPU-9cc4d3e2-1b2c-4d3e-8f9a-0b1c2d3e4f5a",
]


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


@pytest.mark.parametrize(
    "visible, count",
    [
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
    ],
)
def test_the_visible_gpus_are_counted_as_cuda_counts_them(visible, count):
    assert visible_gpu_count(visible, UUIDS) == count


@pytest.mark.skipif(open_nvml()[0] is not None, reason="this machine has an NVIDIA driver")
def test_without_a_driver_there_are_no_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_uuids() is None and cuda_device_count() == 0


# a CUDA driver library that reports two GPUs: what a container with CUDA and without NVML's library gives a run (this
# machine has neither; the fake stands in for the GPU)
FAKE_LIBCUDA = """int cuInit(unsigned int flags) { return 0; }
int cuDeviceGetCount(int *count) { *count = 2; return 0; }
"""


@pytest.mark.skipif(open_nvml()[0] is not None, reason="this machine has an NVIDIA driver")
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the fake driver library")
def test_without_nvml_the_gpus_are_counted_by_the_cuda_driver(tmp_path, monkeypatch):
    (tmp_path / "cuda.c").write_text(FAKE_LIBCUDA)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "cuda.c")], check=True
    )
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert gpu_uuids() is None  # NVML's library is absent, for real
    assert cuda_device_count() == 2  # counted in a child: this process's CUDA is untouched
    assert not torch.cuda.is_initialized()
    validate(compose_config("hw=h200x1", "hw.cpu_cores=null"))  # a run with CUDA is not refused for want of NVML


@pytest.mark.parametrize(
    "entry", ["ebrl.runs.experiment.Experiment", "ebrl.runs.evaluation.Evaluation", "ebrl.runs.sft.SupervisedRun"]
)
def test_every_run_numbers_its_gpus_by_bus_before_it_counts_them(monkeypatch, entry):
    """CUDA numbers GPUs fastest first unless told otherwise, NVML by PCI bus: each kind of run sets the bus order
    first thing, so that it and every child it starts agree with NVML (checked here on a config that fails at once)."""
    from ebrl.classes import load_class

    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with pytest.raises(ConfigError):
        load_class(entry, "entry").from_config(compose_config("env.num_envs=0"), run_dir="unused")
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
