"""The trainer at full size: micro-batches that add up to one optimizer step, Adam with bfloat16 moments, and a
bfloat16 policy's ratio taken against the trainer's own numbers."""

from __future__ import annotations

import pytest
import torch

from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.build import build_policy
from ebrl.rl.optim import LowPrecisionAdam, make_optimizer, stochastic_round
from ebrl.rl.ppo import PPOTrainer, _flat
from tests.conftest import compose_config
from tests.policies.test_precision import policy_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout


def gradients(policy, trainer: PPOTrainer, batch, rows: int, decoupled: bool) -> dict[str, torch.Tensor]:
    """The gradient of the whole rollout as one minibatch, `rows` rows per backward pass."""
    obs = {k: _flat(v) for k, v in batch.obs.items()}
    extras = {k: _flat(v) for k, v in batch.extras.items()}
    chunk, old_lp, mask = _flat(batch.chunk), _flat(batch.log_prob), _flat(batch.mask)
    behaviour = None
    if decoupled:
        behaviour, (old_lp, _) = old_lp, trainer.proximal(obs, chunk, extras, rows)
    adv, ret, _ = trainer.advantages(batch)
    idx = torch.arange(chunk.shape[0])
    policy.zero_grad(set_to_none=True)
    critic = (_flat(ret), _flat(batch.value))
    trainer._accumulate(idx, idx.split(rows), obs, chunk, extras, old_lp, behaviour, _flat(adv), critic, mask, 2.0)
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("decoupled", [False, True])
def test_micro_batched_gradients_equal_the_unbatched_one(decoupled: bool) -> None:
    torch.manual_seed(0)
    policy = build_policy(policy_config("openpi"), LIFT_SPEC, train=True)
    # (with the full-size recipe's losses: asymmetric ratio clip, clipped Huber value loss)
    trainer = PPOTrainer(
        policy,
        compose_config(
            "algo.minibatches=1",
            "algo.value_coef=0.5",
            "algo.entropy_coef=0.01",
            "algo.clip_high=0.28",
            "algo.value_clip=0.2",
            "algo.huber_delta=1.0",
        ).algo,
    )
    batch = one_episode_rollout(policy, chunks=3, num_envs=4)  # 12 rows, env 0's later rows execute nothing
    whole = gradients(policy, trainer, batch, 12, decoupled)
    for rows in (1, 5):  # (5: an uneven split, 5 + 5 + 2)
        parts = gradients(policy, trainer, batch, rows, decoupled)
        assert parts.keys() == whole.keys()
        for key, grad in whole.items():
            assert torch.allclose(parts[key], grad, atol=1e-6, rtol=1e-4), (rows, key)


def test_an_update_does_not_depend_on_the_micro_batch() -> None:
    results = []
    for micro in ("null", "3"):
        torch.manual_seed(0)
        policy = build_policy(policy_config("openpi"), LIFT_SPEC, train=True)
        batch = one_episode_rollout(policy, chunks=3, num_envs=4)
        torch.manual_seed(1)
        algo = compose_config(f"algo.micro_batch={micro}", "algo.minibatches=2").algo
        metrics = PPOTrainer(policy, algo).update(batch)
        results.append((metrics, [p.detach().clone() for p in policy.parameters()]))
    (m1, p1), (m2, p2) = results
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(p1, p2))
    for key in ("losses/policy", "losses/value", "train/approx_kl", "train/clipfrac"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key


# AdamW's decoupled decay too (with RLinf's beta2 = 0.95 this problem converges to 5e-6 by step 599, where the
# moments' rounding, not the decay, sets the loss)
@pytest.mark.parametrize("betas, weight_decay", [((0.9, 0.999), 0.0), ((0.9, 0.999), 0.01)])
def test_adam_with_bfloat16_moments_halves_them_and_follows_float32_adam(betas, weight_decay) -> None:
    torch.manual_seed(0)
    target = torch.randn(64, 32)
    inputs = torch.randn(256, 64)
    losses = {}
    for moments in ("float32", "bfloat16"):
        weight = torch.nn.Parameter(torch.zeros(64, 32))
        optimizer = make_optimizer([weight], lr=1e-2, moments=moments, betas=betas, weight_decay=weight_decay)
        assert isinstance(optimizer, LowPrecisionAdam) == (moments == "bfloat16")
        curve = []
        for _ in range(600):
            loss = (inputs @ weight - inputs @ target).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
        losses[moments] = curve
        state = optimizer.state[weight]
        bytes_ = sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
        assert bytes_ == 2 * weight.numel() * (4 if moments == "float32" else 2)
    low, full = losses["bfloat16"], losses["float32"]
    assert full[-1] < 1e-3 * full[0]  # (measured: 68.4 -> 0.042, and 0.041 with bfloat16 moments)
    assert all(low[i] == pytest.approx(full[i], rel=0.05) for i in (100, 300, 599))


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 1.0 + 2**-10)  # between two bfloat16 values (1 and 1 + 2^-7): 1/8 of the way up
    rounded = stochastic_round(x).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float(rounded.mean()) == pytest.approx(1.0 + 2**-10, abs=2e-5)


