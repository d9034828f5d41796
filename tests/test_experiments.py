"""conf/experiment: every published run is `python run.py experiment=NAME`. Each file composes (as `--cfg job` does,
no simulator started), passes the checks this CPU machine can satisfy, and is the command line it replaced."""

import re

import pytest
from omegaconf import OmegaConf

from ebrl.checks import validate
from tests.conftest import REPO, compose_config, group_options

EXPERIMENTS = group_options("experiment")
# what each experiment replaced on the command line (README.md, docs/results/results.md)
PUBLISHED = {
    "pi0_libero": [
        "policy=openpi",
        "policy.preset=full",
        "env=libero",
        "env.suite=libero_spatial",
        "env.task=0",
        "env.cameras=[agentview,robot0_eye_in_hand]",
        "env.image_size=224",
        "policy.cameras={base_0_rgb: agentview, left_wrist_0_rgb: robot0_eye_in_hand, right_wrist_0_rgb: null}",
        "policy.state_dims=[0,1,2,3,4,5,6,7]",
        "hw=h200x1",
    ],
    "lift_stock_step": ["env.fast_step=false"],
    "lift_ebrl": ["scheduler=ebrl"],
    "lift_scratch_ppo": ["init=null", "env.reward=dense"],
    "lift_scratch_grpo": ["init=null", "env.reward=dense", "algo=grpo"],
    "lift_scratch_ppo_30min": [
        "init=null",
        "env.reward=dense",
        "iterations=2000",
        "seed=0",
        "progress=false",
        "checkpoint_every=100",
    ],
}
PUBLISHED["lift_scratch_ppo_32envs"] = [
    *PUBLISHED["lift_scratch_ppo_30min"],
    "env.num_envs=32",
    "algo.minibatches=2",
    "algo.critic_lr=3e-3",
]
# an experiment for hardware this machine lacks is checked on this machine's hw=cpu (its composition as it is)
HERE = {"pi0_libero": ["hw=cpu"]}


def resolved(*overrides: str) -> dict:
    return OmegaConf.to_container(compose_config(*overrides), resolve=True)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_passes_the_checks(name):
    resolved(f"experiment={name}")  # every interpolation resolves (the recipe's defaults included)
    validate(compose_config(f"experiment={name}", *HERE.get(name, [])))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_an_experiment_is_the_command_line_it_replaced(name):
    assert name in PUBLISHED, f"conf/experiment/{name}.yaml: say in PUBLISHED what it stands for"
    assert resolved(f"experiment={name}") == resolved(*PUBLISHED[name])


def test_the_command_line_still_wins_over_an_experiment():
    cfg = compose_config("experiment=pi0_libero", "hw=cpu", "env.task=3", "algo=sft")
    assert (cfg.hw.name, cfg.env.task, cfg.algo.name, cfg.policy.preset) == ("cpu", "3", "sft", "full")
    assert compose_config("experiment=lift_scratch_grpo", "algo=ppo").algo.name == "ppo"


def test_the_experiments_the_docs_name_are_the_files_there_are():
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    named = {m for path in docs for m in re.findall(r"experiment=([a-z][a-z0-9_]*)", path.read_text())}
    assert named == set(EXPERIMENTS)
