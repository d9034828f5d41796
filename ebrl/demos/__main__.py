"""`python -m ebrl.demos record env=<benchmark> env.task=<task> episodes=N [out=<folder>] [format=hdf5|lerobot]
[valid=0.2] [seed=0]`: record a scripted expert's successful episodes (ebrl/demos/record.py); the options are
conf/record.yaml's."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ebrl.config import CONF_DIR, register_configs
from ebrl.runtime.errors import exit_cleanly

USAGE = (
    "usage: python -m ebrl.demos record env=<benchmark> env.task=<task> episodes=N [out=<folder>] "
    "[format=hdf5|lerobot] [valid=0.2] [seed=0]"
)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="record")
def _record(cfg: DictConfig) -> None:
    from ebrl.demos.record import record

    with exit_cleanly():
        record(cfg)


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            f"{USAGE}\nRecords a scripted expert's successful episodes; `record --help` lists conf/record.yaml's "
            "options."
        )
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] != "record":
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    del sys.argv[1]  # Hydra reads the overrides after it
    register_configs()
    _record()


if __name__ == "__main__":
    main()
