"""Shared helpers: compose the real configs with Hydra's compose API; lerobot's pi0 / pi0.5 reference folders."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ebrl.config import register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
register_configs()


def compose_config(*overrides: str) -> DictConfig:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose("config", overrides=list(overrides))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def one_thread():
    """Training loops of a tiny model: one intra-op thread is as fast on an idle machine and does not slow down
    tenfold when other processes load the cores (OpenMP threads waiting on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LEROBOT_VARIANTS = ("pi0", "pi05")
# a reference interpreter's environment: one OpenMP thread (a third faster here, where other processes load the cores)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def lerobot_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """lerobot 0.4.4's pi0 and pi0.5 folders at a small size and what they act (tests/policies/lerobot_reference.py),
    made once per session in one run of lerobot's interpreter: variant -> folder, each with the SentencePiece model
    its prompts were tokenized with as paligemma_tokenizer.model. Skipped without that interpreter."""
    from ebrl.envs.setup import benchmark_python
    from tests.policies.test_lerobot_parity import REFERENCE, train_sentencepiece

    python = benchmark_python("lerobot")
    if python is None:
        pytest.skip("lerobot's interpreter is not set up: python -m ebrl.envs.setup lerobot")
    root = tmp_path_factory.mktemp("lerobot")
    model = train_sentencepiece(root / "paligemma_tokenizer.model")
    subprocess.run(
        [str(python), str(REFERENCE), "reference", str(root), str(model), *LEROBOT_VARIANTS],
        check=True,
        capture_output=True,
        timeout=600,
        env=ONE_THREAD,
    )
    for variant in LEROBOT_VARIANTS:
        shutil.copy(model, root / variant / model.name)
    return {variant: root / variant for variant in LEROBOT_VARIANTS}


@pytest.fixture(scope="session")
def groot_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lerobot 0.4.4's GR00T folders and what it acts (tests/policies/groot_reference.py), made once per session;
    skipped without lerobot's interpreter."""
    from tests.policies.test_groot_parity import make_reference

    return make_reference(tmp_path_factory)


FAKE_MPS_CONTROL = """#!/bin/sh
# Stand-in for nvidia-cuda-mps-control on a machine without a GPU: -d opens the control pipe, "quit" removes it.
if [ "$CUDA_VISIBLE_DEVICES" = "$FAKE_MPS_FAIL_GPU" ]; then echo "no such device"; exit 1; fi
if [ "$1" = "-d" ]; then
  [ -n "$FAKE_MPS_NO_PIPE" ] && exit 0
  echo "$CUDA_VISIBLE_DEVICES" > "$CUDA_MPS_PIPE_DIRECTORY/visible"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read command
case "$command" in
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
  get_server_list) for pid in $FAKE_MPS_SERVERS; do echo "$pid"; done ;;
  get_client_list*) for pid in $FAKE_MPS_CLIENTS; do echo "$pid"; done ;;
esac
exit 0
"""


@pytest.fixture
def fake_mps_control(tmp_path, monkeypatch):
    """FAKE_MPS_CONTROL first on PATH as nvidia-cuda-mps-control (this machine has no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS_CONTROL)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return exe


@pytest.fixture(scope="session", autouse=True)
def foreign_load_beside_the_tests():
    """EBRL_TEST_FOREIGN_LOAD=N: every test of the session runs beside N busy processes at nice 0 (a shared node's
    other load; docs/use/testing.md), e.g. the fault tests, which must lose nothing and say each fault in one line."""
    n = int(os.environ.get("EBRL_TEST_FOREIGN_LOAD", "0") or 0)
    if not n:
        yield
        return
    from ebrl.bench.load import foreign_load

    with foreign_load(n):
        yield
