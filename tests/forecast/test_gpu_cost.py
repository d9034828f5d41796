"""The GPU cost model's counts and roofline on cases whose answer is known: a linear layer's FLOPs and bytes,
attention as one kernel, which operations backward runs for; the interpolation in rows against a direct count on a
real policy; a call's time at an SM share and under the host's floor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ebrl.bench.memory import env_spec
from ebrl.forecast.gpu_cost import GPUS, GpuSpec, Ops, PolicyOps, UpdateShape, count_ops, roofline, train_time


def test_a_linear_layer_attention_and_what_backward_runs_for():
    frozen = torch.nn.Linear(64, 32, device="meta")
    frozen.requires_grad_(False)
    trained = torch.nn.Linear(32, 16, device="meta", bias=False)
    x = torch.empty(4, 64, device="meta")
    flops, nbytes, grad = count_ops(lambda: trained(frozen(x)))
    assert flops.tolist() == [2 * 4 * 64 * 32, 2 * 4 * 32 * 16]  # (addmm, mm)
    # addmm reads bias, input, weight and writes the output; float32 throughout
    assert nbytes[0] == 4 * (32 + 4 * 64 + 64 * 32 + 4 * 32)
    assert grad.tolist() == [False, True]
    q = torch.empty(2, 8, 10, 16, device="meta")
    k = v = torch.empty(2, 8, 12, 16, device="meta")
    flops, nbytes, _ = count_ops(lambda: F.scaled_dot_product_attention(q, k, v))
    assert flops.tolist() == [4 * 2 * 8 * 10 * 12 * 16]  # one kernel, not the decomposition underneath
    assert nbytes.tolist() == [4 * (2 * q.numel() + 2 * k.numel())]


def test_a_calls_time_at_a_share_and_under_the_hosts_floor():
    gpu = GpuSpec(
        "test", bf16_flops=1e12, hbm_bytes_per_s=1e9, nvlink_bytes_per_s=1e9, sm_count=100, memory_gb=1, source="-"
    )
    # two operations, each the same at any rows: 1e9 FLOPs (1 ms, compute-bound) and 1e6 bytes (1 ms, memory-bound)
    ops = Ops((np.array([1e9, 0.0]),) * 2, (np.array([0.0, 1e6]),) * 2, np.array([False, False]))
    assert roofline(ops, 1, gpu, 1.0, 0.0).seconds == pytest.approx(2e-3)
    half = roofline(ops, 1, gpu, 0.5, 0.0)
    assert half.seconds == pytest.approx(4e-3) and half.sm_busy == pytest.approx(0.5)
    floored = roofline(ops, 1, gpu, 1.0, 3e-3)  # the host issues each in 3 ms: the SMs wait 2 of every 3
    assert floored.seconds == pytest.approx(6e-3) and floored.sm_busy == pytest.approx(1 / 3)


def test_a_policys_operations_are_linear_in_rows():
    from omegaconf import OmegaConf

    from ebrl.bench.memory import compose

    policy_cfg = OmegaConf.to_container(compose("policy=openpi", "policy.preset=small").policy, resolve=True)
    ops = PolicyOps.of(policy_cfg, env_spec(1), device="cpu")
    assert ops.sample.count > 100 and ops.forward.grad.any() and not ops.sample.grad.any()
    from ebrl.alloc.memory import meta_obs
    from ebrl.policies.build import build_policy

    policy = build_policy(policy_cfg, env_spec(1), "meta", train=False, weights="given")
    with torch.no_grad():
        flops, nbytes, _ = count_ops(lambda: policy.sample(meta_obs(policy, env_spec(1), 7)))
    at7 = ops.sample.at(7)
    assert at7[0].sum() == pytest.approx(flops.sum()) and at7[1].sum() == pytest.approx(nbytes.sum())
    bare = [roofline(ops.sample, b, GPUS["H200"], 1.0, 0.0).seconds for b in (1, 8, 64)]
    assert bare[0] < bare[1] < bare[2]
    # a few M parameters: every kernel is shorter than the host's time to issue it, at 8 rows as at 1
    hosted = [roofline(ops.sample, b, GPUS["H200"], 1.0, 5e-6) for b in (1, 8)]
    assert hosted[0].seconds == hosted[1].seconds == pytest.approx(ops.sample.count * 5e-6)

    # an update's gradients go round a ring of the ranks: over NVLink within a node, over the network across nodes
    algo = compose("algo.epochs=1", "algo.minibatches=1").algo
    h100 = GPUS["H100-SXM5-80GB"]
    alone = train_time(ops, 64, UpdateShape(algo), h100, 1.0, 0.0).seconds
    ring = lambda n, link: 2 * (n - 1) / n * ops.trained * 4 / link  # noqa: E731
    within = train_time(ops, 64, UpdateShape(algo, ranks=8), h100, 1.0, 0.0).seconds
    across = train_time(ops, 64, UpdateShape(algo, ranks=16, nodes=2), h100, 1.0, 0.0).seconds
    assert within - alone == pytest.approx(ring(8, h100.nvlink_bytes_per_s / 2))
    assert across - alone == pytest.approx(ring(16, h100.node_link_bytes_per_s))
    # the proximal pass (decoupled PPO's stale rows, a bfloat16 update's every row) first runs the trainer's forward
    decoupled = train_time(ops, 64, UpdateShape(algo), h100, 1.0, 0.0, proximal=64).seconds
    assert decoupled - alone == pytest.approx(roofline(ops.forward, 64, h100, 1.0, 0.0).seconds)


def test_a_frozen_prefix_is_charged_once_per_row() -> None:
    from omegaconf import OmegaConf

    from ebrl.bench.memory import compose

    algo = ("algo.epochs=4", "algo.minibatches=2", "algo.micro_batch=16")
    cfg = compose("policy=openpi", "policy.preset=small", "policy.train=action_expert", *algo)
    ops = PolicyOps.of(OmegaConf.to_container(cfg.policy, resolve=True), env_spec(1), device="cpu")
    assert ops.prefix is not None and ops.cached.count < ops.forward.count and not ops.prefix.grad.any()
    assert not ops.checkpointing
    h100 = GPUS["H100-SXM5-80GB"]
    cached = train_time(ops, 64, UpdateShape(cfg.algo), h100, 1.0, 0.0).seconds
    plain = train_time(ops, 64, UpdateShape(compose(*algo, "algo.cache_prefix=false").algo), h100, 1.0, 0.0).seconds
    once = sum(roofline(ops.prefix, 16, h100, 1.0, 0.0).seconds for _ in range(4))  # (64 rows, 16 at a time)
    pass_ = lambda o: sum(
        roofline(o, 16, h100, 1.0, 0.0, only_grad=g, factor=f).seconds  # noqa: E731
        for g, f in ((False, 1.0), (True, 2.0))
    )  # a forward and its backward
    assert cached - plain == pytest.approx(once + 4 * 4 * (pass_(ops.cached) - pass_(ops.forward)), rel=1e-6)
    assert cached < plain
