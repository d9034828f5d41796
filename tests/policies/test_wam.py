"""WAMPolicy: the joint world-model loss trains both velocity outputs, rollouts take the action-only path (cheaper,
independent of the frame steps, the same function as the joint model with its frames hidden), the frame codec
round-trips shapes, state-only envs, and the full preset's components on the meta device."""

from __future__ import annotations

import pytest
import torch

from ebrl.envs.base import EnvSpec
from ebrl.policies.wam import WAMPolicy
from tests.policies import test_families as families
from tests.policies.test_families import ACTION_DIM, STATE_DIM, make_obs

CAMERAS = ("front", "wrist")


def make_spec(
    cameras: tuple[str, ...] = CAMERAS, size: tuple[int, int] = (48, 64), state_dim: int = STATE_DIM
) -> EnvSpec:
    return families.make_spec(cameras, size, state_dim)


def images(obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in obs.items() if k.startswith("image/")}


def smooth_images(obs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Blurry random scenes of the obs' camera shapes (uniform noise would not compress)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, image in images(obs).items():
        coarse = torch.rand(image.shape[0], 3, 3, 4, generator=g)
        out[key] = (
            (255 * torch.nn.functional.interpolate(coarse, size=image.shape[1:3], mode="bilinear"))
            .to(torch.uint8)
            .permute(0, 2, 3, 1)
        )
    return out


@pytest.fixture(scope="module")
def policy() -> WAMPolicy:
    torch.manual_seed(0)
    return WAMPolicy(make_spec())


def count_tokens(policy: WAMPolicy) -> list[int]:
    """Tokens through the DiT's first block, call by call (batch rows x tokens)."""
    seen: list[int] = []
    policy.blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0] * args[0].shape[1]))
    return seen


def test_world_model_loss_trains_both_velocity_outputs(one_thread: None) -> None:
    torch.manual_seed(0)
    policy = WAMPolicy(make_spec())
    obs, future = make_obs(policy, 8), smooth_images(make_obs(policy, 8), seed=1)
    obs.update(smooth_images(obs, seed=2))
    actions = torch.tanh(obs["state"][:, :ACTION_DIM])[:, None].expand(-1, policy.chunk_len, -1)
    losses = policy.world_model_loss(obs, actions, future)
    assert set(losses) == {"action", "frame", "reconstruction"} and all(v.isfinite() for v in losses.values())
    sum(losses.values()).backward()
    for name in ("final_layer.linear.weight", "action_out_proj.weight", "frame_codec.decoder.0.weight"):
        assert dict(policy.named_parameters())[name].grad.abs().sum() > 0, name  # frame, action velocity, codec
    # the velocities learn against fixed latents (a pretrained codec, as Cosmos' VAE); the codec learns from
    # reconstruction alone
    for trained, keys, lr in ((False, ("action", "frame"), 3e-3), (True, ("reconstruction",), 1e-2)):
        policy.requires_grad_(not trained)
        policy.frame_codec.requires_grad_(trained)
        optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
        history = []
        for _ in range(30):
            torch.manual_seed(len(history))
            losses = policy.world_model_loss(obs, actions, future)
            loss = sum(losses[k] for k in keys)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history.append({k: v.item() for k, v in losses.items()})
        for key in keys:
            first, last = (sum(h[key] for h in part) / 5 for part in (history[:5], history[-5:]))
            assert last < 0.7 * first, (key, first, last)


def test_action_only_path_is_the_joint_model_with_frames_hidden(policy: WAMPolicy) -> None:
    obs = make_obs(policy, 3)
    with torch.no_grad():
        for block in policy.blocks:  # open the attention outputs closed at initialisation
            torch.nn.init.normal_(block.attn1.to_out.weight, std=0.05)
        cond, _ = policy.encode(obs)
        x, t = torch.randn(3, policy.chunk_len, policy.flow_dim), torch.rand(3)
        frames, t_frames = torch.randn(3, len(CAMERAS) * policy.frame_patches, 16), torch.rand(3)
        alone, no_frames, _ = policy.denoise(cond, x, t)
        hidden, frame_velocity, _ = policy.denoise(cond, x, t, frames, t_frames, torch.zeros(3, dtype=torch.bool))
        visible, _, _ = policy.denoise(cond, x, t, frames, t_frames, torch.ones(3, dtype=torch.bool))
        for block in policy.blocks:
            block.attn1.to_out.weight.zero_()
    assert no_frames is None and frame_velocity.shape == frames.shape
    assert torch.allclose(alone, hidden, atol=1e-5)  # what training with hidden frames computes, rollouts compute
    assert (alone - visible).abs().max() > 1e-3  # visible future frames do change the actions


