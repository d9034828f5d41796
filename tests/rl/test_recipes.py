"""The defaults per preset (ebrl/recipes.py) and the losses and optimizer groups the full-size recipes use."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ebrl.policies.build import build_policy
from ebrl.recipes import RECIPES, recipe_line
from ebrl.rl.ppo import CRITIC, PPOTrainer, ppo_loss, value_loss
from tests.conftest import compose_config
from tests.policies.test_precision import policy_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout


def resolved(*overrides: str) -> dict:
    cfg = compose_config(*overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def test_full_size_defaults_are_the_published_recipe_and_tiny_keeps_its_own() -> None:
    full = resolved("policy.preset=full", "env=libero")
    algo, policy = full["algo"], full["policy"]
    # RLinf's libero_spatial_ppo_openpi.yaml (with model/pi0.yaml): AdamW 5e-6 / value head 1e-4, betas (0.9, 0.95)
    assert (algo["lr"], algo["critic_lr"], algo["adam_betas"], algo["adam_eps"], algo["weight_decay"]) == (
        5e-6,
        1e-4,
        [0.9, 0.95],
        1e-8,
        0.01,
    )
    assert (algo["clip"], algo["clip_high"], algo["value_clip"], algo["huber_delta"], algo["epochs"]) == (
        0.2,
        None,
        0.2,
        10.0,
        4,
    )
    assert (policy["logprob"], policy["sde_noise_level"]) == ("flow_sde", 0.5)
    tiny = resolved("env=libero")  # the tuning docs/results/results.md's learning figures were measured with
    assert (tiny["algo"]["lr"], tiny["algo"]["critic_lr"], tiny["algo"]["value_clip"], tiny["policy"]["logprob"]) == (
        1e-4,
        1e-4,
        None,
        "flow_noise",
    )
    # the variant, the benchmark and the algorithm pick the recipe; a value given on the command line wins
    pi05 = resolved("policy.preset=full", "policy.variant=pi05", "env=maniskill", "algo.lr=3e-5")
    assert (pi05["algo"]["lr"], pi05["algo"]["critic_lr"], pi05["algo"]["epochs"], pi05["algo"]["entropy_coef"]) == (
        3e-5,
        1.55e-4,
        5,
        0.005,
    )
    assert pi05["policy"]["logprob"] == "flow_noise"
    oft = resolved("policy=openvla_oft", "policy.preset=full", "env=libero", "algo=grpo")
    assert (oft["algo"]["lr"], oft["algo"]["clip_high"], oft["algo"]["epochs"]) == (2e-5, 0.28, 1)


def test_the_console_names_the_recipe_and_what_stood_in() -> None:
    line = recipe_line(compose_config("policy=wam", "policy.preset=full", "env=robosuite"))
    assert line.startswith(
        "algo: defaults from RLinf a3816b5 examples/embodiment/config/libero_spatial_ppo_openpi.yaml"
    )
    assert "wam has none published: pi0's; robosuite has none published: libero's" in line
    assert "lr 5e-06, critic_lr 0.0001" in line
    assert all(key[1] in ("libero", "maniskill", "robocasa") for key in RECIPES)


def test_value_loss_is_rlinfs_clipped_huber_and_squared_error_without() -> None:
    value, ret, old = torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0.5, 20.0, 0.0]), torch.tensor([0.0, 0.9, 2.0])
    assert torch.allclose(value_loss(value, ret, old, None, None), 0.5 * (ret - value) ** 2)
    # Huber at delta 10: 0.5 err^2 below it, 10 (|err| - 5) above (row 2: |err| = 19 -> 140)
    assert torch.allclose(value_loss(value, ret, old, None, 10.0), torch.tensor([0.125, 140.0, 4.5]))
    # clipped: row 3's value may move 0.2 from 2.0, to 2.2 -> loss 0.5 * 2.2^2 = 2.42 < 4.5: the larger, 4.5, stays;
    # rows 1 and 2 moved less than 0.2: their clipped value is their value
    assert torch.allclose(value_loss(value, ret, old, 0.2, 10.0), torch.tensor([0.125, 140.0, 4.5]))
    # a value that moved towards the return beyond the clip is held to the clipped one's (larger) loss
    assert torch.allclose(
        value_loss(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]), 0.2, None),
        torch.tensor([0.5 * 0.8**2]),
    )


def test_the_value_head_trains_at_the_critic_lr_and_old_optimizer_states_regroup() -> None:
    torch.manual_seed(0)
    policy = build_policy(policy_config("openpi"), LIFT_SPEC, train=True)
    batch = one_episode_rollout(policy, chunks=2, num_envs=4)
    algo = compose_config("algo.minibatches=1", "algo.epochs=1", "algo.critic_lr=3e-3", "algo.weight_decay=0.01").algo
    trainer = PPOTrainer(policy, algo)
    actor, critic = trainer.optimizer.param_groups
    critic_ids = {id(p) for name, p in policy.named_parameters() if name.startswith(CRITIC)}
    assert {id(p) for p in critic["params"]} == critic_ids and critic["lr"] == 3e-3 and actor["lr"] == 1e-4
    assert actor["weight_decay"] == critic["weight_decay"] == 0.01
    trainer.update(batch)
    state = trainer.optimizer.state_dict()
    # as a run saved it before the value head had a group of its own: one group, in trained_parameters' order
    order = [id(p) for p in policy.parameters() if p.requires_grad]
    now = {id(p): i for i, p in enumerate(p for group in trainer.optimizer.param_groups for p in group["params"])}
    index = {i: now[pid] for i, pid in enumerate(order)}  # position in the old order -> index in the new state
    old = {
        "state": {i: state["state"][index[i]] for i in range(len(order))},
        "param_groups": [{**state["param_groups"][0], "lr": 1e-4, "params": list(range(len(order)))}],
    }
    resumed = PPOTrainer(policy, compose_config("algo.critic_lr=5e-4").algo)
    resumed.load_optimizer_state(old)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [1e-4, 5e-4]  # this config's, not the saved ones
    for group in resumed.optimizer.param_groups:
        for p in group["params"]:
            saved = trainer.optimizer.state[p]["exp_avg"]
            assert torch.equal(resumed.optimizer.state[p]["exp_avg"], saved)


@pytest.mark.parametrize("high", [None, 0.28])
def test_the_ratio_clip_above_one_is_clip_high(high) -> None:
    lp = torch.log(torch.tensor([[1.25]]))  # ratio 1.25 with a positive advantage: clipped at 1.2, not at 1.28
    loss, stats = ppo_loss(
        lp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool), 0.2, clip_high=high
    )
    assert float(-loss) == pytest.approx(1.2 if high is None else 1.25)
    assert float(stats["train/clipfrac"]) == (1.0 if high is None else 0.0)
