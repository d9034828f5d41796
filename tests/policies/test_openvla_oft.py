"""OpenVLAOFTPolicy: parallel decoding in one backbone pass, the attention pattern, the Gaussian's std bounds, the L1
loss, checkpoint import and the full preset's component counts against OpenVLA 7B."""

from __future__ import annotations

import math

import pytest
import torch

from ebrl.config import ConfigError
from ebrl.policies.openvla_oft import OpenVLAOFTPolicy
from tests.policies.test_families import ACTION_DIM, STATE_DIM, make_obs, make_spec


@pytest.fixture(scope="module")
def policy() -> OpenVLAOFTPolicy:
    torch.manual_seed(0)
    return OpenVLAOFTPolicy(make_spec(("front", "wrist"), size=(48, 64)))  # non-square: resized to the ViTs' size


def test_the_chunk_comes_from_one_backbone_forward(policy: OpenVLAOFTPolicy) -> None:
    calls = {"llm": 0, "dino": 0, "siglip": 0}
    hooks = [
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        for name, module in (
            ("llm", policy.language_model.model),
            ("dino", policy.vision_backbone.featurizer),
            ("siglip", policy.vision_backbone.fused_featurizer),
        )
    ]
    try:
        obs = make_obs(policy, 3)
        out = policy.sample(obs)
        assert out.chunk.shape == (3, policy.chunk_len, ACTION_DIM)
        assert calls == {"llm": 1, "dino": 1, "siglip": 1}  # every camera in one ViT batch, every action in one pass
        policy.evaluate(obs, out.chunk, out.extras)
        policy.value(obs)
        assert calls["llm"] == 3
    finally:
        for hook in hooks:
            hook.remove()


def test_attention_mask_is_causal_for_the_prompt_and_bidirectional_among_actions(policy: OpenVLAOFTPolicy) -> None:
    real = torch.tensor([[True, True, True, False], [True, True, True, True]])  # row 0 has a padded prompt token
    mask = policy.attention_mask(real, n_actions=3)
    prompt, actions = slice(0, 4), slice(4, 7)
    assert not mask[:, prompt, actions].any()  # the prompt never sees the action tokens
    assert torch.equal(mask[1, prompt, prompt], torch.ones(4, 4, dtype=torch.bool).tril())
    assert mask[:, actions, actions].all()  # action tokens see each other in both directions
    assert torch.equal(mask[:, actions, prompt], real[:, None, :].expand(-1, 3, -1))  # and every real prompt token
    assert not mask[0, :, 3].any()  # nobody attends to padding


def test_prompt_ignores_the_action_tokens_which_see_each_other(policy: OpenVLAOFTPolicy) -> None:
    obs = make_obs(policy, 2, seed=1)
    chunk = policy.chunk_len
    try:
        policy.chunk_len = 1
        short, prompt_len = policy.encode(obs)
        policy.chunk_len = 3
        long, prompt_len_long = policy.encode(obs)
    finally:
        policy.chunk_len = chunk
    assert prompt_len == prompt_len_long and long.shape[1] == prompt_len + 3 * ACTION_DIM
    # appending action tokens leaves the prompt's states alone (it cannot attend to them) ...
    assert torch.allclose(short[:, :prompt_len], long[:, :prompt_len], atol=1e-6)
    # ... but changes the first action token's: it attends to the ones after it (a causal mask would not)
    assert not torch.allclose(short[:, prompt_len], long[:, prompt_len], atol=1e-4)


def test_state_image_and_instruction_change_the_actions(policy: OpenVLAOFTPolicy) -> None:
    obs = make_obs(policy, 2, seed=2)
    base = policy.predict_action(obs)
    for key in ("state", "image/front"):
        changed = dict(obs)
        changed[key] = obs[key].flip(0)  # swap the two rows' values
        assert not torch.allclose(policy.predict_action(changed), base, atol=1e-7), key
    tokens, mask = policy.tokenize(["open the drawer"] * 2)
    changed = dict(obs, tokens=torch.from_numpy(tokens), token_mask=torch.from_numpy(mask))
    assert not torch.allclose(policy.predict_action(changed), base, atol=1e-7)
    # a bare obs (no tokens) is given the env's own instruction
    bare = {k: v for k, v in obs.items() if not k.startswith("token")}
    assert torch.allclose(policy.predict_action(bare), base, atol=1e-6)


