"""How many actions of each chunk the env executes (`policy.execute`): where the number comes from, in training and
in mode=eval, and what the policy accepts."""

from __future__ import annotations

import json

import pytest

from ebrl.config import ConfigError
from ebrl.policies.build import build_policy, executed_actions, settle_execute
from tests.conftest import compose_config
from tests.policies.test_families import make_spec


@pytest.fixture
def lerobot_folder(tmp_path):
    """A checkpoint folder whose config.json says how lerobot runs it (n_action_steps), as save_pretrained writes it."""
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi0", "chunk_size": 50, "n_action_steps": 10}))
    return tmp_path


def settled(*overrides: str, trained: dict | None = None) -> tuple[int | None, str]:
    cfg = compose_config(*overrides)
    source = settle_execute(cfg, trained)
    return cfg.policy.execute, source


def test_tiny_executes_the_whole_chunk_and_the_full_recipe_five() -> None:
    assert settled() == (None, "the whole chunk")
    k, source = settled("policy.preset=full", "env=libero")
    assert k == 5 and "libero_spatial_ppo_openpi.yaml" in source
    assert settled("policy.preset=full", "env=libero", "policy.execute=10") == (10, "policy.execute")


def test_a_checkpoint_folders_n_action_steps_and_what_an_evaluated_run_trained_with(lerobot_folder) -> None:
    folder = f"policy.checkpoint={lerobot_folder}"
    assert settled(folder)[0] == 10  # no recipe at tiny: the folder's
    assert settled(folder, "policy.preset=full", "env=libero")[0] == 5  # training: the recipe's
    k, source = settled(folder, "policy.preset=full", "env=libero", "mode=eval")
    assert k == 10 and "n_action_steps" in source  # the published checkpoint as its folder runs it
    k, source = settled(
        folder, "policy.preset=full", "env=libero", "mode=eval", "checkpoint=runs/x", trained={"execute": 5}
    )
    assert k == 5 and "trained with" in source  # a run's checkpoint as it trained


def test_the_policy_takes_one_to_its_chunk() -> None:
    policy_cfg = dict(compose_config("policy.execute=3").policy)
    assert build_policy(policy_cfg, make_spec()).execute == 3
    assert build_policy({**policy_cfg, "execute": None}, make_spec()).execute == 8  # tiny's whole chunk
    with pytest.raises(ConfigError, match=r"policy.execute=9 must be in 1..8"):
        build_policy({**policy_cfg, "execute": 9}, make_spec())


def test_the_config_says_what_runs_of_a_chunk_of_any_length() -> None:
    """What the memory model and the cost models read, without a policy of their own to ask: the settled number, or
    the whole chunk; the range is the one build_policy checks."""
    assert executed_actions({"execute": 3}, 8) == 3 and executed_actions({"execute": None}, 8) == 8
    with pytest.raises(ConfigError, match=r"policy.execute=0 must be in 1..8"):
        executed_actions({"execute": 0}, 8)
