"""OpenPIPolicy: shapes, Flow-Noise log-prob consistency, gradients, KV cache, sizes, flow matching, tokenizer."""
from __future__ import annotations

import pytest
import torch

from ebrl.config import ConfigError
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.openpi import OpenPIPolicy

STATE_DIM, ACTION_DIM = 10, 7


def make_spec(cameras: tuple[str, ...] = (), size: int = 64, state_dim: int = STATE_DIM) -> EnvSpec:
    obs = {"state": ArraySpec((state_dim,), "float32")}
    obs.update({f"image/{cam}": ArraySpec((size, size, 3), "uint8") for cam in cameras})
    return EnvSpec(obs=obs, action_dim=ACTION_DIM, instruction="lift the red cube", max_episode_steps=50)


def make_obs(policy: OpenPIPolicy, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = {"state": torch.randn(batch, policy.env_spec.obs["state"].shape[0], generator=g)}
    for key, spec in policy.env_spec.obs.items():
        if key.startswith("image/"):
            obs[key] = torch.randint(0, 256, (batch, *spec.shape), generator=g, dtype=torch.uint8)
    tokens, mask = policy.tokenize([policy.env_spec.instruction] * batch)
    obs["tokens"], obs["token_mask"] = torch.from_numpy(tokens), torch.from_numpy(mask)
    return obs


@pytest.fixture(scope="module", params=["state", "cameras"])
def policy(request: pytest.FixtureRequest) -> OpenPIPolicy:
    torch.manual_seed(0)
    return OpenPIPolicy(make_spec(("front", "wrist") if request.param == "cameras" else ()))


@pytest.mark.parametrize("batch", [1, 5])
def test_shapes(policy: OpenPIPolicy, batch: int) -> None:
    obs = make_obs(policy, batch)
    out = policy.sample(obs)
    horizon, steps, padded = policy.chunk_len, policy.denoise_steps, policy.dims.max_action_dim
    assert out.chunk.shape == (batch, horizon, ACTION_DIM)
    assert out.log_prob.shape == (batch, horizon) and out.value.shape == (batch,)
    assert out.extras["chain"].shape == (batch, steps + 1, horizon, padded)
    assert torch.equal(out.chunk, out.extras["chain"][:, -1, :, :ACTION_DIM])
    log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
    assert log_prob.shape == entropy.shape == (batch, horizon) and value.shape == (batch,)


def test_overrides_and_limits() -> None:
    policy = OpenPIPolicy(make_spec(), chunk=3, denoise_steps=2)
    out = policy.sample({"state": torch.zeros(2, STATE_DIM)})  # no tokens: the env's instruction is used
    assert out.chunk.shape == (2, 3, ACTION_DIM) and out.extras["chain"].shape[1] == 3
    with pytest.raises(ConfigError, match="policy.preset=tiny has max_state_dim=128 < env state dim 130"):
        OpenPIPolicy(make_spec(state_dim=130))
    with pytest.raises(ConfigError, match="policy.preset='huge' is not available"):
        OpenPIPolicy(make_spec(), preset="huge")


def test_evaluate_reproduces_sample(policy: OpenPIPolicy) -> None:
    obs = make_obs(policy, 6, seed=1)
    out = policy.sample(obs)
    log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
    assert torch.allclose(log_prob, out.log_prob, atol=1e-4)
    assert torch.allclose(value, out.value, atol=1e-5)
    assert torch.isfinite(entropy).all()
    # padded action dims stay in the chain but out of the log-density: the last step's are no input to anything
    chain = out.extras["chain"].clone()
    chain[:, -1, :, ACTION_DIM:] += 5.0
    assert torch.allclose(policy.evaluate(obs, out.chunk, {"chain": chain})[0], log_prob, atol=1e-5)


def test_gradients_reach_noise_velocity_and_value_heads(policy: OpenPIPolicy) -> None:
    obs = make_obs(policy, 4, seed=2)
    out = policy.sample(obs)
    policy.zero_grad()
    log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
    (-(log_prob.mean()) - 0.01 * entropy.mean() + value.pow(2).mean()).backward()
    for name in ("noise_std_head.2.weight", "action_out_proj.weight", "value_head.2.weight", "state_proj.weight"):
        grad = dict(policy.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    policy.zero_grad()


def test_kv_cache_equals_joint_forward() -> None:
    torch.manual_seed(0)
    policy = OpenPIPolicy(make_spec(("front",)))
    with torch.no_grad():  # the expert starts blind to the prefix (zero attention outputs); open it up
        for block in policy.expert_layers:
            block.o_proj.weight.normal_(std=0.05)
    obs = make_obs(policy, 3, seed=3)
    obs["token_mask"][1, 5:] = False  # padding in the middle of the prefix
    x = torch.randn(3, policy.chunk_len, policy.dims.max_action_dim)
    t = torch.tensor([1.0, 0.5, 0.25])
    with torch.no_grad():
        cache, _ = policy.encode_prefix(obs)
        cached, _ = policy.suffix_features(x, t, cache)
        prefix, mask = policy.embed_prefix(obs)
        suffix, _ = policy.embed_suffix(x, t)
        n_prefix, horizon = prefix.shape[1], x.shape[1]
        positions = torch.cat([mask.long().cumsum(1) - 1, mask.sum(1, keepdim=True) + torch.arange(horizon)], 1)
        block_mask = torch.zeros(3, n_prefix + horizon, n_prefix + horizon, dtype=torch.bool)
        block_mask[:, :, :n_prefix] = mask[:, None, :]  # everyone sees the real prefix tokens
        block_mask[:, n_prefix:, n_prefix:] = True  # only the suffix sees the suffix
        (_, joint), _ = policy.run_layers([(prefix, policy.layers), (suffix, policy.expert_layers)], positions,
                                          block_mask)
    assert torch.allclose(cached, policy.expert_norm(joint), atol=1e-5)


def test_parameter_counts() -> None:
    assert OpenPIPolicy(make_spec(("front", "wrist"))).num_parameters() < 1_000_000
    # pi0 has 3.3B parameters: PaliGemma 3B (SigLIP So400m + Gemma 2B) + a 300M action expert
    # (Black et al. 2024, "pi0: A Vision-Language-Action Flow Model for General Robot Control", sec. 3; openpi README)
    with torch.device("meta"):
        full = OpenPIPolicy(make_spec(("base", "left_wrist", "right_wrist"), size=224, state_dim=14), preset="full")
    assert all(p.is_meta for p in full.parameters())  # nothing allocated
    assert abs(full.num_parameters() - 3.3e9) / 3.3e9 < 0.05


def test_flow_matching_learns_a_mapping() -> None:
    torch.manual_seed(0)
    policy = OpenPIPolicy(make_spec())
    weights = torch.randn(STATE_DIM, ACTION_DIM, generator=torch.Generator().manual_seed(4))
    ramp = torch.linspace(-0.5, 0.5, policy.chunk_len)[None, :, None]
    target = lambda state: torch.tanh(state @ weights / 3)[:, None, :] + ramp  # noqa: E731  (B, H, A)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(200):
        state = torch.randn(16, STATE_DIM)
        loss = policy.flow_matching_loss({"state": state}, target(state))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) < 0.2 * sum(losses[:20])
    # it learned the obs -> action mapping, not only the action marginal: the wrong obs (same noise) does much worse
    state, shuffle = torch.randn(256, STATE_DIM), torch.randperm(256)
    with torch.no_grad():
        torch.manual_seed(1)
        matched = policy.flow_matching_loss({"state": state}, target(state))
        torch.manual_seed(1)
        shuffled = policy.flow_matching_loss({"state": state[shuffle]}, target(state))
    assert matched < 0.6 * shuffled, (matched, shuffled)


def test_tokenize() -> None:
    policy = OpenPIPolicy(make_spec())
    texts = ["pick up the cube", "déplacer le cube ✓", "x" * 100, ""]
    tokens, mask = policy.tokenize(texts)
    again, _ = policy.tokenize(texts)
    assert tokens.dtype.name == "int64" and mask.dtype == bool and tokens.shape == (4, policy.dims.max_tokens)
    assert (tokens == again).all()
    assert mask.sum(1).tolist() == [1 + 16, 1 + len("déplacer le cube ✓".encode()), policy.dims.max_tokens, 1]
    assert (tokens[~mask] == 0).all() and (tokens[mask] > 0).all() and tokens.max() < policy.dims.vocab
    assert bytes(int(i) - 3 for i in tokens[1, 1 : mask[1].sum()]).decode() == "déplacer le cube ✓"


def test_value_matches_sample_value():
    torch.manual_seed(0)
    spec = EnvSpec(obs={"state": ArraySpec((10,), "float32")}, action_dim=7, instruction="open the door",
                   max_episode_steps=10)
    policy = OpenPIPolicy(spec)
    obs = {"state": torch.randn(4, 10)}
    assert torch.allclose(policy.value(obs), policy.sample(obs).value)
