"""Measure the stage profile of a policy x env x hw: `python sweep.py -m [overrides]`.

Hydra multirun with the Optuna sweeper over each stage's share of the node (conf/sweep/stages.yaml); writes the
stage profile that run.py's allocator loads, and Optuna's optimization_results.yaml in the sweep folder.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ebrl.config import register_configs
from ebrl.runtime.errors import exit_cleanly

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from ebrl.alloc.sweep import trial  # after composition, so `--cfg job` needs no torch

    with exit_cleanly():
        return trial(cfg)


if __name__ == "__main__":
    if not any(arg.startswith(("sweep=", "+sweep=")) for arg in sys.argv[1:]):
        sys.argv.insert(1, "sweep=stages")
    if not any(arg in ("-m", "--multirun") for arg in sys.argv[1:]):
        sys.argv.insert(1, "--multirun")
    main()
