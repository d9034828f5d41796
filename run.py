"""Train a robot policy with RL in simulation: `python run.py policy=openpi env=robosuite hw=cpu`;
evaluate one: `python run.py mode=eval checkpoint=<run folder> eval.episodes=50`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ebrl.config import register_configs
from ebrl.runtime.errors import exit_cleanly

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from ebrl.runs.evaluation import Evaluation, check_mode  # after composition, so `--cfg job` needs no torch
    from ebrl.runs.experiment import Experiment
    from ebrl.runs.sft import SupervisedRun

    with exit_cleanly() as stop:
        check_mode(cfg)
        if cfg.mode == "eval":
            return Evaluation.from_config(cfg).run().success_rate
        if cfg.algo.name == "sft":  # demonstrations, no simulator: its own run
            sft = SupervisedRun.from_config(cfg)
            stop.run_dir = sft.run_dir
            return sft.train().valid_loss
        run = Experiment.from_config(cfg)  # validates, plans, fails with one line
        stop.run_dir = run.run_dir  # (a stopped run's last line names the folder to resume)
        return run.train().rollout_steps_per_s  # the value a sweep optimises


if __name__ == "__main__":
    main()
