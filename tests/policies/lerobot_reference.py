"""The reference side of the pi0 / pi0.5 parity tests: run under lerobot 0.4.4's own interpreter
(`python -m ebrl.envs.setup lerobot`), never imported by ours.

    python lerobot_reference.py reference <out folder> <SentencePiece model file> pi0 pi05
    python lerobot_reference.py act <job.json>

`reference` builds lerobot's PI0Policy / PI05Policy at a small size with random weights and random dataset
statistics, and writes to <out>/<variant>/, with lerobot's and safetensors' own writers:
- <out>/lerobot/: `policy.save_pretrained` + the pre/post-processors' `save_pretrained` (lerobot 0.4's layout);
- <out>/openpi/: what openpi's JAX-to-PyTorch converter leaves (examples/convert_jax_model_to_pytorch.py):
  `safetensors.torch.save_model(PI0Pytorch)` (lerobot's `policy.model` is openpi's PI0Pytorch, module for module),
  its config.json record and assets/<asset_id>/norm_stats.json as openpi's normalize.save writes it;
- <out>/reference.safetensors: a batch of raw observations, the noise, and what lerobot makes of them: the tokens and
  mask its processor gives, the normalised state, the model's (normalised) chunk and the env actions after its
  post-processor, all from `predict_action_chunk(noise=...)`.
`act` loads folders written by someone else (`python -m ebrl.export`) the way lerobot loads a policy folder
(`from_pretrained`, `make_pre_post_processors(pretrained_path=...)`; an openpi-layout folder with the reference's
lerobot config and its norm_stats.json as the dataset statistics) and acts on the reference's batch with its noise;
the job is {"tokenizer": <SentencePiece model file>, "cases": [{"variant", "folder", "reference", "out"}, ...]}, and
each case's chunk, actions and the names of the tensors lerobot holds otherwise than the file go to its "out".
What is changed in lerobot, all before anything runs: its sizes (it hardcodes SigLIP So400m and Gemma 2B / 300M;
here they shrink, by editing the config objects it builds its real modules from), where the PaliGemma tokenizer is
read from (a local folder made from the given SentencePiece model instead of the hub), and the two torchvision op
schemas (PyPI's torchvision links CUDA, so its C ops do not load on a CPU torch; no policy here calls them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

for _op in ("nms", "qnms"):
    torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import numpy as np  # noqa: E402
from safetensors.torch import save_file, save_model  # noqa: E402

# the small sizes (the test builds ours at the same ones)
VLM = dict(width=64, depth=2, mlp_dim=128, num_heads=2, num_kv_heads=1, head_dim=32)
EXPERT = dict(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=32)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=14)
STATE_DIM, ACTION_DIM, CHUNK, STEPS, BATCH = 8, 7, 6, 3, 2
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")  # the last is left out of the batch: masked
TASKS = ["pick up the black bowl between the plate and the ramekin", "put_the cream cheese\nin the bowl"]


def shrink(module) -> None:
    """lerobot's modeling module with a Gemma size of our own and a small SigLIP (once per module)."""
    if getattr(module, "_shrunk", False):
        return
    module._shrunk = True

    def get_gemma_config(variant):  # (the config validates the names: the real ones, at our sizes)
        return module.GemmaConfig(**(VLM if variant == "gemma_2b" else EXPERT))

    module.get_gemma_config = get_gemma_config
    real = module.PaliGemmaForConditionalGeneration

    def paligemma(config):
        for key, value in VISION.items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = config.text_config.hidden_size
        return real(config=config)

    module.PaliGemmaForConditionalGeneration = paligemma


def local_tokenizer(model_file: str, folder: Path) -> str:
    """A Hugging Face Gemma tokenizer folder from the SentencePiece model, as google/paligemma-3b-pt-224 ships one,
    and lerobot's processors reading it instead of the hub."""
    from transformers import AutoTokenizer, GemmaTokenizerFast

    GemmaTokenizerFast(vocab_file=model_file, add_bos_token=True, add_eos_token=False).save_pretrained(folder)
    real = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        return real(cls, str(folder) if name == "google/paligemma-3b-pt-224" else name, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)
    return str(folder)


