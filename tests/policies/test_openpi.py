"""What is particular to openpi: the prefix cache equals pi0/pi0.5's joint attention, real checkpoint layouts load,
pi0.5's discrete state, flow matching learns an obs -> action mapping, the byte tokenizer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ebrl.config import ConfigError
from ebrl.policies.layers import run_layers
from ebrl.policies.openpi import OpenPIPolicy
from ebrl.policies.weights import CheckpointError, load_weights
from tests.policies.test_families import ACTION_DIM, STATE_DIM, learns_state_mapping, make_obs, make_spec


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_prefix_cache_equals_the_joint_forward(variant: str) -> None:
    torch.manual_seed(0)
    policy = OpenPIPolicy(make_spec(("front",)), variant=variant)
    with torch.no_grad():  # the expert starts blind to the prefix (closed residual branches); open it up
        for layer in policy.expert.layers:
            layer.self_attn.o_proj.weight.normal_(std=0.05)
            if variant == "pi05":
                layer.input_layernorm.dense.weight.normal_(std=0.05)
                layer.post_attention_layernorm.dense.weight.normal_(std=0.05)
    obs = make_obs(policy, 3, seed=3)
    obs["token_mask"][1, 5:] = False  # padding in the middle of the prefix
    x = torch.randn(3, policy.chunk_len, policy.flow_dim)
    t = torch.tensor([1.0, 0.5, 0.25])
    with torch.no_grad():
        cache, _ = policy.encode(obs)
        cached, _ = policy.features(x, t, cache)
        # openpi's joint forward: prefix (bidirectional), then [pi0's state token], then the action tokens; a later
        # block sees the earlier ones, never the other way round; padding is seen by no one
        prefix, mask = policy.embed_prefix(obs)
        actions, cond, _ = policy.embed_suffix(x, t)
        suffix, blocks = actions, [torch.ones(3, policy.chunk_len, dtype=torch.long)]
        if variant == "pi0":
            state = policy.state_proj(torch.nn.functional.pad(obs["state"], (0, 128 - STATE_DIM)))[:, None]
            suffix, blocks = torch.cat([state, actions], 1), [torch.ones(3, 1, dtype=torch.long), blocks[0] * 2]
        block = torch.cat([torch.zeros_like(mask, dtype=torch.long), *blocks], 1)
        real = torch.cat([mask, torch.ones(3, suffix.shape[1], dtype=torch.bool)], 1)
        joint_mask = (block[:, None, :] <= block[:, :, None]) & real[:, None, :]
        positions = real.long().cumsum(1) - 1
        (_, joint), _ = run_layers(
            [(prefix, policy.vlm.layers, None), (suffix, policy.expert.layers, cond)], positions, joint_mask
        )
        joint = policy.expert.final_norm(joint[:, -policy.chunk_len :], cond)
    assert torch.allclose(cached, joint, atol=1e-5)


# the public pi0 PyTorch layout (openpi's port; lerobot saves it under "model."): a few keys of each part
PI0_KEYS = [
    "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight",
    "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.position_embedding.weight",
    "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.1.self_attn.out_proj.bias",
    "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0.mlp.fc2.weight",
    "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.post_layernorm.weight",
    "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight",
    "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
    "model.paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.k_proj.weight",
    "model.paligemma_with_expert.paligemma.model.language_model.layers.0.mlp.gate_proj.weight",
    "model.paligemma_with_expert.paligemma.model.language_model.layers.0.post_attention_layernorm.weight",
    "model.paligemma_with_expert.paligemma.model.language_model.norm.weight",
    "model.paligemma_with_expert.gemma_expert.model.layers.1.self_attn.o_proj.weight",
    "model.paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight",
    "model.paligemma_with_expert.gemma_expert.model.norm.weight",
    "model.state_proj.weight",
    "model.action_in_proj.bias",
    "model.action_out_proj.weight",
    "model.action_time_mlp_in.weight",
    "model.action_time_mlp_out.bias",
]
PI05_KEYS = [
    "model.paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.weight",
    "model.paligemma_with_expert.gemma_expert.model.layers.1.post_attention_layernorm.dense.bias",
    "model.paligemma_with_expert.gemma_expert.model.norm.dense.weight",
    "model.time_mlp_in.weight",
    "model.time_mlp_out.bias",
    "model.action_in_proj.weight",
]


def published_layout(policy: OpenPIPolicy) -> dict[str, torch.Tensor]:
    """The policy's weights as a lerobot pi0/pi0.5 checkpoint would hold them: "model." prefix, the text heads, no
    RL heads."""
    state = {
        f"model.{k}": v.clone() for k, v in policy.state_dict().items() if not k.startswith(tuple(policy.rl_heads()))
    }
    embed = state["model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"]
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = embed.clone()
    state["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(embed.shape[0], 32)
    return state


@pytest.mark.parametrize("variant,keys", [("pi0", PI0_KEYS), ("pi05", PI05_KEYS)])
def test_a_checkpoint_in_the_public_layout_loads_and_acts_the_same(tmp_path, variant: str, keys: list[str]) -> None:
    spec = make_spec(("front",))
    torch.manual_seed(0)
    source = OpenPIPolicy(spec, variant=variant)
    with torch.no_grad():  # weights no initialisation would produce, so equal actions mean they were loaded
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = published_layout(source)
    assert set(keys) <= set(state)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    torch.manual_seed(1)
    target = OpenPIPolicy(spec, variant=variant)
    load_weights(target, str(path))
    obs = make_obs(target, 4)
    torch.manual_seed(7)
    a = source.sample(obs)
    torch.manual_seed(7)
    b = target.sample(obs)
    # the actions come from the checkpoint; the noise std head is not in it, so both have their (zero) initial one
    source.noise_std_head.load_state_dict(target.noise_std_head.state_dict())
    torch.manual_seed(7)
    a = source.sample(obs)
    assert torch.equal(a.chunk, b.chunk) and torch.equal(a.log_prob, b.log_prob)
    # a state-only env ignores the vision tower of the same file
    load_weights(OpenPIPolicy(make_spec(), variant=variant), str(path))


def test_a_checkpoint_that_does_not_fit_names_the_keys(tmp_path) -> None:
    state = published_layout(OpenPIPolicy(make_spec(("front",))))
    del state["model.action_out_proj.weight"]
    state["model.paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight"] = torch.zeros(5)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as e:
        load_weights(OpenPIPolicy(make_spec(("front",))), str(path))
    message = str(e.value)
    assert message.startswith(
        f"policy.checkpoint={path} does not fit this policy: keys 1 missing (e.g. action_out_proj"
    )
    assert "gemma_expert.model.layers.0.input_layernorm.weight (5,) vs (32,)" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="pi05|missing"):  # a pi0 file is not a pi0.5 policy
        load_weights(OpenPIPolicy(make_spec(("front",)), variant="pi05"), str(path))


def test_pi05_state_tokens_and_limits() -> None:
    policy = OpenPIPolicy(make_spec(), variant="pi05")
    tokens = policy.state_tokens(torch.tensor([[-5.0, -1.0, -0.001, 0.0, 0.999, 1.0, 7.0]]))
    top = policy.dims.vocab - 256
    assert (tokens - top).tolist() == [[0, 0, 127, 128, 255, 255, 255]]
    with pytest.raises(ConfigError, match="policy.preset=tiny has max_state_dim=128 < env state dim 130"):
        OpenPIPolicy(make_spec(state_dim=130))
    with pytest.raises(ConfigError, match="policy.variant='pi1' is not available; accepted: pi0, pi05"):
        OpenPIPolicy(make_spec(), variant="pi1")


def test_padded_action_dims_stay_out_of_the_log_density() -> None:
    torch.manual_seed(0)
    policy = OpenPIPolicy(make_spec())
    obs = make_obs(policy, 3)
    out = policy.sample(obs)
    chain = out.extras["chain"].clone()
    chain[:, -1, :, ACTION_DIM:] += 5.0  # the last step's padded dims are no input to anything
    assert torch.allclose(policy.evaluate(obs, out.chunk, {"chain": chain})[0], out.log_prob, atol=1e-4)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_flow_matching_learns_a_mapping(variant: str, one_thread: None) -> None:
    torch.manual_seed(0)
    policy = OpenPIPolicy(make_spec(), variant=variant)
    weights = torch.randn(STATE_DIM, ACTION_DIM, generator=torch.Generator().manual_seed(4))
    ramp = torch.linspace(-0.5, 0.5, policy.chunk_len)[None, :, None]
    target = lambda state: torch.tanh(state @ weights / 3)[:, None, :] + ramp  # noqa: E731  (B, H, A)
    matched, shuffled = learns_state_mapping(policy, target, steps=200, drop=0.2)
    if variant == "pi05":
        # pi0.5 reads the state as discrete prefix tokens whose dim is told by position alone: from scratch, tying
        # each token to its dim takes far longer than this test (a pretrained pi0.5 reads them as number words)
        return
    assert matched < 0.6 * shuffled, (matched, shuffled)


def test_tokenize() -> None:
    policy = OpenPIPolicy(make_spec())
    texts = ["pick up the cube", "déplacer le cube ✓", "x" * 100, ""]
    tokens, mask = policy.tokenize(texts)
    again, _ = policy.tokenize(texts)
    assert tokens.dtype.name == "int64" and mask.dtype == bool and tokens.shape == (4, policy.dims.max_tokens)
    assert (tokens == again).all()
    assert mask.sum(1).tolist() == [1 + 16, 1 + len("déplacer le cube ✓".encode()), policy.dims.max_tokens, 1]
    assert (tokens[~mask] == 0).all() and (tokens[mask] > 0).all() and tokens.max() < policy.dims.vocab - 256
    assert bytes(int(i) - 3 for i in tokens[1, 1 : mask[1].sum()]).decode() == "déplacer le cube ✓"
