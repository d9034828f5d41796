"""Train a robot policy with RL in simulation: `python run.py policy=openpi env=robosuite hw=cpu`."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ebrl.config import register_configs
from ebrl.runtime.errors import exit_cleanly

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from ebrl.runtime.experiment import Experiment  # after composition, so `--cfg job` needs no torch

    with exit_cleanly():
        run = Experiment.from_config(cfg)  # validates, plans, fails with one line
        return run.train().rollout_steps_per_s  # the value a sweep optimises


if __name__ == "__main__":
    main()