def lerobot_variant(variant: str) -> tuple:
    """lerobot's modeling module (shrunk), policy class, config class and processor factory of pi0 or pi0.5."""
    if variant == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as processors

        policy_cls = modeling.PI0Policy
    else:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as processors

        policy_cls = modeling.PI05Policy
    shrink(modeling)
    return modeling, policy_cls, Config, processors


def env_batch(ref: dict[str, torch.Tensor], tasks: list[str]) -> dict:
    """The raw batch lerobot's pre-processor takes: state, the images as float in [0, 1] (channels first), tasks."""
    batch = {"observation.state": ref["state"], "task": list(tasks)}
    for key, image in ref.items():
        if key.startswith("image/"):
            batch[f"observation.images.{key[len('image/') :]}"] = image.permute(0, 3, 1, 2).float() / 255.0
    return batch


def reference(out: Path, variant: str) -> None:
    from lerobot.configs.types import FeatureType, PolicyFeature

    modeling, policy_cls, Config, processors = lerobot_variant(variant)
    torch.manual_seed(0)
    features = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))}
    for cam in CAMERAS:
        features[f"observation.images.{cam}"] = PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224))
    config = Config(
        dtype="float32",
        chunk_size=CHUNK,
        n_action_steps=CHUNK,
        num_inference_steps=STEPS,
        device="cpu",
        input_features=features,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
    )
    policy = policy_cls(config).eval()
    with torch.no_grad():  # random weights everywhere: lerobot's init leaves norms at 0 and adaRMS closed
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    stats = {
        "observation.state": {
            "mean": torch.randn(STATE_DIM, generator=g),
            "std": torch.rand(STATE_DIM, generator=g) + 0.5,
            "q01": -1.5 - torch.rand(STATE_DIM, generator=g),
            "q99": 1.5 + torch.rand(STATE_DIM, generator=g),
            "min": -3 * torch.ones(STATE_DIM),
            "max": 3 * torch.ones(STATE_DIM),
        },
        "action": {
            "mean": 0.1 * torch.randn(ACTION_DIM, generator=g),
            "std": torch.rand(ACTION_DIM, generator=g) + 0.5,
            "q01": -1.0 - torch.rand(ACTION_DIM, generator=g),
            "q99": 1.0 + torch.rand(ACTION_DIM, generator=g),
            "min": -2 * torch.ones(ACTION_DIM),
            "max": 2 * torch.ones(ACTION_DIM),
        },
    }
    pre, post = processors(config, dataset_stats=stats)

    # lerobot 0.4's layout
    policy.save_pretrained(out / "lerobot")
    pre.save_pretrained(out / "lerobot")
    post.save_pretrained(out / "lerobot")
    # openpi's converter layout: the PI0Pytorch module, its config record, the statistics in assets/<asset_id>
    (out / "openpi" / "assets" / "test_robot").mkdir(parents=True, exist_ok=True)
    save_model(policy.model, str(out / "openpi" / "model.safetensors"))
    (out / "openpi" / "config.json").write_text(
        json.dumps(
            {
                "action_dim": config.max_action_dim,
                "action_horizon": CHUNK,
                "paligemma_variant": "gemma_2b",
                "action_expert_variant": "gemma_300m",
                "precision": "float32",
            },
            indent=2,
        )
    )
    openpi_stats = {
        "norm_stats": {
            "state": {k: stats["observation.state"][k].tolist() for k in ("mean", "std", "q01", "q99")},
            "actions": {k: stats["action"][k].tolist() for k in ("mean", "std", "q01", "q99")},
        }
    }
    (out / "openpi" / "assets" / "test_robot" / "norm_stats.json").write_text(json.dumps(openpi_stats, indent=2))

    # a batch as an env gives it (uint8 images; lerobot takes them as float in [0, 1]) and what lerobot acts
    images = {cam: torch.randint(0, 256, (BATCH, 224, 224, 3), generator=g, dtype=torch.uint8) for cam in CAMERAS[:2]}
    state = torch.randn(BATCH, STATE_DIM, generator=g) * 1.5
    batch = env_batch({"state": state, **{f"image/{cam}": image for cam, image in images.items()}}, TASKS)
    noise = torch.randn(BATCH, CHUNK, config.max_action_dim, generator=g)
    processed = pre(batch)
    with torch.no_grad():
        chunk = policy.predict_action_chunk(processed, noise=noise)
    actions = post(chunk)
    tensors = {
        "state": state,
        "noise": noise,
        "tokens": processed["observation.language.tokens"].long(),
        "token_mask": processed["observation.language.attention_mask"].bool(),
        "normalized_state": processed["observation.state"].float(),
        "model_chunk": chunk.float(),
        "actions": actions.float(),
    }
    tensors.update({f"image/{cam}": image for cam, image in images.items()})
    # openpi's resize-with-pad as lerobot runs it, on a non-square image in [-1, 1]
    wide = torch.rand(BATCH, 180, 240, 3, generator=g) * 2 - 1
    tensors.update(wide=wide, wide_padded=modeling.resize_with_pad_torch(wide, 224, 224))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(
        json.dumps(
            {
                "tasks": TASKS,
                "vlm": VLM,
                "expert": EXPERT,
                "vision": VISION,
                "chunk": CHUNK,
                "steps": STEPS,
                "state_dim": STATE_DIM,
                "action_dim": ACTION_DIM,
                "cameras": list(CAMERAS),
                "max_tokens": config.tokenizer_max_length,
            }
        )
    )
    print(f"reference written to {out}")