def test_rollouts_skip_the_frames(policy: WAMPolicy) -> None:
    obs = make_obs(policy, 2)
    seen = count_tokens(policy)
    chunks = []
    for frame_steps in (1, 6):  # imagine's joint chain only: sampling does not depend on it
        policy.frame_steps = frame_steps
        torch.manual_seed(3)
        chunks.append(policy.sample(obs).chunk)
    assert torch.equal(chunks[0], chunks[1])
    steps, prefix = policy.denoise_steps, 2 * (1 + len(CAMERAS) * policy.frame_patches)
    assert seen[: steps + 1] == [prefix] + [2 * policy.chunk_len] * steps  # prefix once, then action tokens only
    seen.clear()
    policy.frame_steps = steps
    dream = policy.imagine(obs)
    assert seen == [prefix] + [2 * (policy.chunk_len + len(CAMERAS) * policy.frame_patches)] * steps
    assert sum(seen) > prefix + steps * 2 * policy.chunk_len  # the joint chain pays for the frame tokens
    assert dream["chunk"].shape == (2, policy.chunk_len, ACTION_DIM)


def test_frame_decoder_reconstructs_shapes(policy: WAMPolicy) -> None:
    obs = make_obs(policy, 2)
    latents = policy.encode_frames(obs)
    d = policy.dims
    assert latents.shape == (2, len(CAMERAS) * policy.frame_patches, d.latent_channels * d.patch_size**2)
    assert torch.equal(policy.patchify(policy.unpatchify(latents)), latents)
    with torch.no_grad():
        frames = policy.decode_frames(latents)
    dream = policy.imagine(obs)
    for out in (frames, dream["frames"]):  # back at the env's (non-square) camera size
        expected = {k: ((2, 48, 64, 3), torch.uint8) for k in images(obs)}
        assert {k: (v.shape, v.dtype) for k, v in out.items()} == expected


def test_state_only_env_is_an_action_dit() -> None:
    torch.manual_seed(0)
    policy = WAMPolicy(make_spec(cameras=()))
    frame_parts = ("frame_codec", "x_embedder", "final_layer.linear")
    assert not any(name.startswith(frame_parts) for name, _ in policy.named_parameters())
    obs = make_obs(policy, 3)
    losses = policy.world_model_loss(obs, torch.zeros(3, policy.chunk_len, ACTION_DIM), {})
    assert losses["frame"] == 0 and losses["reconstruction"] == 0 and losses["action"] > 0
    seen = count_tokens(policy)
    dream = policy.imagine(obs)
    assert dream["frames"] == {} and dream["latents"] is None and seen[0] == 3  # the prefix is the state token
    assert policy.sample(obs).chunk.shape == (3, policy.chunk_len, ACTION_DIM)


def test_full_preset_components() -> None:
    with torch.device("meta"):
        full = WAMPolicy(make_spec(("base", "wrist"), size=(224, 224), state_dim=14), preset="full")
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    block = full.blocks[0]
    assert len(full.blocks) == 28 and count(block) == 69_206_528  # one Cosmos-Predict2-2B block
    assert block.attn2.to_k.in_features == 1024 and block.attn1.to_q.out_features == 2048
    dit = count(full.blocks) + count(full.t_embedder) + count(full.final_layer) + count(full.x_embedder) + 2048
    assert dit == pytest.approx(1.956e9, rel=1e-3)  # Cosmos-Predict2-2B's DiT at its published shapes
    assert full.embed_tokens.num_embeddings == 32128 and full.frame_patches == 196  # T5 vocab; 224 px / 8 / 2
    assert full.num_parameters() == pytest.approx(2.0e9, rel=0.01)
