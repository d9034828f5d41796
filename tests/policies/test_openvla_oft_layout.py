"""A released OpenVLA-OFT checkpoint folder, rebuilt at the tiny preset by its writers' rules, loads into
OpenVLAOFTPolicy by name: every tensor at its key, and a wrong file is one line naming the keys.

The layout (openvla-oft's vla-scripts/finetune.py `save_training_checkpoint`, experiments/robot/openvla_utils.py):
- the LoRA-merged OpenVLAForActionPrediction through transformers' `save_pretrained`: sharded safetensors with
  model.safetensors.index.json (written here by huggingface_hub's `save_torch_state_dict`, the sharding
  transformers calls), bfloat16;
- OFT's modules as `torch.save(<DDP-wrapped module>.state_dict(), "<name>--<step>_checkpoint.pt")`: every key starts
  with "module." (the action head is bfloat16, the proprio projector float32, as finetune.py's `init_module` casts);
- dataset_statistics.json (`save_dataset_statistics`) and config.json (OpenVLAConfig, `norm_stats` of the base
  model's datasets), tokenizer/processor files and lora_adapter/ beside them.
The released names are spelled out below from the reference's modules (timm's ViTs with the HF port's LayerScale
`scale_factor`, transformers' Llama, prismatic/models/action_heads.py and projectors.py), not taken from our policy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ebrl.policies.openvla_oft import OpenVLAOFTPolicy, read_oft_folder, read_oft_statistics
from ebrl.policies.weights import CheckpointError, check_state_dict
from tests.policies.test_families import ACTION_DIM, make_obs, make_spec

STEP = 150000  # the LIBERO-Spatial release's action_head--150000_checkpoint.pt
PROPRIO_DIM = 8  # OFT's LIBERO proprio (prismatic/vla/constants.py)
UNNORM_KEY = "libero_spatial_no_noops"
OFT_MODULES = ("action_head.", "proprio_projector.")


# --- the released names ----------------------------------------------------------------------------
def released_vla_names(depths: dict[str, int]) -> set[str]:
    """OpenVLAForActionPrediction's state-dict keys (the fused DINOv2 + SigLIP backbone, Llama-2)."""

    def linear(name: str, bias: bool = True) -> list[str]:
        return [f"{name}.weight"] + ([f"{name}.bias"] if bias else [])

    def vit(prefix: str, depth: int, dino: bool) -> list[str]:
        names = [f"{prefix}.pos_embed", *linear(f"{prefix}.patch_embed.proj"), *linear(f"{prefix}.norm")]
        if dino:  # timm vit_large_patch14_reg4_dinov2: class token, 4 registers, LayerScale (renamed by the HF port)
            names += [f"{prefix}.cls_token", f"{prefix}.reg_token"]
        else:  # timm vit_so400m_patch14_siglip_224: the attention-pool ("map") head
            pool = f"{prefix}.attn_pool"
            names += [
                f"{pool}.latent",
                *[n for part in ("q", "kv", "proj", "norm", "mlp.fc1", "mlp.fc2") for n in linear(f"{pool}.{part}")],
            ]
        for i in range(depth):
            block = f"{prefix}.blocks.{i}"
            for part in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
                names += linear(f"{block}.{part}")
            if dino:
                names += [f"{block}.ls1.scale_factor", f"{block}.ls2.scale_factor"]
        return names

    names = vit("vision_backbone.featurizer", depths["dino"], True)
    names += vit("vision_backbone.fused_featurizer", depths["siglip"], False)
    names += [n for fc in ("fc1", "fc2", "fc3") for n in linear(f"projector.{fc}")]
    names += [
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ]
    for i in range(depths["llm"]):
        layer = f"language_model.model.layers.{i}"
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
        names += [f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return set(names)


class MLPResNetBlock(nn.Module):  # prismatic/models/action_heads.py
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())


class MLPResNet(nn.Module):
    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(MLPResNetBlock(hidden_dim) for _ in range(num_blocks))
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)


class L1RegressionActionHead(nn.Module):  # input_dim * ACTION_DIM in, 2 blocks, hidden = the LLM width
    def __init__(self, input_dim: int, hidden_dim: int, action_dim: int) -> None:
        super().__init__()
        self.model = MLPResNet(2, input_dim * action_dim, hidden_dim, action_dim)


