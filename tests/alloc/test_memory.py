"""The memory model against what a real trainer holds: its weights, gradients and Adam moments byte for byte, the
activations a real pass saves, the GPU budgets and the /dev/shm check (the full-size figures: ebrl.bench.memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ebrl.alloc.memory import (
    MemoryModel,
    budgets,
    check_shared_memory,
    fitting_strategy,
    render_contexts,
    saved_activations,
)
from ebrl.config import ConfigError
from ebrl.policies.build import build_policy
from ebrl.policies.layers import map_tensors
from ebrl.rl.ppo import PPOTrainer
from ebrl.runtime.checkpoint import state_nbytes
from tests.conftest import compose_config
from tests.policies.test_families import make_obs, make_spec
from tests.policies.test_precision import policy_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "overrides",
    [
        ("policy.train=all",),
        ("policy.train=action_expert",),
        ("policy.train=lora", "policy.lora_rank=4"),
        ("policy.train=action_expert", "policy.dtype=bfloat16"),
        ("policy.train=all", "algo.optimizer_dtype=bfloat16"),
    ],
)
def test_the_trainers_state_is_what_the_model_says(overrides: tuple[str, ...]) -> None:
    policy_cfg = policy_config("openpi", *overrides)
    algo = compose_config("algo.epochs=1", "algo.minibatches=1", *(o for o in overrides if o.startswith("algo."))).algo
    torch.manual_seed(0)
    policy = build_policy(policy_cfg, LIFT_SPEC, train=True)
    trainer = PPOTrainer(policy, algo)
    trainer.update(one_episode_rollout(policy))
    moments = [v for state in trainer.optimizer.state.values() for k, v in state.items() if k != "step"]
    model = MemoryModel.of(policy_cfg, LIFT_SPEC, algo.optimizer_dtype, device="cpu")
    predicted = model.trainer(1).parts
    assert predicted["weights"] == tensor_bytes(policy.parameters())
    assert predicted["gradients"] == tensor_bytes(p.grad for p in policy.parameters() if p.grad is not None)
    assert predicted["optimizer"] == tensor_bytes(moments)
    # rank 0's trainer sends a checkpoint's state through /dev/shm: the start-up check counts it there
    sent = state_nbytes((policy.state_dict(), trainer.optimizer_state()))
    steps = sum(v.nbytes for state in trainer.optimizer.state.values() for k, v in state.items() if k == "step")
    rounding = trainer.optimizer_state().get("rounding_rng")  # (bfloat16 moments' generator: a few KiB, not modelled)
    steps += 0 if rounding is None else rounding.nbytes
    assert model.checkpoint_state() == sent - steps
    assert model.shared_memory(2, 8, False, checkpoint=True) - model.shared_memory(2, 8, False) == sent - steps
    bf16 = "policy.dtype=bfloat16" in overrides
    assert predicted["autocast copies"] == (
        tensor_bytes(p for p in policy.parameters() if p.requires_grad) // 2 if bf16 else 0
    )


@pytest.mark.parametrize("name", ["openpi", "gr00t", "wam", "openvla_oft"])
def test_the_meta_trace_bounds_what_a_real_pass_saves(name: str) -> None:
    """The trace on the meta device runs attention unfused (it saves the score matrices a fused kernel does not): an
    upper bound on a real pass's saved activations, within 1.5x of it at the tiny presets (measured: 1.1-1.4x)."""
    spec = make_spec(("front",), size=32)
    policy = build_policy(policy_config(name), spec, train=True)
    obs = make_obs(policy, 1)
    out = policy.sample(obs)
    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    real = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal real
        if t.untyped_storage().data_ptr() not in weights:
            real += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy.evaluate(obs, out.chunk, out.extras)
    meta = build_policy(policy_config(name), spec, "meta", train=True, weights="given")
    meta.compute_dtype = torch.float32
    traced = saved_activations(meta, spec, 1, torch.float32)
    assert real <= traced <= 1.5 * real, (real, traced)


