"""policy.train: what the trainer trains, the LoRA adapters (peft's) folded into the weights everything else reads,
and checkpoints that keep them apart."""

from __future__ import annotations

import copy

import pytest
import torch
from peft.tuners.lora import LoraLayer

from ebrl.policies.build import build_policy
from ebrl.policies.training import merged_state
from ebrl.rl.ppo import PPOTrainer
from ebrl.runtime.checkpoint import model_entries, restore_weights
from tests.conftest import compose_config
from tests.policies.test_precision import policy_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout

ALGO = compose_config("algo.epochs=1", "algo.minibatches=1", "algo.lr=1e-2").algo


def trained_after_one_update(name: str, train: str) -> tuple[torch.nn.Module, PPOTrainer]:
    torch.manual_seed(0)
    policy = build_policy(policy_config(name, f"policy.train={train}", "policy.lora_rank=4"), LIFT_SPEC, train=True)
    trainer = PPOTrainer(policy, ALGO)
    trainer.update(one_episode_rollout(policy))
    return policy, trainer


@pytest.mark.parametrize("name", ["openpi", "gr00t", "wam", "openvla_oft"])
@pytest.mark.parametrize("train", ["action_expert", "lora"])
def test_frozen_parts_carry_no_gradient_and_no_optimizer_state(name: str, train: str) -> None:
    policy, trainer = trained_after_one_update(name, train)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    trained = policy.rl_heads() + policy.action_expert()
    frozen = trained_names = 0
    for key, p in policy.named_parameters():
        assert p.requires_grad == (key.startswith(tuple(trained)) or ".lora_" in key), key
        if p.requires_grad:
            trained_names += 1
            assert key.startswith(tuple(trained)) or ".lora_" in key, key
            assert id(p) in in_optimizer and p.dtype == torch.float32, key
        else:
            frozen += 1
            assert p.grad is None and id(p) not in in_optimizer and p not in trainer.optimizer.state, key
    assert frozen and trained_names
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(in_optimizer)  # every trained parameter has its moments, and nothing else has any
    lora = [k for k, p in policy.named_parameters() if ".lora_" in k]
    assert bool(lora) == (train == "lora")


def test_lora_adapters_fold_into_the_weights_as_peft_merges_them() -> None:
    """What generation receives is peft's own merge (LoraLayer.merge) of the trained adapters."""
    policy, _ = trained_after_one_update("openpi", "lora")
    ours = merged_state(policy.state_dict(), policy.lora_scaling)
    merged = copy.deepcopy(policy)
    layers = [m for m in merged.modules() if isinstance(m, LoraLayer)]
    assert layers and all(m.lora_B["default"].weight.abs().sum() > 0 for m in layers)  # the update moved them
    for module in layers:
        module.merge()
    theirs = {k.replace(".base_layer.", "."): v for k, v in merged.state_dict().items() if ".lora_" not in k}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.allclose(ours[key], value, atol=1e-6), key


def test_a_lora_checkpoint_resumes_its_adapters_and_evaluates_merged() -> None:
    policy, _ = trained_after_one_update("openpi", "lora")
    config = policy_config("openpi", "policy.train=lora", "policy.lora_rank=4")
    ckpt = model_entries(policy.state_dict(), config)
    assert ckpt["lora"] and not any(".lora_" in k or ".base_layer." in k for k in ckpt["model"])
    resumed = build_policy(config, LIFT_SPEC, train=True, weights="given")
    restore_weights(resumed, ckpt, "test")
    for key, value in policy.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    acting = build_policy(config, LIFT_SPEC, weights="given")  # generation's or mode=eval's: no adapters
    restore_weights(acting, ckpt, "test")
    obs = one_episode_rollout(policy, chunks=1).obs
    obs = {k: v[0] for k, v in obs.items()}
    torch.manual_seed(3)
    a = policy.sample(obs)
    torch.manual_seed(3)
    b = acting.sample(obs)
    assert torch.allclose(a.chunk, b.chunk, atol=1e-4) and torch.allclose(a.log_prob, b.log_prob, atol=1e-3)