def test_bfloat16_moments_decay_as_adams_do() -> None:
    """v <- 0.999 v + 0.001 g^2 moves v by less than half a bfloat16 step: rounded to nearest, v would never decay
    once the gradients shrink (it would stay near 0.095 here); stochastically rounded it follows float32's."""
    moments = {}
    for kind in ("float32", "bfloat16"):
        weight = torch.nn.Parameter(torch.zeros(10_000))
        optimizer = make_optimizer([weight], lr=1e-6, moments=kind)
        for step in range(2100):
            weight.grad = torch.full_like(weight, 1.0 if step < 100 else 0.01)
            optimizer.step()
        moments[kind] = optimizer.state[weight]["exp_avg_sq"].float().mean()
    decayed = (1 - 0.999**100) * 0.999**2000 + 1e-4 * (1 - 0.999**2000)
    assert float(moments["float32"]) == pytest.approx(decayed, rel=1e-3)
    assert float(moments["bfloat16"]) == pytest.approx(float(moments["float32"]), rel=0.02)


def test_bfloat16_moments_round_alike_whatever_else_draws_and_resume_where_they_were(tmp_path) -> None:
    """Replicas (DDP) step alike only if their rounding draws alike: it comes from the optimizer's own generator, not
    the global one each rank seeds and draws from its own way; a checkpoint carries it."""

    def replica(global_seed: int) -> tuple[torch.nn.Parameter, LowPrecisionAdam]:
        torch.manual_seed(global_seed)
        weight = torch.nn.Parameter(torch.ones(4096))
        return weight, make_optimizer([weight], lr=1e-3, moments="bfloat16")

    def steps(weight: torch.nn.Parameter, optimizer: LowPrecisionAdam, n: int, draws: int) -> None:
        for step in range(n):
            torch.rand(draws)  # generation's draws: uneven over the ranks
            weight.grad = torch.linspace(-1.0, 1.0, 4096) * (step + 1) / 3
            optimizer.step()

    (w0, opt0), (w1, opt1) = replica(0), replica(7919)
    steps(w0, opt0, 3, draws=5)
    steps(w1, opt1, 3, draws=11)
    torch.save({"optimizer": opt1.state_dict()}, tmp_path / "last.pt")
    w2, opt2 = replica(1)
    w2.data.copy_(w1.data)
    opt2.load_state_dict(torch.load(tmp_path / "last.pt", weights_only=False)["optimizer"])
    for weight, optimizer, draws in ((w0, opt0, 1), (w1, opt1, 2), (w2, opt2, 3)):
        steps(weight, optimizer, 2, draws)
    for name in ("exp_avg", "exp_avg_sq"):
        assert opt2.state[w2][name].dtype == torch.bfloat16  # (torch's load makes them the parameter's float32)
        assert torch.equal(opt0.state[w0][name], opt1.state[w1][name])
        assert torch.equal(opt0.state[w0][name], opt2.state[w2][name])
    assert torch.equal(w0, w1) and torch.equal(w0, w2)


def test_a_bfloat16_policy_takes_its_ratio_against_the_trainers_own_pass() -> None:
    """Generation's bfloat16 numbers differ from the trainer's pass by ~0.1 in log-prob per action; the trainer
    recomputes the old log-probs, so the first step's ratio is 1 up to the pass's own rounding."""
    torch.manual_seed(0)
    policy = build_policy(policy_config("openpi", "policy.dtype=bfloat16"), LIFT_SPEC, train=True)
    batch = one_episode_rollout(policy, chunks=2, num_envs=4)
    algo = compose_config("algo.lr=1e-12", "algo.epochs=1", "algo.minibatches=1").algo
    metrics = PPOTrainer(policy, algo).update(batch)
    assert metrics["train/approx_kl"] < 1e-4 and metrics["train/clipfrac"] == 0.0, metrics


@pytest.mark.slow
def test_the_full_preset_trains_its_action_expert_at_micro_batch_1() -> None:
    """pi0 at its published shapes (state-only: no vision tower), bfloat16 with float32 masters of the expert,
    checkpointed, built as the trainer builds it: one PPO update of 2 rows, one row per backward pass; the expert
    and the heads move, the frozen backbone does not."""
    from ebrl.bench.memory import fill

    torch.manual_seed(0)
    spec = EnvSpec(
        obs={"state": ArraySpec((8,), "float32")},
        action_dim=7,
        instruction="put the bowl on the plate",
        max_episode_steps=520,
    )  # LIBERO's state and actions
    policy = build_policy(
        policy_config("openpi", "policy.preset=full", "policy.train=action_expert"), spec, train=True, weights="given"
    )
    fill(policy)
    assert policy.compute_dtype == torch.bfloat16 and policy.vlm.layers[0].grad_checkpoint
    before = {
        n: p.detach().clone()
        for n, p in policy.named_parameters()
        if n.startswith(
            (
                "paligemma_with_expert.paligemma.model.language_model.layers.0.mlp.",
                "paligemma_with_expert.gemma_expert.model.layers.0.mlp.",
                "value_head.",
            )
        )
    }
    batch = one_episode_rollout(policy, chunks=1, num_envs=2)
    algo = compose_config("algo.epochs=1", "algo.minibatches=1", "algo.micro_batch=1").algo
    metrics = PPOTrainer(policy, algo).update(batch)
    assert metrics["train/nonfinite_steps"] == 0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    for name, old in before.items():
        moved = not torch.equal(old, dict(policy.named_parameters())[name])
        assert moved == (not name.startswith("paligemma_with_expert.paligemma.")), name
