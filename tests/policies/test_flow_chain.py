"""The flow families' stochastic chain as RLinf's pi0 recipes run it (`policy.chain_logprob`, Flow-SDE's step, the
critic's detached input), on tiny pi0: each mode's log-prob is reproduced by evaluate, and the formulas are checked
against a transcription of RLinf's own (rlinf/models/embodiment/openpi/openpi_action_model.py, a3816b5)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.test_families import build, make_obs

MODES = [(chain, noise) for chain in ("sum", "mean", "one_step") for noise in ("flow_noise", "flow_sde")]


def policy_of(chain: str, logprob: str = "flow_sde", **overrides):
    torch.manual_seed(0)
    return build("openpi", (f"policy.chain_logprob={chain}", f"policy.logprob={logprob}"), **overrides)


@pytest.mark.parametrize("chain,logprob", MODES, ids=[f"{c}-{n}" for c, n in MODES])
def test_evaluate_reproduces_each_modes_log_prob(chain: str, logprob: str) -> None:
    policy = policy_of(chain, logprob)
    obs = make_obs(policy, 5, seed=1)
    out = policy.sample(obs)
    log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
    assert torch.allclose(log_prob, out.log_prob, atol=1e-4, rtol=1e-5)
    assert torch.allclose(value, out.value, atol=1e-6) and torch.isfinite(entropy).all()


def test_one_step_is_euler_but_at_one_step_whose_density_is_the_log_prob() -> None:
    policy = policy_of("one_step")
    obs = make_obs(policy, 4, seed=2)
    torch.manual_seed(3)
    out = policy.sample(obs)
    chain, index = out.extras["chain"], out.extras["denoise_index"]
    assert (index == index[0]).all()  # one step per sampled batch, as RLinf draws it
    k, steps = int(index[0]), policy.denoise_steps
    cond, _ = policy.encode(obs)
    times = policy.times(steps, chain.device)
    for j in range(steps):
        euler = policy.euler(chain[:, j], times[j].expand(4), cond)
        stochastic = not torch.allclose(euler, chain[:, j + 1], atol=1e-6)
        assert stochastic == (j == k), j
    mean, log_std = policy.step(chain[:, k], times[k].expand(4), cond)
    assert torch.allclose(out.log_prob, policy.log_density(chain[:, k + 1], mean, log_std), atol=1e-5)
    # the draws over many batches land on every step
    seen = {int(policy.sample(obs).extras["denoise_index"][0]) for _ in range(40)}
    assert seen == set(range(steps))


def test_mean_is_rlinfs_joint_log_prob_the_steps_and_x0_averaged() -> None:
    summed, averaged = policy_of("sum", "flow_noise"), policy_of("mean", "flow_noise")
    averaged.load_state_dict(summed.state_dict())
    obs = make_obs(summed, 3, seed=4)
    out = summed.sample(obs)
    total = summed.evaluate(obs, out.chunk, out.extras)[0]
    x0 = out.extras["chain"][:, 0, :, : summed.model_action_dim]
    x0_density = (-0.5 * x0.pow(2) - 0.5 * math.log(2 * math.pi)).sum(-1)
    want = (total + x0_density) / (summed.denoise_steps + 1)
    assert torch.allclose(averaged.evaluate(obs, out.chunk, out.extras)[0], want, atol=1e-5)


def rlinf_flow_sde(x_t: torch.Tensor, v_t: torch.Tensor, idx: int, steps: int, noise_level: float):
    """RLinf's sample_mean_var_val for flow_sde: its timesteps, sigmas (the t = 1 denominator replaced by the second
    step's time) and the x0/x1 predictions' weights."""
    timesteps = torch.cat([torch.linspace(1, 1 / steps, steps), torch.zeros(1)])
    t, delta = timesteps[idx], timesteps[idx] - timesteps[idx + 1]
    x0_pred, x1_pred = x_t - v_t * t, x_t + v_t * (1 - t)
    denom = torch.where(timesteps == 1, timesteps[1], timesteps)
    sigma = (noise_level * torch.sqrt(timesteps / (1 - denom)))[:-1][idx]
    mean = x0_pred * (1 - (t - delta)) + x1_pred * (t - delta - sigma**2 * delta / (2 * t))
    return mean, torch.sqrt(delta) * sigma


@pytest.mark.parametrize("steps", [4, 10])
def test_flow_sde_step_is_rlinfs(steps: int) -> None:
    policy = policy_of("one_step", denoise_steps=steps, sde_noise_level=0.5)
    obs = make_obs(policy, 2, seed=5)
    cond, _ = policy.encode(obs)
    x = torch.randn(2, policy.chunk_len, policy.flow_dim)
    for idx in range(steps):
        t = policy.times(steps, x.device)[idx].expand(2)
        v, _ = policy.velocity(x, t, cond)
        mean, log_std = policy.step(x, t, cond)
        want_mean, want_std = rlinf_flow_sde(x, v, idx, steps, 0.5)
        assert torch.allclose(mean, want_mean, atol=1e-5), idx
        assert torch.allclose(log_std.exp(), want_std.expand_as(log_std), atol=1e-6), idx


@pytest.mark.parametrize("detach", [False, True])
def test_a_detached_critic_input_trains_the_value_head_alone(detach: bool) -> None:
    policy = policy_of("one_step", detach_critic_input=detach)
    obs = make_obs(policy, 3, seed=6)
    out = policy.sample(obs)
    policy.zero_grad()
    policy.evaluate(obs, out.chunk, out.extras)[2].pow(2).sum().backward()
    moved = {
        name.split(".")[0] for name, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }
    assert "value_head" in moved
    assert (moved == {"value_head"}) == detach, moved
