"""Shared helpers: compose the real configs with Hydra's compose API."""
from __future__ import annotations

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
