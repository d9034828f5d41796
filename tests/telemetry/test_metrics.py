"""W&B grouping: the trials of one Hydra multirun share a group, single runs get none."""

from hydra.types import RunMode
from omegaconf import OmegaConf

from ebrl.telemetry.metrics import sweep_group


def hydra_node(mode: RunMode) -> object:
    return OmegaConf.create(
        {"mode": mode, "job": {"name": "sweep"}, "sweep": {"dir": "runs/multirun/2026-12-01/07-40-00"}}
    )


def test_a_multirun_trial_is_grouped_by_its_sweep_folder():
    assert sweep_group(hydra_node(RunMode.MULTIRUN)) == "sweep:runs/multirun/2026-12-01/07-40-00"


def test_a_single_run_has_no_group():
    assert sweep_group(hydra_node(RunMode.RUN)) is None
    assert sweep_group() is None  # no Hydra app in this process