def act(job: list[dict]) -> None:
    """Each case's folder loaded as lerobot loads a policy, acting on its reference's batch with its noise."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from safetensors.torch import load_file

    for case in job:
        _, policy_cls, _, processors = lerobot_variant(case["variant"])
        folder, ref_folder = Path(case["folder"]), Path(case["reference"])
        if (folder / "config.json").is_file() and "type" in json.loads((folder / "config.json").read_text()):
            policy = policy_cls.from_pretrained(folder)
            pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder))
        else:  # openpi's layout: the model file and assets/<asset_id>/norm_stats.json
            config = PreTrainedConfig.from_pretrained(ref_folder / "lerobot")
            policy = policy_cls.from_pretrained(folder, config=config)
            table = json.loads(next((folder / "assets").glob("*/norm_stats.json")).read_text())["norm_stats"]
            stats = {
                "observation.state": {k: torch.tensor(v) for k, v in table["state"].items()},
                "action": {k: torch.tensor(v) for k, v in table["actions"].items()},
            }
            pre, post = processors(config, dataset_stats=stats)
        # (lerobot 0.4.4's from_pretrained loads what fits and only prints what did not: the test checks the weights)
        weights = load_file(str(folder / "model.safetensors"))
        prefix = "" if next(iter(weights)).startswith("model.") else "model."
        weights = {prefix + k: v for k, v in weights.items()}
        differ = [k for k, v in policy.state_dict().items() if k not in weights or not torch.equal(weights[k], v)]
        ref = load_file(str(ref_folder / "reference.safetensors"))
        tasks = json.loads((ref_folder / "reference.json").read_text())["tasks"]
        with torch.no_grad():
            chunk = policy.predict_action_chunk(pre(env_batch(ref, tasks)), noise=ref["noise"])
        save_file(
            {"model_chunk": chunk.float().contiguous(), "actions": post(chunk).float().contiguous()},
            case["out"],
            metadata={"differ": json.dumps(differ), "n_action_steps": str(policy.config.n_action_steps)},
        )


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        root, model_file = Path(sys.argv[2]), sys.argv[3]
        local_tokenizer(model_file, root / "hf_tokenizer")
        for name in sys.argv[4:]:
            reference(root / name, name)
    else:
        local_tokenizer(json.loads(Path(sys.argv[2]).read_text())["tokenizer"], Path(sys.argv[2]).parent / "hf_tok")
        act(json.loads(Path(sys.argv[2]).read_text())["cases"])