class ProprioProjector(nn.Module):  # prismatic/models/projectors.py
    def __init__(self, llm_dim: int, proprio_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()


class DDPWrapped(nn.Module):
    """The state dict of torch's DistributedDataParallel around `module` (same keys, "module." + the module's, and an
    OrderedDict with _metadata; checked against a real gloo DDP), without a process group."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def randomised(module: nn.Module, seed: int, dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():  # distinct values everywhere (LayerNorm's ones and zeros would hide swaps)
            p.copy_(torch.randn(p.shape, generator=g))
    return module.to(dtype)


# --- writing a release -----------------------------------------------------------------------------
def stats(dims: int, seed: int, mask: list[bool] | None) -> dict:
    rng = np.random.default_rng(seed)
    low, high = -rng.random(dims) - 0.1, rng.random(dims) + 0.1
    out = {
        "mean": ((low + high) / 2).tolist(),
        "std": (high - low).tolist(),
        "max": (high * 1.5).tolist(),
        "min": (low * 1.5).tolist(),
        "q01": low.tolist(),
        "q99": high.tolist(),
    }
    if mask is not None:
        out["mask"] = mask
    return out


def write_release(
    folder: Path, vla: dict[str, torch.Tensor], components: dict[str, dict[str, torch.Tensor]], step: int | str = STEP
) -> Path:
    from huggingface_hub import save_torch_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(vla, str(folder), max_shard_size="128KB")  # model-0000N-of-0000M + index
    for name, state in components.items():
        torch.save(state, folder / f"{name}--{step}_checkpoint.pt")
    statistics = {
        UNNORM_KEY: {
            "action": stats(ACTION_DIM, 0, [True] * 6 + [False]),
            "proprio": stats(PROPRIO_DIM, 1, None),
            "num_transitions": 52970,
            "num_trajectories": 432,
        }
    }
    (folder / "dataset_statistics.json").write_text(json.dumps(statistics, indent=2))
    base = {
        name: {
            "action": stats(ACTION_DIM, i + 2, [True] * 6 + [False]),
            "proprio": stats(7, 9, None),
            "num_transitions": 10,
            "num_trajectories": 1,
        }
        for i, name in enumerate(("bridge_orig", "fractal20220817_data"))
    }
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "openvla", "norm_stats": base, "n_action_bins": 256, "use_fused_vision_backbone": True}
        )
    )
    (folder / "lora_adapter").mkdir(exist_ok=True)
    (folder / "lora_adapter" / "adapter_config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def policy() -> OpenVLAOFTPolicy:
    torch.manual_seed(0)
    return OpenVLAOFTPolicy(make_spec(("front", "wrist")))


@pytest.fixture(scope="module")
def release(policy: OpenVLAOFTPolicy, tmp_path_factory) -> dict:
    """The released files' contents by name and the folder that holds them."""
    d = policy.dims
    names = released_vla_names({"dino": d.dino_depth, "siglip": d.siglip_depth, "llm": d.depth})
    own = policy.state_dict()
    g = torch.Generator().manual_seed(1)
    vla = {k: torch.randn(own[k].shape, generator=g).to(torch.bfloat16) for k in sorted(names)}
    head = DDPWrapped(randomised(L1RegressionActionHead(d.width, d.width, ACTION_DIM), 2, torch.bfloat16))
    proprio = DDPWrapped(randomised(ProprioProjector(d.width, PROPRIO_DIM), 3, torch.float32))
    components = {"action_head": head.state_dict(), "proprio_projector": proprio.state_dict()}
    folder = write_release(tmp_path_factory.mktemp("oft") / "openvla-7b-oft-finetuned-libero-spatial", vla, components)
    return {"folder": folder, "vla": vla, "components": components}


# --- the layout loads by name ----------------------------------------------------------------------
def test_our_names_are_the_released_ones(policy: OpenVLAOFTPolicy, release: dict) -> None:
    own = set(policy.state_dict())
    released = set(release["vla"]) | {
        f"{name}.{k.removeprefix('module.')}" for name, state in release["components"].items() for k in state
    }
    assert own - released == {k for k in own if k.startswith(tuple(policy.rl_heads()))}  # only RL's additions
    assert released <= own


def test_read_oft_folder_gathers_the_shards_and_the_ddp_components(release: dict) -> None:
    folder = release["folder"]
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(k.startswith("module.") for state in release["components"].values() for k in state)

    state = read_oft_folder(folder)
    expected = dict(release["vla"])
    for name, component in release["components"].items():
        expected.update({f"{name}.{k.removeprefix('module.')}": v for k, v in component.items()})
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    assert state["action_head.model.fc1.weight"].dtype == torch.bfloat16
    assert state["proprio_projector.fc1.weight"].shape[1] == PROPRIO_DIM


def test_every_released_tensor_arrives_at_its_key(release: dict) -> None:
    torch.manual_seed(5)
    policy = OpenVLAOFTPolicy(make_spec(("front", "wrist")))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    state, may_miss = policy.import_state_dict(read_oft_folder(release["folder"]))
    check_state_dict(policy, state, "the release", tuple(may_miss))
    policy.load_state_dict(state, strict=False)
    after = policy.state_dict()

    for key, value in release["vla"].items():
        assert torch.equal(after[key], value.float()), key
    for name, component in release["components"].items():
        for key, value in component.items():
            ours = after[f"{name}.{key.removeprefix('module.')}"]
            if key == "module.fc1.weight":  # the proprio projector: zero columns for the padded state dims
                assert torch.equal(ours[:, :PROPRIO_DIM], value) and not ours[:, PROPRIO_DIM:].any()
            else:
                assert torch.equal(ours, value.float()), key
    for key in after:  # the RL heads keep their initialisation
        if key.startswith(tuple(policy.rl_heads())):
            assert torch.equal(after[key], before[key]), key
    assert policy.predict_action(make_obs(policy, 1)).isfinite().all()
    # and as a run loads it: policy.checkpoint=<the release folder>
    from ebrl.policies.build import build_policy

    built = build_policy(
        {
            "_target_": "ebrl.policies.openvla_oft.OpenVLAOFTPolicy",
            "name": "openvla_oft",
            "preset": "tiny",
            "checkpoint": str(release["folder"]),
        },
        make_spec(("front", "wrist")),
    )
    assert all(torch.equal(built.state_dict()[k], after[k]) for k in release["vla"])


def test_import_maps_gamma_component_ddp_and_rotary_buffers(policy: OpenVLAOFTPolicy) -> None:
    w = torch.randn(policy.dims.dino_width)
    head = torch.randn(ACTION_DIM)
    state = {
        "vision_backbone.featurizer.blocks.0.ls1.gamma": w,
        "action_head.module.model.fc2.bias": head,
        "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    with pytest.raises(CheckpointError, match="part of action_head"):  # the rest of the head is missing
        policy.import_state_dict(state)
    state = {k: v for k, v in state.items() if not k.startswith("action_head.")}
    mapped, _ = policy.import_state_dict(state)
    assert set(mapped) == {"vision_backbone.featurizer.blocks.0.ls1.scale_factor"}
    full_head = {
        f"action_head.module.{k.removeprefix('action_head.')}": v
        for k, v in policy.state_dict().items()
        if k.startswith("action_head.")
    }
    mapped, _ = policy.import_state_dict(full_head)
    assert set(mapped) == {k for k in policy.state_dict() if k.startswith("action_head.")}


# --- wrong files ---------------------------------------------------------------------------------
def variant(release: dict, tmp_path: Path, vla=None, **components) -> Path:
    parts = dict(release["components"])
    parts.update(components)
    return write_release(tmp_path / "variant", release["vla"] if vla is None else vla, parts)


def load(folder: Path) -> None:
    policy = OpenVLAOFTPolicy(make_spec(("front", "wrist")))
    state, may_miss = policy.import_state_dict(read_oft_folder(folder))
    check_state_dict(policy, state, f"policy.checkpoint={folder}", tuple(may_miss))


@pytest.mark.parametrize("case", ["missing shard key", "missing component key", "extra key", "wrong shape"])
def test_a_wrong_file_is_one_line_naming_the_first_keys(release: dict, tmp_path: Path, case: str) -> None:
    vla, parts = None, {}
    if case == "missing shard key":
        vla = {k: v for k, v in release["vla"].items() if k != "language_model.model.norm.weight"}
        expected = "1 missing (e.g. language_model.model.norm.weight)"
    elif case == "missing component key":
        parts["action_head"] = {
            k: v for k, v in release["components"]["action_head"].items() if k != "module.model.fc2.bias"
        }
        expected = "1 missing (e.g. action_head.model.fc2.bias)"
    elif case == "extra key":
        parts["proprio_projector"] = dict(
            release["components"]["proprio_projector"], **{"module.fc3.weight": torch.zeros(2, 2)}
        )
        expected = "1 unexpected (e.g. proprio_projector.fc3.weight)"
    else:  # a head for 6 action dims
        width = OpenVLAOFTPolicy(make_spec()).dims.width
        parts["action_head"] = DDPWrapped(L1RegressionActionHead(width, width, ACTION_DIM - 1)).state_dict()
        expected = (
            f"with other shapes (e.g. action_head.model.layer_norm1.weight ({width * (ACTION_DIM - 1)},) vs "
            f"({width * ACTION_DIM},)"
        )
    with pytest.raises(CheckpointError) as err:
        load(variant(release, tmp_path, vla, **parts))
    message = str(err.value)
    assert "\n" not in message and expected in message, message


def test_folder_problems_are_one_line(release: dict, tmp_path: Path) -> None:
    def raises(match: str, fn, *args, **kwargs) -> None:
        with pytest.raises(CheckpointError, match=match) as err:
            fn(*args, **kwargs)
        assert "\n" not in str(err.value)

    folder = shutil.copytree(release["folder"], tmp_path / "two_steps")
    torch.save(release["components"]["action_head"], folder / "action_head--50000_checkpoint.pt")
    raises(
        r"holds 2 action_head checkpoints \(action_head--150000_checkpoint.pt, action_head--50000",
        read_oft_folder,
        folder,
    )
    raises("has no proprio_projector--50000_checkpoint.pt", read_oft_folder, folder, step=50000)
    (folder / "action_head--50000_checkpoint.pt").unlink()
    assert set(read_oft_folder(folder, step=STEP)) == set(read_oft_folder(release["folder"]))

    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    raises(f"lists 1 shards that are not there .e.g. {shard.name}", read_oft_folder, folder)
    for f in folder.glob("model*"):
        f.unlink()
    raises("holds only a LoRA adapter", read_oft_folder, folder)
    raises("is not a folder", read_oft_folder, folder / "config.json")

    film = shutil.copytree(release["folder"], tmp_path / "film")
    torch.save({"featurizer.pos_embed": torch.zeros(1)}, film / f"vision_backbone--{STEP}_checkpoint.pt")
    raises("FiLM vision backbone", read_oft_folder, film)

    broken = shutil.copytree(release["folder"], tmp_path / "broken")
    (broken / f"action_head--{STEP}_checkpoint.pt").write_bytes(b"not a checkpoint")
    raises("is not a readable torch checkpoint", read_oft_folder, broken)

    diffusion = shutil.copytree(release["folder"], tmp_path / "diffusion")
    torch.save({"module.fc1.weight": torch.zeros(4, 1)}, diffusion / f"noisy_action_projector--{STEP}_checkpoint.pt")
    raises("a diffusion OpenVLA-OFT checkpoint", load, diffusion)


# --- dataset_statistics.json -----------------------------------------------------------------------
def test_read_oft_statistics_in_the_released_format(release: dict) -> None:
    folder = release["folder"]
    written = json.loads((folder / "dataset_statistics.json").read_text())[UNNORM_KEY]
    for source in (folder, folder / "dataset_statistics.json"):
        out = read_oft_statistics(source)
        assert out["unnorm_key"] == UNNORM_KEY and set(out) == {"action", "proprio", "unnorm_key"}
        for feature, dims in (("action", ACTION_DIM), ("proprio", PROPRIO_DIM)):
            got = out[feature]
            assert set(got) == {"q01", "q99", "mean", "std", "min", "max", "mask"}
            for stat in ("q01", "q99", "mean", "std", "min", "max"):
                assert got[stat].dtype == np.float64 and got[stat].shape == (dims,)
                assert np.array_equal(got[stat], np.asarray(written[feature][stat])), (feature, stat)
            assert got["mask"].dtype == bool
        assert out["action"]["mask"].tolist() == [True] * 6 + [False]  # the gripper is not normalised
        assert out["proprio"]["mask"].all()  # no mask in the file: every dim (openvla-oft's default)
    assert read_oft_statistics(folder, "libero_spatial")["unnorm_key"] == UNNORM_KEY  # the _no_noops suffix


def test_read_oft_statistics_names_the_keys_when_ambiguous_or_missing(release: dict, tmp_path: Path) -> None:
    config = release["folder"] / "config.json"
    with pytest.raises(
        CheckpointError,
        match="holds statistics of 2 datasets; choose one with unnorm_key: bridge_orig, fractal20220817_data$",
    ):
        read_oft_statistics(config)
    with pytest.raises(
        CheckpointError, match="no statistics for unnorm_key='libero_10'; available: bridge_orig, fractal20220817_data$"
    ):
        read_oft_statistics(config, "libero_10")
    with pytest.raises(CheckpointError, match=f"available: {UNNORM_KEY}$"):
        read_oft_statistics(release["folder"], "bridge_orig")
    assert read_oft_statistics(config, "bridge_orig")["proprio"]["q01"].shape == (7,)

    base = tmp_path / "openvla-7b"  # a base OpenVLA folder: the config's norm_stats only
    base.mkdir()
    shutil.copy(config, base / "config.json")
    assert read_oft_statistics(base, "fractal20220817_data")["unnorm_key"] == "fractal20220817_data"
    (base / "config.json").write_text(json.dumps({"model_type": "openvla", "norm_stats": None}))
    with pytest.raises(CheckpointError, match="has no norm_stats"):
        read_oft_statistics(base)
    bad = tmp_path / "dataset_statistics.json"
    bad.write_text(json.dumps({UNNORM_KEY: {"action": {"mean": [0.0]}}}))
    with pytest.raises(CheckpointError, match=r"libero_spatial_no_noops.action has no q01/q99 \(it has mean\)"):
        read_oft_statistics(bad)