def test_budgets_split_the_gpu_or_say_what_does_not_fit() -> None:
    model = MemoryModel.of(policy_config("openpi", "policy.preset=small"), LIFT_SPEC)
    gpu = 8 * 2**30
    split = budgets(model, gpu, num_envs=8, micro_batch=4, rollout_chunks=10, rendering=False, where="hw=test")
    assert split["generate"] > model.generation(8).total and split["generate"] + split["train"] == gpu
    assert split["train"] > model.trainer(4, 80).total
    with pytest.raises(ConfigError) as e:
        budgets(model, 2**30, num_envs=8, micro_batch=4, rollout_chunks=10, rendering=True, where="hw=test")
    message = str(e.value)
    assert message.startswith("hw=test's GPU has 1.00 GiB and this run needs about") and "\n" not in message
    assert "policy.train=lora" in message and "algo.optimizer_dtype=bfloat16" in message


def test_replicas_that_do_not_fit_are_sharded_or_the_run_says_what_fits() -> None:
    model = MemoryModel.of(policy_config("openpi", "policy.preset=small"), LIFT_SPEC)
    args = (8, 4, 10, False, "hw=test")

    def needs(**how) -> int:  # (the least GPU that holds the run)
        low, high = 1, 2**40
        while low < high:
            mid = (low + high) // 2
            try:
                budgets(model, mid, *args, **how)
                high = mid
            except ConfigError:
                low = mid + 1
        return low

    assert model.trainer(4, 80, shards=8).parts["optimizer"] == model.trainer(4, 80).parts["optimizer"] // 8
    replica, sharded, local = needs(), needs(shards=8), needs(local=True)
    assert sharded < replica
    assert fitting_strategy(model, replica, *args, ranks=8, strategy="auto", trainer_process=True)[0] == "ddp"
    strategy, split = fitting_strategy(model, sharded, *args, ranks=8, strategy="auto", trainer_process=True)
    assert strategy == "fsdp" and split["generate"] + split["train"] == sharded
    with pytest.raises(ConfigError, match="distributed.strategy=auto or fsdp"):  # (ddp asked for: it says what fits)
        fitting_strategy(model, sharded, *args, ranks=8, strategy="ddp", trainer_process=True)
    assert fitting_strategy(model, local, *args, ranks=8, strategy="auto", trainer_process=False) == ("ddp", {})
    # colocated: one process, nothing to shard; where its replica does not fit and a trainer process's shards would
    # (Adam's state made the bulk), it names the schedule that fits
    model = dataclasses.replace(model, moment_bytes=400)
    sharded, local = needs(shards=8), needs(local=True)
    assert sharded < local
    with pytest.raises(ConfigError, match="scheduler=ebrl") as e:
        fitting_strategy(model, sharded, *args, ranks=8, strategy="auto", trainer_process=False)
    assert "\n" not in str(e.value)


def test_maniskill_holds_a_render_context_on_the_gpu_even_with_state_observations() -> None:
    # SAPIEN's Vulkan renderer is set up for state observations too; MuJoCo's EGL context only for cameras
    assert render_contexts(compose_config("env=maniskill", "env.cameras=[]").env)
    assert not render_contexts(compose_config("env=robosuite", "env.cameras=[]").env)
    assert render_contexts(compose_config("env=robosuite", "env.cameras=[agentview]").env)


def test_a_small_dev_shm_stops_the_run_with_the_size_it_needs() -> None:
    check_shared_memory(1)  # (this machine's has room for a byte)
    with pytest.raises(ConfigError) as e:
        check_shared_memory(2**50)
    message = str(e.value)
    assert "this run needs 1073741824 MB of shared memory" in message and "--shm-size=1310720g" in message


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_the_model_counts_the_trainers_prefix_cache_as_the_trainer_holds_it(variant: str) -> None:
    spec = make_spec(("agentview",), size=32)
    conf = policy_config("openpi", "policy.train=action_expert", f"policy.variant={variant}")
    model = MemoryModel.of(conf, spec, device="cpu")
    policy = build_policy(conf, spec, train=True)
    held = PPOTrainer(policy, compose_config().algo).prefixes(make_obs(policy, 6), 4)  # (6 rows, 4 at a time)
    sizes = []
    map_tensors(held, lambda t: sizes.append(t.numel() * t.element_size()))
    assert model.prefix_per_row > 0 and sum(sizes) == 6 * model.prefix_per_row
    assert model.trainer(1, 6).parts["prefix cache"] == 6 * model.prefix_per_row
    assert MemoryModel.of(conf, spec, device="cpu", cache_prefix=False).prefix_per_row == 0
    assert MemoryModel.of(policy_config("openpi"), spec, device="cpu").prefix_per_row == 0  # (it trains)
