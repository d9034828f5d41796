"""How a run builds and runs a policy: policy.dtype (bfloat16 compute, float32 chains and densities), the padded
action dims of the flow chain, activation checkpointing, and builds whose weights are given (no init, no fit)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ebrl.policies.build import build_policy, policy_dtype
from ebrl.policies.flow import FlowPolicy
from tests.conftest import compose_config
from tests.policies.test_families import ACTION_DIM, make_obs, make_spec

FAMILIES = ["openpi", "gr00t", "wam", "openvla_oft"]


def policy_config(name: str, *overrides: str) -> dict:
    return OmegaConf.to_container(compose_config(f"policy={name}", *overrides).policy, resolve=True)


def factors(policy) -> int:
    """Gaussian factors in one action's log-prob: a step per denoising step and env action dim."""
    return ACTION_DIM * (policy.denoise_steps if isinstance(policy, FlowPolicy) else 1)


def test_the_dtype_follows_the_preset_and_the_device() -> None:
    assert policy_dtype(policy_config("openpi"), "cpu") == torch.float32
    assert policy_dtype(policy_config("openpi", "policy.preset=full"), "cpu") == torch.bfloat16
    assert policy_dtype(policy_config("openpi"), "cuda") == torch.bfloat16
    assert policy_dtype(policy_config("openpi", "policy.dtype=float32"), "cuda") == torch.float32


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_log_probs_match_float32(name: str) -> None:
    """The same weights held in bfloat16 (as generation holds them) score a chunk's actions within 0.01 per Gaussian
    factor of float32, on average (measured: 0.005-0.007 for the flow families' tiny presets, 0.0006 for
    OpenVLA-OFT); what they return, and the chain, are float32."""
    spec = make_spec(("front",))
    torch.manual_seed(0)
    fp32 = build_policy(policy_config(name), spec)
    bf16 = build_policy(policy_config(name, "policy.dtype=bfloat16"), spec, weights="given")
    bf16.load_state_dict(fp32.state_dict())
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    obs = make_obs(fp32, 8)
    out = fp32.sample(obs)
    with torch.no_grad():
        reference = fp32.evaluate(obs, out.chunk, out.extras)
        low = bf16.evaluate(obs, out.chunk, out.extras)
    assert all(t.dtype == torch.float32 for t in low)
    error = (low[0] - reference[0]).abs().mean() / factors(fp32)
    assert error < 0.01, float(error)
    assert torch.allclose(low[2], reference[2], atol=0.05)
    sampled = bf16.sample(obs)
    assert sampled.log_prob.dtype == torch.float32 and all(v.dtype == torch.float32 for v in sampled.extras.values())


def test_padded_action_dims_follow_their_straight_path() -> None:
    """The dims past the env's carry no injected noise: t x_0 at every step, whatever the weights say for them, so
    they add nothing to the density and bias nothing."""
    torch.manual_seed(0)
    policy = build_policy(policy_config("openpi"), make_spec())
    obs = make_obs(policy, 3)
    torch.manual_seed(5)
    out = policy.sample(obs)
    chain, steps = out.extras["chain"], policy.denoise_steps
    start = chain[:, 0, :, ACTION_DIM:]
    for k in range(1, steps + 1):
        assert torch.equal(chain[:, k, :, ACTION_DIM:], (1.0 - k / steps) * start)
    with torch.no_grad():  # what the weights would make of the padded dims no longer matters
        policy.velocity_out.weight[ACTION_DIM:].normal_()
        policy.velocity_out.bias[ACTION_DIM:].normal_()
    torch.manual_seed(5)
    again = policy.sample(obs)
    assert torch.equal(again.chunk, out.chunk) and torch.equal(again.log_prob, out.log_prob)


@pytest.mark.parametrize("name", FAMILIES)
def test_activation_checkpointing_keeps_the_gradients_and_stores_less(name: str) -> None:
    spec = make_spec(("front",))
    torch.manual_seed(0)
    plain = build_policy(policy_config(name), spec, train=True)
    checkpointed = build_policy(policy_config(name, "policy.grad_checkpoint=true"), spec, train=True, weights="given")
    checkpointed.load_state_dict(plain.state_dict())
    obs = make_obs(plain, 3)
    out = plain.sample(obs)
    grads, stored = [], []
    for policy in (plain, checkpointed):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
        (log_prob.mean() + value.pow(2).mean()).backward()
        grads.append({n: p.grad for n, p in policy.named_parameters() if p.grad is not None})
        stored.append(sum(saved))
    assert grads[0].keys() == grads[1].keys()
    for key, grad in grads[0].items():
        assert torch.allclose(grads[1][key], grad, atol=1e-6, rtol=1e-4), key
    assert stored[1] < 0.7 * stored[0], stored


def test_a_build_with_given_weights_initialises_nothing(monkeypatch) -> None:
    """No fit of the first policy (and, built on the meta device, no random init of a real tensor): the trainer,
    generation and a resumed run load every weight themselves (the full preset's init and fit took minutes here)."""
    monkeypatch.setattr(FlowPolicy, "init_contracting_velocity", lambda *a, **k: pytest.fail("fitted"))
    for name in ("openpi", "gr00t", "wam"):  # (an init build of these fits: the spy would fail it)
        policy = build_policy(policy_config(name), make_spec(), weights="given")
        assert all(not p.is_meta for p in policy.parameters())
    for name in ("openpi", "gr00t", "wam"):
        policy = build_policy(
            policy_config(name, "policy.preset=full"), make_spec(("base",), size=224), weights="given", device="meta"
        )
        assert all(p.dtype == torch.bfloat16 for p in policy.parameters())


def test_a_published_checkpoint_without_rl_heads_gets_them_initialised(tmp_path) -> None:
    spec = make_spec()
    torch.manual_seed(0)
    source = build_policy(policy_config("openpi"), spec)
    heads = tuple(source.rl_heads())
    save_file(
        {k: v for k, v in source.state_dict().items() if not k.startswith(heads)}, str(tmp_path / "model.safetensors")
    )
    loaded = build_policy(policy_config("openpi", f"policy.checkpoint={tmp_path / 'model.safetensors'}"), spec)
    for key, value in source.state_dict().items():
        if not key.startswith(heads):
            assert torch.equal(loaded.state_dict()[key], value), key
    last = loaded.noise_std_head[-1]  # as the constructor leaves it: the std at the bounds' geometric mean
    assert not last.weight.any() and not last.bias.any()
    assert torch.isfinite(loaded.value_head[0].weight).all() and loaded.value_head[0].weight.std() > 0
