"""What a checkpoint brings besides its weights, at the tiny preset: statistics, action dims, camera slots, and the
one line a mismatch gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ebrl.config import ConfigError
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.build import build_policy, tokenizer_warning
from ebrl.policies.normalize import Normalizer, read_norm_stats

STATE, ACTIONS = 6, 4


def spec(cameras: tuple[str, ...] = ()) -> EnvSpec:
    obs = {"state": ArraySpec((STATE,), "float32"), **{f"image/{c}": ArraySpec((40, 48, 3), "uint8") for c in cameras}}
    return EnvSpec(obs=obs, action_dim=ACTIONS, instruction="lift the cube", max_episode_steps=10)


def openpi_cfg(**overrides) -> dict:
    return {"_target_": "ebrl.policies.openpi.OpenPIPolicy", "name": "openpi", "preset": "tiny", **overrides}


def write_stats(path, action_dims: int = 5) -> str:
    rng = np.random.default_rng(0)
    table = {
        "norm_stats": {
            "state": {
                "mean": rng.normal(size=STATE).tolist(),
                "std": (rng.random(STATE) + 0.5).tolist(),
                "q01": (-1 - rng.random(STATE)).tolist(),
                "q99": (1 + rng.random(STATE)).tolist(),
            },
            "actions": {
                "mean": rng.normal(size=action_dims).tolist(),
                "std": (rng.random(action_dims) + 0.5).tolist(),
                "q01": (-1 - rng.random(action_dims)).tolist(),
                "q99": (1 + rng.random(action_dims)).tolist(),
            },
        }
    }
    path.write_text(json.dumps(table))
    return str(path)


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_statistics_and_action_dims_keep_log_probs_in_the_models_space(tmp_path, variant) -> None:
    stats = write_stats(tmp_path / "norm_stats.json")
    torch.manual_seed(0)
    policy = build_policy(
        openpi_cfg(variant=variant, norm_stats=stats, action_dims=[4, 0, 2, 1], action_scale=[1, 1, 1, -1]), spec()
    )
    assert policy.model_action_dim == 5 and policy.normalizer.modes["action"] == (
        "mean_std" if variant == "pi0" else "quantiles"
    )
    obs = {"state": torch.randn(3, STATE)}
    out = policy.sample(obs)
    last = out.extras["chain"][:, -1, :, :5]
    back = Normalizer(read_norm_stats(stats), *[policy.normalizer.modes[k] for k in ("state", "action")])
    env = back.unnormalize("action", last)[..., [4, 0, 2, 1]] * torch.tensor([1, 1, 1, -1.0])
    assert torch.allclose(out.chunk, env, atol=1e-5)  # the env gets un-normalised, mapped actions
    log_prob, _, _ = policy.evaluate(obs, out.chunk, out.extras)
    assert torch.allclose(log_prob, out.log_prob, atol=1e-3)  # the chain's density, whatever the env receives
    # demonstrations go the other way: env actions -> the model's normalised space (unmapped dim 3 stays 0)
    z = policy.from_env(out.chunk)
    assert torch.allclose(z[..., [4, 0, 2, 1]], last[..., [4, 0, 2, 1]], atol=1e-4) and not z[..., 3].any()


def test_state_is_normalised_on_the_way_in(tmp_path) -> None:
    stats = write_stats(tmp_path / "norm_stats.json", ACTIONS)
    policy = build_policy(openpi_cfg(norm_stats=stats), spec())
    table = json.loads((tmp_path / "norm_stats.json").read_text())["norm_stats"]["state"]
    x = torch.randn(2, STATE)
    want = (x - torch.tensor(table["mean"])) / (torch.tensor(table["std"]) + 1e-6)  # openpi's Normalize
    assert torch.allclose(policy.normalize_state(x), want, atol=1e-5)


def test_state_dims_pick_what_the_checkpoint_reads() -> None:
    policy = build_policy(openpi_cfg(state_dims=[5, 0]), spec())
    x = torch.randn(3, STATE)
    assert torch.equal(policy.normalize_state(x), x[:, [5, 0]])
    assert policy.sample({"state": x}).chunk.shape == (3, policy.chunk_len, ACTIONS)


def test_camera_slots_mask_what_no_env_camera_fills() -> None:
    policy = build_policy(
        openpi_cfg(cameras={"base_0_rgb": "front", "left_wrist_0_rgb": None}), spec(("front", "side"))
    )
    assert policy.camera_slots == ["base_0_rgb", "left_wrist_0_rgb"] and policy.cameras == ["image/front"]
    obs = {
        "state": torch.randn(2, STATE),
        "image/front": torch.randint(0, 256, (2, 40, 48, 3), dtype=torch.uint8),
        "image/side": torch.randint(0, 256, (2, 40, 48, 3), dtype=torch.uint8),
    }
    emb, real = policy.embed_prefix(obs)
    patches = (32 // 8) ** 2
    assert emb.shape[1] == patches + policy.dims.max_tokens and real[:, :patches].all()  # one slot's patches + text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"cameras": {"base_0_rgb": "wrist"}},
            "maps the checkpoint's camera base_0_rgb to env camera 'wrist', which the env lacks",
        ),
        ({"action_dims": [0, 1]}, "policy.action_dims has 2 entries, the env's actions 4 dims"),
        ({"action_dims": [0, 1, 2, 40]}, r"names dims outside the checkpoint's"),
        ({"action_scale": [1, 0, 1, 1]}, "must give one non-zero factor per env action dim"),
        ({"norm_mode": "quantiles"}, "needs statistics"),
        ({"dims": {"widht": 8}}, "policy.dims has no size widht"),
        ({"state_dims": [0, 9]}, r"policy.state_dims=\[0, 9\] must pick dims of the env's state \(0..5\)"),
    ],
)
def test_what_does_not_fit_is_one_line(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_policy(openpi_cfg(**overrides), spec(("front",)))


def test_a_lerobot_folder_says_its_variant_and_cameras(tmp_path) -> None:
    torch.manual_seed(0)
    source = build_policy(openpi_cfg(), spec())
    save_file({f"model.{k}": v for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = {
        "type": "pi0",
        "chunk_size": source.chunk_len,
        "input_features": {
            "observation.state": {"type": "STATE", "shape": [STATE]},
            "observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="is a pi0 checkpoint, policy.variant=pi05"):
        build_policy(openpi_cfg(checkpoint=str(tmp_path), variant="pi05"), spec())
    with pytest.raises(ConfigError, match="was trained on cameras base_0_rgb: map them to env cameras"):
        build_policy(openpi_cfg(checkpoint=str(tmp_path)), spec(("front",)))
    loaded = build_policy(openpi_cfg(checkpoint=str(tmp_path), cameras={"base_0_rgb": None}), spec())
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_full_run_without_a_tokenizer_says_so(tmp_path) -> None:
    from ebrl.policies.tokenizer import train_gemma_like

    policy = build_policy(openpi_cfg(), spec())  # (tiny, so the test is cheap; the rule reads the config's preset)
    assert "byte-level stand-in" in tokenizer_warning({"name": "openpi", "preset": "full"}, policy)
    assert tokenizer_warning({"name": "openpi", "preset": "tiny"}, policy) is None
    model = train_gemma_like(tmp_path / "tokenizer.model", ["lift the cube"], vocab_size=280)
    given = build_policy(openpi_cfg(tokenizer=str(model)), spec())
    assert tokenizer_warning({"name": "openpi", "preset": "full"}, given) is None


@pytest.mark.parametrize("mode", ["mean_std", "quantiles"])
def test_statistics_written_for_the_other_convention_normalise_alike(tmp_path, mode) -> None:
    """What export writes: openpi's statistics for lerobot's formulas and back, a constant dim (std 0) included, give
    the normalised values ours gives, and the un-normalised ones within an eps of the stats' scale. (A span q99 - q01
    of 1e-6, openpi's for a constant dim, is a float32 difference of two numbers of the data's scale in lerobot's
    file: it cannot be kept to 1e-5.)"""
    from ebrl.policies.normalize import in_convention, openpi_stats, openpi_table

    openpi = read_norm_stats(write_stats(tmp_path / "norm_stats.json", ACTIONS))
    openpi.state.std[0] = 0.0
    lerobot = in_convention(openpi, "lerobot", eps=1e-8)
    back = openpi_stats(openpi_table(in_convention(lerobot, "openpi")), "back")
    x, z = torch.randn(5, STATE) * 2, torch.randn(5, STATE)  # (z: what a model outputs, of the order of 1)
    ours = Normalizer(openpi, mode, mode)
    for other in (lerobot, back):
        theirs = Normalizer(other, mode, mode)
        assert torch.allclose(theirs.normalize("state", x), ours.normalize("state", x), rtol=1e-5), other.convention
        assert torch.allclose(theirs.unnormalize("state", z), ours.unnormalize("state", z), atol=1e-6)
