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
    from ebrl.runs.sweep import trial  # after composition, so `--cfg job` needs no torch

    with exit_cleanly():
        return trial(cfg)


def multirun_argv(argv: list[str]) -> list[str]:
    """The command line as Hydra needs it: --multirun, then sweep=stages unless given, then the user's arguments.
    Hydra takes the overrides as one run of positionals, so both go before them (inserted after `-m`, the overrides
    that follow it would be argparse's "unrecognized arguments")."""
    args = [a for a in argv[1:] if a not in ("-m", "--multirun")]
    group = [] if any(a.startswith(("sweep=", "+sweep=")) for a in args) else ["sweep=stages"]
    return [argv[0], "--multirun", *group, *args]


if __name__ == "__main__":
    sys.argv = multirun_argv(sys.argv)
    main()
