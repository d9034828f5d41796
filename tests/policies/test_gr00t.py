"""GR00TPolicy: the DiT reads image and instruction through cross-attention, GR00T's time convention, the causal
backbone, flow matching learns a mapping, and the full preset's components on the meta device."""

from __future__ import annotations

import pytest
import torch

from ebrl.policies.dit import BasicTransformerBlock
from ebrl.policies.gr00t import GR00TPolicy
from tests.policies.test_families import ACTION_DIM, STATE_DIM, learns_state_mapping, make_obs, make_spec


def velocity(policy: GR00TPolicy, obs: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.velocity(x, t, policy.encode(obs)[0])[0]


def test_actions_read_image_and_instruction_through_cross_attention() -> None:
    torch.manual_seed(0)
    policy = GR00TPolicy(make_spec(("front", "wrist"), size=(48, 64)))  # non-square cameras are resized
    obs = make_obs(policy, 2)
    other_image = {**obs, "image/front": 255 - obs["image/front"]}
    other_text = {
        **obs,
        **dict(zip(("tokens", "token_mask"), map(torch.from_numpy, policy.tokenize(["open the drawer"] * 2)))),
    }
    x, t = torch.randn(2, policy.chunk_len, policy.flow_dim), torch.full((2,), 0.5)
    blocks = policy.action_head.model.transformer_blocks
    assert [b.attn1_cross for b in blocks] == [True, False]  # even blocks cross-attend, odd ones self-attend
    # at initialisation every attention output is closed: the first policy is the same for every observation
    base = velocity(policy, obs, x, t)
    assert torch.allclose(base, velocity(policy, other_image, x, t), atol=1e-6)
    assert torch.allclose(base, velocity(policy, other_text, x, t), atol=1e-6)
    # opening only the cross-attention output makes the actions depend on the image and on the instruction
    with torch.no_grad():
        torch.nn.init.normal_(blocks[0].attn1.to_out[0].weight, std=0.2)
    base = velocity(policy, obs, x, t)
    assert (base - velocity(policy, other_image, x, t)).abs().max() > 1e-3
    assert (base - velocity(policy, other_text, x, t)).abs().max() > 1e-3


def test_the_dit_sees_gr00t_time() -> None:
    policy = GR00TPolicy(make_spec())
    seen = []
    policy.action_head.model.timestep_encoder.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    t = torch.tensor([1.0, 0.8, 0.75, 0.25])  # FlowPolicy: 1 = noise
    velocity(policy, make_obs(policy, 4), torch.randn(4, policy.chunk_len, policy.flow_dim), t)
    # GR00T: 0 = noise, 1 = data, in 1000 buckets (float32's 1 - 0.8 still lands in bucket 200, as int(1/5 * 1000))
    assert seen[0].tolist() == [0.0, 200.0, 250.0, 750.0]


def test_backbone_is_causal_with_images_first() -> None:
    torch.manual_seed(0)
    policy = GR00TPolicy(make_spec(("front",)))
    layer = policy.language_model.layers[0]
    assert layer.self_attn.q_norm.weight.shape == (policy.dims.head_dim,)  # Qwen3's per-head q/k norms
    obs = make_obs(policy, 2)
    other = make_obs(policy, 2, text="open the drawer")
    with torch.no_grad():
        a, mask = policy.vl_features(obs)
        b, _ = policy.vl_features(other)
    images = (policy.dims.image_size // policy.dims.patch_size) ** 2
    assert a.shape == (2, images + policy.dims.max_tokens, policy.dims.width) and mask[:, :images].all()
    assert torch.allclose(a[:, :images], b[:, :images], atol=1e-6)  # image tokens come before the instruction
    assert not torch.allclose(a[:, images:], b[:, images:], atol=1e-3)


def test_state_only_env_builds_no_vision_tower() -> None:
    policy = GR00TPolicy(make_spec())
    names = [name for name, _ in policy.named_parameters()]
    assert not any("vision_model" in n or "mlp1" in n for n in names)
    out = policy.sample({"state": torch.zeros(2, STATE_DIM)})  # no tokens: the env's instruction is used
    assert out.chunk.shape == (2, policy.chunk_len, ACTION_DIM)


def test_flow_matching_learns_a_mapping(one_thread: None) -> None:
    torch.manual_seed(0)
    policy = GR00TPolicy(make_spec())
    weights = torch.randn(STATE_DIM, ACTION_DIM, generator=torch.Generator().manual_seed(4))
    target = lambda state: torch.tanh(state @ weights / 2)[:, None, :].expand(-1, policy.chunk_len, -1)  # noqa: E731
    matched, shuffled = learns_state_mapping(policy, target, steps=150, drop=0.5)
    assert matched < 0.8 * shuffled, (matched, shuffled)


def test_full_preset_components() -> None:
    with torch.device("meta"):
        full = GR00TPolicy(make_spec(("base", "wrist"), size=(224, 224), state_dim=14), preset="full")
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    eagle, head = full.backbone.eagle_model, full.action_head
    assert len(full.language_model.layers) == 12 and full.language_model.embed_tokens.num_embeddings == 151680
    assert count(eagle) == pytest.approx(1.330e9, rel=2e-3)  # SigLIP-2 + mlp1 + Qwen3 cut at layer 12
    assert count(head.model) == pytest.approx(550.4e6, rel=1e-3)  # the DiT
    assert count(head) == pytest.approx(1.069e9, rel=2e-3)
    assert head.state_encoder.layer1.W.shape == (32, 64, 1024)  # max_num_embodiments x max_state_dim x hidden
    assert full.embodiment == 31  # new_embodiment
    blocks = head.model.transformer_blocks
    assert len(blocks) == 16 and isinstance(blocks[0], BasicTransformerBlock)
    assert blocks[0].attn1.to_k.in_features == 2048 and blocks[1].attn1.to_k.in_features == 1536
    assert (full.chunk_len, full.denoise_steps, full.flow_dim) == (16, 4, 32)
    tiny = GR00TPolicy(make_spec())
    assert tiny.action_head.state_encoder.layer1.W.shape[0] == 1 and tiny.embodiment == 0  # tiny: one embodiment
