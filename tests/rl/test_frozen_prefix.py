"""The frozen prefix computed once per row (algo.cache_prefix) and the proximal pass only over stale rows
(algo.proximal): an update through them takes the steps the plain path takes."""

from __future__ import annotations

import copy

import pytest
import torch

from ebrl.policies.build import build_policy
from ebrl.rl.ppo import PPOTrainer
from ebrl.rl.rollout import ChunkStep, stack_steps
from tests.conftest import compose_config
from tests.policies.test_families import make_obs, make_spec
from tests.policies.test_precision import policy_config

FAMILIES = [("openpi", ()), ("openpi", ("policy.variant=pi05",)), ("gr00t", ())]
IDS = ["pi0", "pi05", "gr00t"]


def expert_policy(name: str, extra: tuple[str, ...], preset: str = "tiny", train: str = "action_expert"):
    torch.manual_seed(0)
    conf = policy_config(name, f"policy.preset={preset}", f"policy.train={train}", *extra)
    size = 32 if preset == "tiny" else 64
    return build_policy(conf, make_spec(("agentview",), size=size), train=True)


def rollout(policy, chunks: int = 3, envs: int = 4, versions: tuple[int, ...] | None = None):
    """`chunks` chunk steps of the policy's own samples on random observations (a camera and the state); chunk step
    t sampled by weights of version versions[t]."""
    gen = torch.Generator().manual_seed(1)
    steps = []
    for t in range(chunks):
        obs = make_obs(policy, envs, seed=t)
        out = policy.sample(obs)
        steps.append(
            ChunkStep(
                obs=obs,
                chunk=out.chunk,
                extras=out.extras,
                log_prob=out.log_prob,
                value=out.value,
                reward=torch.rand(envs, generator=gen),
                done=torch.zeros(envs, dtype=torch.bool),
                mask=torch.ones(envs, policy.chunk_len, dtype=torch.bool),
                cutoff_value=torch.zeros(envs),
                version=None if versions is None else torch.full((envs,), versions[t]),
            )
        )
    return stack_steps(steps, torch.zeros(envs))


def updated(policy, batch, *overrides: str, **how) -> tuple[dict[str, float], list[torch.Tensor]]:
    """An update of a copy of `policy` (2 epochs, 2 minibatches of micro-batches of 5 rows: an uneven split)."""
    policy = copy.deepcopy(policy)
    algo = compose_config("algo.epochs=2", "algo.minibatches=2", "algo.micro_batch=5", *overrides).algo
    torch.manual_seed(2)  # (the minibatches' permutation)
    metrics = PPOTrainer(policy, algo).update(batch, **how)
    return metrics, [p.detach().clone() for p in policy.parameters()]


def assert_same_update(a: tuple[dict, list], b: tuple[dict, list]) -> None:
    (ma, pa), (mb, pb) = a, b
    for key in ("losses/policy", "losses/value", "losses/entropy", "train/approx_kl", "train/grad_norm"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(pa, pb))


@pytest.mark.parametrize("preset", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family, extra", FAMILIES, ids=IDS)
def test_the_cached_prefix_takes_the_steps_the_recomputed_one_takes(family, extra, preset) -> None:
    policy = expert_policy(family, extra, preset)
    assert policy.frozen_prefix()
    batch = rollout(policy)
    cached = updated(policy, batch, decoupled=True)
    plain = updated(policy, batch, "algo.cache_prefix=false", decoupled=True)
    assert cached[0]["train/cached_prefix"] == 1.0 and plain[0]["train/cached_prefix"] == 0.0
    assert_same_update(cached, plain)
    # and the gradient of one pass over a micro-batch, the prefix given or run
    rows = {k: v[0] for k, v in batch.obs.items()}
    trainer = PPOTrainer(policy, compose_config().algo)
    prefix = trainer.prefixes(rows, 2)  # (computed 2 rows at a time, then joined)
    grads = []
    for given in (prefix, None):
        policy.zero_grad(set_to_none=True)
        lp, entropy, value = policy.evaluate(
            rows, batch.chunk[0], {k: v[0] for k, v in batch.extras.items()}, prefix=given
        )
        (lp.sum() + entropy.sum() + value.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("train", ["all", "lora"])
def test_a_trained_prefix_is_run_in_every_pass(train) -> None:
    policy = expert_policy("openpi", (), train=train)
    assert not policy.frozen_prefix()
    assert updated(policy, rollout(policy, chunks=2))[0]["train/cached_prefix"] == 0.0


def test_the_proximal_pass_values_only_rows_older_weights_sampled() -> None:
    policy = expert_policy("openpi", ())
    batch = rollout(policy, versions=(6, 7, 7))  # the update starts from version 7: the first chunk step is stale
    stale_only, every = (
        updated(policy, batch, decoupled=True, version=7),
        updated(policy, batch, "algo.proximal=all", decoupled=True, version=7),
    )
    assert stale_only[0]["train/proximal_rows"] == 4 and every[0]["train/proximal_rows"] == 12
    # in float32 the fresh rows' behaviour log-probs are what the pass would give (to float error): the same update
    assert_same_update(stale_only, every)
    assert updated(policy, batch, decoupled=True)[0]["train/proximal_rows"] == 12  # (no version: every row)
