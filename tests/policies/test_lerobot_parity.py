"""Our pi0 / pi0.5 against lerobot 0.4.4's PI0Policy / PI05Policy (the reference users have; lerobot 0.6 is a Python
3.12 wheel, not set up here), on the same weights, observations, statistics and noise.

lerobot_reference.py runs under lerobot's own interpreter (`python -m ebrl.envs.setup lerobot`) and writes, with
lerobot's and safetensors' writers, its save_pretrained folder and openpi's converter layout of the same weights,
plus what lerobot acts on a batch. We load both folders and compare: the tokens its processor gives (with a real
SentencePiece model trained here), its normalised state, and its deterministic chunk through its post-processor.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ebrl.config import ConfigError
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.envs.setup import benchmark_python
from ebrl.policies.build import build_policy
from ebrl.policies.layers import resize_with_pad
from ebrl.policies.openpi import OpenPIPolicy
from ebrl.policies.tokenizer import PaligemmaTokenizer, train_gemma_like
from tests.conftest import ONE_THREAD

REFERENCE = Path(__file__).with_name("lerobot_reference.py")
CORPUS = [
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "put the cream cheese in the bowl",
    "open the top drawer and put the bowl inside",
    "turn on the stove",
    "Task: lift the red cube, State: 12 128 255 0 77 3;\nAction: ",
    "push the plate to the front of the stove",
    "put both the alphabet soup and the tomato sauce in the basket",
]


def train_sentencepiece(path: Path) -> Path:
    return train_gemma_like(path, CORPUS)


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def reference(request, lerobot_references) -> tuple[str, Path]:
    """(variant, its folder of tests/conftest.py's lerobot_references)."""
    return request.param, lerobot_references[request.param]


def build_ours(out: Path, layout: str, spec: EnvSpec | None = None, **overrides) -> tuple[torch.nn.Module, dict, dict]:
    """Our policy from the reference's folder `layout`, with lerobot's sizes; and the reference's record and batch."""
    cfg, spec = ours_config(out, layout, spec, **overrides)
    return (
        build_policy(cfg, spec),
        json.loads((out / "reference.json").read_text()),
        load_file(str(out / "reference.safetensors")),
    )


def ours_config(out: Path, layout: str, spec: EnvSpec | None = None, **overrides) -> tuple[dict, EnvSpec]:
    """The resolved policy config of our policy from the reference's folder `layout` (at lerobot's sizes, its
    cameras mapped to an env's agentview and wrist, the third masked), and that env's spec (or `spec`)."""
    meta = json.loads((out / "reference.json").read_text())
    obs = {
        "state": ArraySpec((meta["state_dim"],), "float32"),
        "image/agentview": ArraySpec((224, 224, 3), "uint8"),
        "image/wrist": ArraySpec((224, 224, 3), "uint8"),
    }
    spec = spec or EnvSpec(obs=obs, action_dim=meta["action_dim"], instruction=meta["tasks"][0], max_episode_steps=10)
    vlm, expert, vision = meta["vlm"], meta["expert"], meta["vision"]
    dims = dict(
        image_size=224,
        patch_size=vision["patch_size"],
        vit_width=vision["hidden_size"],
        vit_depth=vision["num_hidden_layers"],
        vit_mlp=vision["intermediate_size"],
        vit_heads=vision["num_attention_heads"],
        width=vlm["width"],
        depth=vlm["depth"],
        mlp=vlm["mlp_dim"],
        heads=vlm["num_heads"],
        kv_heads=vlm["num_kv_heads"],
        head_dim=vlm["head_dim"],
        expert_width=expert["width"],
        expert_mlp=expert["mlp_dim"],
    )
    cfg = {
        "_target_": "ebrl.policies.openpi.OpenPIPolicy",
        "name": "openpi",
        "preset": "full",
        "dtype": "float32",
        "checkpoint": str(out / layout),
        "tokenizer": str(out / "paligemma_tokenizer.model"),
        "dims": dims,
        "cameras": {"base_0_rgb": "agentview", "left_wrist_0_rgb": "wrist", "right_wrist_0_rgb": None},
        **overrides,
    }
    return cfg, spec


def training_layouts(out: Path) -> None:
    """The folders their training runs leave, around the same files: lerobot's checkpoints/<step>/pretrained_model/
    and openpi's train_pytorch <step>/ (model.safetensors, optimizer.pt, metadata.pt, assets/)."""
    import shutil

    shutil.copytree(out / "lerobot", out / "lerobot_run" / "checkpoints" / "000100" / "pretrained_model")
    step = out / "openpi_run" / "30000"
    shutil.copytree(out / "openpi" / "assets", step / "assets")
    shutil.copy(out / "openpi" / "model.safetensors", step / "model.safetensors")
    torch.save({"state": {}, "param_groups": []}, step / "optimizer.pt")
    torch.save({"global_step": 30000}, step / "metadata.pt")


# transformers' PaliGemmaForConditionalGeneration._checkpoint_conversion_mapping (4.52 on), read backwards: the names
# transformers < 4.52 gave PaliGemma's parts, as lerobot's first pi0 files have them
FEB_2025_NAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def first_lerobot_layout(out: Path, name: str = "lerobot_feb2025") -> int:
    """<out>/<name>/: the layout of the lerobot/pi0 files published in February 2025 (lerobot 0.1, transformers
    < 4.52), derived from lerobot 0.4.4's save_pretrained file of the same weights by renaming PaliGemma's keys
    (`FEB_2025_NAMES`, under model.paligemma_with_expert.paligemma.); the tied embed_tokens is absent, as save_model
    left it. Its config.json and processors stay 0.4.4's. Returns how many keys were renamed."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(out / "lerobot", out / name)
    prefix = "model.paligemma_with_expert.paligemma."
    state, renamed = {}, 0
    for key, value in load_file(str(out / "lerobot" / "model.safetensors")).items():
        for new, old in FEB_2025_NAMES:
            if key.startswith(prefix + new):
                key, renamed = prefix + old + key[len(prefix + new) :], renamed + 1
                break
        state[key] = value
    assert not any("embed_tokens" in k or ".model.language_model." in k for k in state)
    save_file(state, str(out / name / "model.safetensors"))
    return renamed


def lerobot_061_layout(out: Path, name: str = "lerobot_0.6.1") -> None:
    """<out>/<name>/: the layout lerobot 0.6.1's save_pretrained leaves, derived from 0.4.4's file of the same
    weights: 0.6.1 no longer ties PaliGemma's lm_head to embed_tokens, so its file holds both names, as two tensors
    (equal until a 0.6.1 fine-tune moves one). Its config.json and processors stay 0.4.4's."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(out / "lerobot", out / name)
    state = load_file(str(out / "lerobot" / "model.safetensors"))
    embed, head = (f"model.{k}" for k in OpenPIPolicy.TIED)
    assert embed not in state
    save_file({**state, embed: state[head].clone()}, str(out / name / "model.safetensors"))


def test_lerobot_and_openpi_layouts_act_as_lerobot(reference, one_thread) -> None:
    variant, out = reference
    training_layouts(out)
    if variant == "pi0":  # (pi0.5 came after that layout)
        assert first_lerobot_layout(out) == len(
            [k for k in build_ours(out, "lerobot")[0].state_dict() if k.startswith("paligemma_with_expert.paligemma.")]
        )
    layouts = [("lerobot", {})] + (
        [
            ("lerobot_feb2025", {}),
            ("lerobot_run/checkpoints/000100", {}),
            # (openpi's trainer writes no config.json: the horizon is given too)
            ("openpi_run/30000", {"denoise_steps": 3, "chunk": 6, "prompt_style": "lerobot"}),
        ]
        if variant == "pi0"
        else []
    )
    for layout, overrides in (
        *layouts,
        # openpi's converter records neither the steps nor how its prompts were made: the
        # reference's (lerobot's processors, 3 steps) are given
        ("openpi", {"denoise_steps": 3, "prompt_style": "lerobot"}),
    ):
        policy, meta, ref = build_ours(out, layout, **overrides)
        assert policy.variant == variant and policy.chunk_len == meta["chunk"], layout
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize(meta["tasks"]))
        state = policy.normalize_state(ref["state"])
        # the statistics: lerobot's eps for its folder, openpi's 1e-6 for norm_stats.json
        assert (state - ref["normalized_state"][:, : state.shape[1]]).abs().max() < (
            1e-6 if layout == "lerobot" else 1e-5
        )
        if variant == "pi05":  # the prompt holds the state
            tokens, mask = policy.state_prompt_tokens(tokens, mask, state)
        assert torch.equal(tokens, ref["tokens"]) and torch.equal(mask, ref["token_mask"]), layout
        obs = {
            "state": ref["state"],
            "image/agentview": ref["image/base_0_rgb"],
            "image/wrist": ref["image/left_wrist_0_rgb"],
            **dict(zip(("tokens", "token_mask"), (torch.from_numpy(a) for a in policy.tokenize(meta["tasks"])))),
        }
        sample = policy.sample(obs, deterministic=True, noise=ref["noise"])
        model_chunk = sample.extras["chain"][:, -1, :, : meta["action_dim"]]
        assert (model_chunk - ref["model_chunk"]).abs().max() < 1e-4, layout
        assert (sample.chunk - ref["actions"]).abs().max() < 1e-4 * max(1.0, ref["actions"].abs().max()), layout


