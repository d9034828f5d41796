"""lerobot 0.4.4's GR00T N1.5 (`lerobot.policies.groot`) at a small size, run under the lerobot venv
(`python -m ebrl.envs.setup lerobot`) by tests/policies/test_groot_parity.py; not imported by EBRL.

    python groot_reference.py SPEC.json OUT_DIR
    python groot_reference.py act SPEC.json JOB.json

SPEC.json holds the sizes (our preset's dims), the batch, the embodiment id and a seed. The script builds lerobot's
GR00TN15 (small Eagle 2.5 VLM + FlowmatchingActionHead) from lerobot's own config objects, with random weights,
and writes to OUT_DIR:
- nvidia/: GR00TN15.save_pretrained with a small max_shard_size: config.json, model-0000N-of-0000M.safetensors
  and model.safetensors.index.json, the layout of NVIDIA's GR00T-N1.5-3B release (transformers' save_pretrained);
- lerobot/: lerobot's GrootPolicy built from nvidia/ (GR00TN15.from_pretrained, as lerobot builds a policy from a
  base model) and saved by GrootPolicy.save_pretrained (model.safetensors, keys under `_groot_model.`);
- lerobot_tied/: that policy with Qwen3's lm_head tied to embed_tokens (transformers' tie_weights; N1.5's config
  ties them, and GR00TN15 built from it has them tied, but from_pretrained leaves them apart), saved the same way:
  safetensors' save_model keeps only lm_head of the shared tensor;
- io.safetensors: the inputs (pixel values, input ids, state, backbone features) and lerobot's outputs: the
  backbone's features, and for the action head on given backbone features (head_*) and for the whole model
  (full_*) the chain's starting noise, the actions and timestep of every Euler step, the velocity there, and the
  denoised chunk.
`act` loads folders someone else wrote (`python -m ebrl.export`) as lerobot loads a groot fine-tune and acts on
io.safetensors' inputs (`act`'s docstring).
Only lerobot's config objects are edited (sizes, SDPA attention), with one substitution: lerobot's Eagle forces
flash_attention_2 onto its SigLIP and flash-attn is not installed, so SigLIP is built with SDPA (`sdpa_siglip`);
its modules run unchanged otherwise, observed through forward hooks. No network: Eagle's config.json and the
tokenizer asset files lerobot would download are written locally (the backbone reads only config.json; the
tokenizer files are placeholders, no processor runs here).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

for op in ("nms", "qnms"):  # PyPI's torchvision links CUDA; lerobot's groot never calls these ops
    torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

ASSETS_REPO = "lerobot/eagle2hg-processor-groot-n1p5"
PLACEHOLDER_ASSETS = [
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer_config.json",
]


def eagle_config(d: dict) -> dict:
    """Eagle 2.5's config.json at our sizes: SigLIP (no pixel shuffle, 1-layer mlp1, as N1.5) + Qwen3, whose layers
    beyond select_layer lerobot's EagleBackbone pops; the vision select_layer takes the last SigLIP layer's output."""
    return {
        "model_type": "eagle_2_5_vl",
        "auto_map": {
            "AutoConfig": "configuration_eagle2_5_vl.Eagle25VLConfig",
            "AutoModel": "modeling_eagle2_5_vl.Eagle25VLForConditionalGeneration",
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": d["vit_width"],
            "intermediate_size": d["vit_mlp"],
            "num_hidden_layers": d["vit_depth"],
            "num_attention_heads": d["vit_heads"],
            "image_size": d["image_size"],
            "patch_size": d["patch_size"],
            "num_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        "text_config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": d["width"],
            "intermediate_size": d["mlp"],
            "num_hidden_layers": d["depth"] + 1,
            "num_attention_heads": d["heads"],
            "num_key_value_heads": d["kv_heads"],
            "head_dim": d["head_dim"],
            "vocab_size": d["vocab"],
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "max_position_embeddings": 512,
            "hidden_act": "silu",
            "attention_bias": False,
            "_attn_implementation": "sdpa",
        },
        "select_layer": d["vit_depth"],
        "use_pixel_shuffle": False,
        "mlp_connector_layers": 1,
        "force_image_size": d["image_size"],
        "image_token_index": d["image_token"],
        "_attn_implementation": "sdpa",
    }


def groot_config(d: dict, spec: dict):
    from lerobot.policies.groot.groot_n1 import GR00TN15Config

    inner = d["dit_heads"] * d["dit_head_dim"]
    head = {
        "action_dim": d["max_action_dim"],
        "action_horizon": spec["chunk"],
        "add_pos_embed": True,
        "backbone_embedding_dim": d["width"],
        "input_embedding_dim": inner,
        "hidden_size": d["hidden_size"],
        "max_seq_len": d["max_seq_len"],
        "max_state_dim": d["max_state_dim"],
        "max_num_embodiments": d["embodiments"],
        "num_inference_timesteps": spec["steps"],
        "num_target_vision_tokens": d["future_tokens"],
        "use_vlln": True,
        "model_dtype": "float32",
        "noise_beta_alpha": 1.5,
        "noise_beta_beta": 1.0,
        "noise_s": 0.999,
        "num_timestep_buckets": 1000,
        "tune_projector": True,
        "tune_diffusion_model": True,
        "diffusion_model_cfg": {
            "num_attention_heads": d["dit_heads"],
            "attention_head_dim": d["dit_head_dim"],
            "output_dim": d["dit_output_dim"],
            "num_layers": d["dit_layers"],
            "dropout": 0.2,
            "final_dropout": True,
            "interleave_self_attention": True,
            "norm_type": "ada_norm",
            "positional_embeddings": None,
            "cross_attention_dim": d["width"],
        },
        "vl_self_attention_cfg": {
            "num_attention_heads": d["vl_heads"],
            "attention_head_dim": d["vl_head_dim"],
            "num_layers": d["vl_layers"],
            "dropout": 0.2,
            "final_dropout": True,
            "positional_embeddings": None,
        },
    }
    backbone = {
        "select_layer": d["depth"],
        "project_to_dim": None,
        "tune_llm": False,
        "tune_visual": False,
        "reproject_vision": False,
        "use_flash_attention": False,
        "load_bf16": False,
        "tokenizer_assets_repo": ASSETS_REPO,
    }
    return GR00TN15Config(
        backbone_cfg=backbone,
        action_head_cfg=head,
        action_horizon=spec["chunk"],
        action_dim=d["max_action_dim"],
        compute_dtype="float32",
    )


def sdpa_siglip() -> None:
    """lerobot's Eagle builds its SigLIP with flash_attention_2 forced on (flash-attn is not installed, and
    transformers refuses to build it then): the SiglipVisionModel its module imports is swapped, before that module
    is loaded, for one that asks for SDPA instead (the same attention; the same modules and parameter names)."""
    from transformers.models.siglip import modeling_siglip

    base = modeling_siglip.SiglipVisionModel

    class SdpaSiglipVisionModel(base):
        def __init__(self, config) -> None:
            config._attn_implementation = "sdpa"
            super().__init__(config)

    modeling_siglip.SiglipVisionModel = SdpaSiglipVisionModel


class Recorder:
    """The actions and timesteps entering the action encoder and the velocity leaving the action decoder, per
    Euler step of get_action (forward hooks: lerobot's modules run unchanged)."""

    def __init__(self, head, horizon: int) -> None:
        self.x, self.t, self.v = [], [], []
        head.action_encoder.register_forward_pre_hook(self._enter)
        head.action_decoder.register_forward_hook(self._leave)
        self.horizon = horizon

    def _enter(self, _module, args) -> None:
        self.x.append(args[0].detach().clone())
        self.t.append(args[1].detach().clone())

    def _leave(self, _module, _args, out) -> None:
        self.v.append(out[:, -self.horizon :].detach().clone())

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}_x": torch.stack(self.x, 1),
            f"{prefix}_t": torch.stack(self.t, 1).float(),
            f"{prefix}_v": torch.stack(self.v, 1),
        }


