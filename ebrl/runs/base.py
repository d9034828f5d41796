"""What every kind of run starts with (training, evaluation, SFT): its config and a resolved plain copy that crosses
processes, its folder, its device and seeded generators, and the simulators' pool."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.checks import runs_on_cuda
from ebrl.envs.worker import SimWorkerPool, simulator_gpu_environment


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators from `seed` (the simulators seed themselves from it too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_device(cfg: DictConfig) -> torch.device:
    """Where the policy runs: cuda for device=cuda, or device=auto on hw with GPUs; cpu otherwise. (A rank of
    several sees only its own GPU: `pin_gpu`.)"""
    return torch.device("cuda" if runs_on_cuda(cfg) else "cpu")


def run_folder(cfg: DictConfig, run_dir: str | Path | None, resumes: bool = True) -> Path:
    """The run's folder: the run it resumes (`resume=`, for the kinds that resume), else `run_dir`, else the one
    Hydra made for this invocation."""
    if resumes and cfg.get("resume"):
        return Path(cfg.resume).expanduser()
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    return Path(run_dir)


class Run:
    """A run's config, its plain resolved copy (`conf`: what goes to other processes) and its folder."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.conf: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # plain dict across processes
        self.run_dir = run_dir

    def start_device(self, seed: int | None = None) -> torch.device:
        """Seed this process's generators (from `seed`, else the config's) and say where the policy runs."""
        seed_everything(self.cfg.seed if seed is None else seed)
        return run_device(self.cfg)

    def start_pool(self, num_envs: int, seed: int, **options: Any) -> SimWorkerPool:
        """Start `num_envs` simulators of the config's env (concurrently; their spec shapes the policy), on this
        rank's GPU where the run has one and in the serial debug mode where it asks for it; `options`: the pool's
        others (groups, timeouts, episode seeds), or these replaced. A pool that fails to start is closed before the
        error goes on."""
        options = {
            "process_env": simulator_gpu_environment(self.cfg.hw.gpus),
            "serial": self.cfg.scheduler.serial,
            "on_gpu": self.cfg.hw.gpus > 0,
            **options,
        }
        pool = SimWorkerPool(env_cfg=self.conf["env"], num_envs=num_envs, seed=seed, **options)
        try:
            pool.start()
        except BaseException:
            pool.close()
            raise
        return pool