def test_gaussian_log_prob_entropy_and_std_bounds() -> None:
    torch.manual_seed(0)
    policy = OpenVLAOFTPolicy(make_spec(), chunk=2, action_std_init=0.3, action_std_min=0.02, action_std_max=1.0)
    assert torch.allclose(policy.log_std().exp(), torch.full((ACTION_DIM,), 0.3), atol=1e-6)
    obs = make_obs(policy, 256, seed=3)
    obs = {k: v[:1].expand(256, *v.shape[1:]) for k, v in obs.items()}  # one observation, many samples
    out = policy.sample(obs)
    mean = policy.predict_action(obs)
    assert abs((out.chunk - mean).std().item() - 0.3) < 0.03
    normal = torch.distributions.Normal(mean, policy.log_std().exp())
    assert torch.allclose(out.log_prob, normal.log_prob(out.chunk).sum(-1), atol=1e-4)
    _, entropy, _ = policy.evaluate(obs, out.chunk, out.extras)
    assert torch.allclose(entropy, normal.entropy().sum(-1), atol=1e-5)
    with torch.no_grad():  # however far RL pushes the logit, the std stays within its bounds
        policy.log_std_logit.copy_(torch.tensor([-1e4, -50, -5, 0, 5, 50, 1e4]))
    std = policy.log_std().exp()
    assert (std >= 0.02 - 1e-7).all() and (std <= 1.0 + 1e-6).all()
    assert math.isclose(std[0].item(), 0.02, rel_tol=1e-5) and math.isclose(std[-1].item(), 1.0, rel_tol=1e-5)
    for bad in ({"action_std_init": 2.0}, {"action_std_min": 0.0}, {"action_std_min": 0.5, "action_std_max": 0.1}):
        with pytest.raises(ConfigError, match="must satisfy 0 < min <= init <= max"):
            OpenVLAOFTPolicy(make_spec(), **bad)
    fixed = OpenVLAOFTPolicy(make_spec(), action_std_init=0.2, action_std_min=0.2, action_std_max=0.2)
    assert torch.allclose(fixed.log_std().exp(), torch.full((ACTION_DIM,), 0.2))


def test_l1_loss_learns_an_obs_to_action_mapping() -> None:
    torch.manual_seed(0)
    policy = OpenVLAOFTPolicy(make_spec(), chunk=2)
    g = torch.Generator().manual_seed(4)
    weights = torch.randn(STATE_DIM, 2, ACTION_DIM, generator=g) / STATE_DIM**0.5
    state = torch.randn(16, STATE_DIM, generator=g)
    target = torch.tanh(torch.einsum("bs,sha->bha", state, weights))  # each action of the chunk differs
    bos = torch.ones(16, 1, dtype=torch.long)  # a one-token instruction keeps the sequence short
    obs = {"state": state, "tokens": bos, "token_mask": bos.bool()}
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    losses = []
    for _ in range(100):
        loss = policy.l1_loss(obs, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses[::10]  # the state reaches the actions only through the backbone


def test_state_only_overrides_and_limits() -> None:
    policy = OpenVLAOFTPolicy(make_spec(), chunk=3)
    assert not hasattr(policy, "vision_backbone") and not hasattr(policy, "projector")
    out = policy.sample({"state": torch.zeros(2, STATE_DIM)})
    assert out.chunk.shape == (2, 3, ACTION_DIM) and out.extras == {}
    with pytest.raises(ConfigError, match="policy.preset=tiny has max_state_dim=128 < env state dim 129"):
        OpenVLAOFTPolicy(make_spec(state_dim=129))
    with pytest.raises(ConfigError, match="policy.chunk=0 must be a positive integer"):
        OpenVLAOFTPolicy(make_spec(), chunk=0)


def test_import_state_dict_pads_the_proprio_projector_and_drops_vision_for_state_only() -> None:
    cams, state_only = OpenVLAOFTPolicy(make_spec(("front",))), OpenVLAOFTPolicy(make_spec())
    state = {k: v.clone() for k, v in cams.state_dict().items()}
    state["proprio_projector.fc1.weight"] = torch.randn(cams.dims.width, 8)  # OFT's LIBERO proprio: 8 dims
    mapped, may_miss = state_only.import_state_dict(state)
    assert mapped["proprio_projector.fc1.weight"].shape == (cams.dims.width, cams.dims.max_state_dim)
    assert torch.equal(mapped["proprio_projector.fc1.weight"][:, :8], state["proprio_projector.fc1.weight"])
    assert not any(k.startswith(("vision_backbone.", "projector.")) for k in mapped)
    assert {"value_head", "log_std_logit", "action_head.", "proprio_projector."} <= set(may_miss)
    state_only.load_state_dict(mapped, strict=True)


def test_full_preset_is_openvla_7b_plus_oft() -> None:
    with torch.device("meta"):
        full = OpenVLAOFTPolicy(make_spec(("base", "wrist"), size=224, state_dim=14), preset="full")
    parts = full.parameter_breakdown()
    # OpenVLA's modules, exactly the checkpoint's 7,541,237,184 (timm ViTs incl. the blocks and head OpenVLA skips)
    assert parts["vision_backbone.featurizer (DINOv2)"] == 303_230_976
    assert parts["vision_backbone.fused_featurizer (SigLIP)"] == 427_680_704
    assert parts["projector"] == 71_385_600
    assert parts["language_model (Llama-2)"] == 6_738_939_904
    openvla = sum(v for k, v in parts.items() if "OFT" not in k and "RL" not in k)
    assert openvla == OpenVLAOFTPolicy.PUBLISHED_PARAMETERS["default"][0]
    # OFT's L1 head on 7 action dims: LayerNorm + fc1 from 7 x 4096, two 4096-wide residual blocks, LayerNorm, fc2
    width, fan_in = 4096, 7 * 4096
    assert parts["action_head (OFT)"] == (
        2 * fan_in
        + fan_in * width
        + width
        + 2 * (2 * width + width * width + width)
        + 2 * width
        + width * ACTION_DIM
        + ACTION_DIM
    )
    # what OpenVLA never runs is frozen: lm_head, each ViT's last block and final norm, SigLIP's attention pool
    frozen = sum(p.numel() for p in full.parameters() if not p.requires_grad)
    assert frozen == 32064 * 4096 + 12_600_320 + 30_480_160