def offline_home(d: dict) -> None:
    """A lerobot home of its own with Eagle's config.json at our sizes and placeholder tokenizer assets: nothing is
    downloaded (before lerobot is imported: it reads HF_LEROBOT_HOME then)."""
    home = Path(tempfile.mkdtemp(prefix="lerobot-home-"))
    os.environ["HF_LEROBOT_HOME"] = str(home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_MODULES_CACHE"] = str(home / "modules")  # where trust_remote_code copies Eagle's modules
    cache = home / ASSETS_REPO
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps(eagle_config(d)))
    for name in PLACEHOLDER_ASSETS:
        (cache / name).write_text("{}")


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    d, batch, out = spec["dims"], spec["batch"], Path(out_dir)
    offline_home(d)

    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.groot_n1 import GR00TN15
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from safetensors.torch import save_file
    from transformers.feature_extraction_utils import BatchFeature

    sdpa_siglip()

    torch.manual_seed(spec["seed"])
    model = GR00TN15(groot_config(d, spec), local_model_path=str(out / "nvidia"))
    with torch.no_grad():  # random weights everywhere, biases and norms included (not only the default init)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(out / "nvidia"), max_shard_size="4MB", safe_serialization=True)

    config = GrootConfig(
        base_model_path=str(out / "nvidia"),
        max_state_dim=d["max_state_dim"],
        max_action_dim=d["max_action_dim"],
        chunk_size=spec["chunk"],
        n_action_steps=spec["chunk"],
        use_bf16=False,
        image_size=(d["image_size"], d["image_size"]),
        device="cpu",
        input_features={
            "observation.images.front": PolicyFeature(
                type=FeatureType.VISUAL, shape=(3, d["image_size"], d["image_size"])
            )
        },
    )
    policy = GrootPolicy(config)
    policy.save_pretrained(str(out / "lerobot"))
    reloaded = policy._groot_model.eval()
    # (lm_head, tied to embed_tokens, is not saved and comes back re-initialised: GR00T never runs it)
    reloaded_state = reloaded.state_dict()
    differ = [k for k, v in model.state_dict().items() if "lm_head" not in k and not torch.equal(v, reloaded_state[k])]
    assert not differ, f"lerobot's GrootPolicy did not reload the saved GR00TN15 weights: {differ[:3]}"
    # lerobot_tied/: the same policy with Qwen3's lm_head tied to embed_tokens, as N1.5's config ties them
    # (from_pretrained above left them apart), by transformers' own tie_weights; save_pretrained's save_model then keeps
    # lm_head only
    language_model = reloaded.backbone.eagle_model.language_model
    language_model.tie_weights()
    assert language_model.lm_head.weight is language_model.model.embed_tokens.weight
    policy.save_pretrained(str(out / "lerobot_tied"))

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    patches = (d["image_size"] // d["patch_size"]) ** 2
    ids = torch.randint(3, d["image_token"], (batch, spec["text_tokens"]), generator=g)
    input_ids = torch.cat([torch.full((batch, patches), d["image_token"]), ids], 1)
    pixel_values = torch.rand(batch, 3, d["image_size"], d["image_size"], generator=g) * 2 - 1
    state = torch.randn(batch, 1, d["max_state_dim"], generator=g)
    embodiment = torch.full((batch,), spec["embodiment_id"], dtype=torch.long)
    io = {"input_ids": input_ids, "pixel_values": pixel_values, "state": state[:, 0]}
    head = model.action_head
    with torch.no_grad():
        # the backbone: Eagle on [image tokens, instruction tokens], no padding
        vl = BatchFeature(
            {
                "eagle_input_ids": input_ids,
                "eagle_attention_mask": torch.ones_like(input_ids),
                "eagle_pixel_values": pixel_values,
                "eagle_image_sizes": None,
            }
        )
        io["backbone_features"] = model.backbone(vl)["backbone_features"]
        # the action head alone on given backbone features; get_action draws the chain's start with torch.randn
        features = torch.randn(batch, spec["vl_tokens"], d["width"], generator=g)
        io["head_features"] = features
        recorder = Recorder(head, spec["chunk"])
        torch.manual_seed(spec["seed"] + 2)
        chunk = head.get_action(
            BatchFeature(
                {"backbone_features": features.clone(), "backbone_attention_mask": torch.ones(batch, spec["vl_tokens"])}
            ),
            BatchFeature({"state": state, "embodiment_id": embodiment}),
        )["action_pred"]
        io.update(recorder.tensors("head"), head_chunk=chunk)
        # the whole model: GR00TN15.get_action's two calls (its prepare_input only moves CPU float32 tensors to
        # CPU float32, through dm-tree, which the venv does not have)
        recorder = Recorder(head, spec["chunk"])
        torch.manual_seed(spec["seed"] + 3)
        vl = BatchFeature(
            {
                "eagle_input_ids": input_ids,
                "eagle_attention_mask": torch.ones_like(input_ids),
                "eagle_pixel_values": pixel_values,
                "eagle_image_sizes": None,
            }
        )
        chunk = head.get_action(model.backbone(vl), BatchFeature({"state": state, "embodiment_id": embodiment}))[
            "action_pred"
        ]
        io.update(recorder.tensors("full"), full_chunk=chunk)
    save_file({k: v.contiguous() for k, v in io.items()}, str(out / "io.safetensors"))
    print(
        json.dumps(
            {
                "parameters": sum(p.numel() for p in model.parameters()),
                "nvidia_files": sorted(p.name for p in (out / "nvidia").iterdir()),
                "lerobot_files": sorted(p.name for p in (out / "lerobot").iterdir()),
            }
        )
    )


def act(spec_path: str, job_path: str) -> None:
    """Each job case's folder loaded by lerobot's GrootPolicy.from_pretrained (strict, as it loads a fine-tune), and
    its GR00TN15.get_action on the reference's inputs (io.safetensors) for the case's embodiment, from the torch seed
    given: the chain's actions at every step (full_x; full_x[:, 0] is its noise) and the chunk, with the names of the
    tensors lerobot holds otherwise than the file."""
    spec = json.loads(Path(spec_path).read_text())
    offline_home(spec["dims"])

    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from safetensors.torch import load_file, save_file
    from transformers.feature_extraction_utils import BatchFeature

    sdpa_siglip()
    job = json.loads(Path(job_path).read_text())
    io = load_file(job["io"])
    for case in job["cases"]:
        policy = GrootPolicy.from_pretrained(case["folder"]).eval()
        weights = load_file(str(Path(case["folder"]) / "model.safetensors"))
        differ = [k for k, v in policy.state_dict().items() if k not in weights or not torch.equal(weights[k], v)]
        model = policy._groot_model
        recorder = Recorder(model.action_head, spec["chunk"])
        ids = io["input_ids"]
        torch.manual_seed(case["seed"])
        with torch.no_grad():
            vl = BatchFeature(
                {
                    "eagle_input_ids": ids,
                    "eagle_attention_mask": torch.ones_like(ids),
                    "eagle_pixel_values": io["pixel_values"],
                    "eagle_image_sizes": None,
                }
            )
            embodiment = torch.full((ids.shape[0],), case["embodiment_id"], dtype=torch.long)
            chunk = model.action_head.get_action(
                model.backbone(vl), BatchFeature({"state": io["state"][:, None], "embodiment_id": embodiment})
            )["action_pred"]
        save_file(
            {**recorder.tensors("full"), "full_chunk": chunk.contiguous()},
            case["out"],
            metadata={"differ": json.dumps(differ), "n_action_steps": str(policy.config.n_action_steps)},
        )


if __name__ == "__main__":
    if sys.argv[1] == "act":
        act(*sys.argv[2:4])
    else:
        main(*sys.argv[1:3])