def test_resize_with_pad_is_openpis(reference) -> None:
    _, out = reference
    ref = load_file(str(out / "reference.safetensors"))
    ours = resize_with_pad(ref["wide"].permute(0, 3, 1, 2), 224, 224).permute(0, 2, 3, 1)
    assert ours.shape == ref["wide_padded"].shape and (ours - ref["wide_padded"]).abs().max() < 1e-6


def test_openpi_prompts(tmp_path) -> None:
    """openpi's rules (its tokenizer does not install here: jax, orbax): cleaned text, BOS, "\\n" encoded apart;
    pi0.5's state digitised into 256 bins (np.digitize: below -1 gives -1, at or above 1 gives 255, as openpi writes
    them); padded to the budget with a False mask; truncated past it."""
    import sentencepiece

    model = train_sentencepiece(tmp_path / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    tok = PaligemmaTokenizer(model, max_len=48)
    tokens, mask = tok.tokenize(["put_the bowl\non the plate "])
    want = sp.Encode("put the bowl on the plate", add_bos=True) + sp.Encode("\n")
    assert tokens[0, : len(want)].tolist() == want and mask[0].sum() == len(want) and not tokens[0, len(want) :].any()
    state = np.array([-1.5, -1.0, 0.0, 0.999, 1.0, 2.0])
    ids = PaligemmaTokenizer(model, max_len=200).ids("lift it", state)
    assert sp.Decode(ids) == "Task: lift it, State: -1 0 128 255 255 255;\nAction: "
    assert PaligemmaTokenizer(model, max_len=5).tokenize([CORPUS[0]])[1].all()
    with pytest.raises(ConfigError, match="policy.tokenizer=.* does not exist"):
        PaligemmaTokenizer(tmp_path / "missing.model", 48)


QUEUE = Path(__file__).with_name("lerobot_queue_reference.py")


@pytest.mark.slow
def test_executing_k_of_each_chunk_acts_as_lerobots_select_action_queue(reference) -> None:
    """lerobot's select_action with n_action_steps=4 of its chunk of 6, closed loop on robosuite Lift for 20 steps
    (the queue refills from the observation after 4 actions), against our policy from the same folder executing
    `policy.execute` (read from that folder) of each chunk sampled from the observation lerobot refilled on, with the
    same noise. (Each side's own closed loop drifts apart: the random small policy's actions, 2e-5 apart, slam the arm
    about and the physics multiplies the difference, 0.09 in the state by step 16; so the observations are
    lerobot's.)"""
    from ebrl.policies.build import settle_execute
    from tests.conftest import compose_config

    variant, out = reference
    k, steps = 4, 20
    subprocess.run(
        [str(benchmark_python("lerobot")), str(QUEUE), str(out), variant, str(k), str(steps)],
        check=True,
        capture_output=True,
        timeout=300,
        env=ONE_THREAD,
    )
    ref = load_file(str(out / "queue.safetensors"))
    cfg = compose_config(f"policy.checkpoint={out / 'lerobot_queue'}")
    settle_execute(cfg)
    assert cfg.policy.execute == k  # the folder's n_action_steps
    spec = EnvSpec(
        obs={"state": ArraySpec((8,), "float32"), "image/agentview": ArraySpec((64, 64, 3), "uint8")},
        action_dim=7,
        instruction="lift the red cube",
        max_episode_steps=200,
    )

    def executed(execute: int) -> torch.Tensor:
        """The actions our runtime sends the env: the first `execute` of each chunk, sampled every `execute` steps
        from lerobot's observation at that step, the chunks' noises in order."""
        policy, _, _ = build_ours(
            out,
            "lerobot_queue",
            execute=execute,
            spec=spec,
            cameras={"base_0_rgb": "agentview", "left_wrist_0_rgb": None, "right_wrist_0_rgb": None},
        )
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([spec.instruction]))
        actions = []
        for noise, t in zip(ref["noise"], range(0, steps, policy.execute)):
            obs = {
                "state": ref["state"][t : t + 1, :8],
                "image/agentview": ref["image"][t : t + 1],
                "tokens": tokens,
                "token_mask": mask,
            }
            actions.append(policy.sample(obs, deterministic=True, noise=noise[None]).chunk[0, : policy.execute])
        return torch.cat(actions)[:steps]

    scale = max(1.0, float(ref["actions"].abs().max()))
    assert (executed(cfg.policy.execute) - ref["actions"]).abs().max() < 1e-4 * scale
    whole = executed(6)  # the whole chunk, open loop: lerobot's queue refilled at step 4 and ours did not
    assert (whole[:k] - ref["actions"][:k]).abs().max() < 1e-4 * scale
    assert (whole[k:6] - ref["actions"][k:6]).abs().max() > 1e-2
