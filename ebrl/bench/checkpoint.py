"""A full-size pi0 from a lerobot-layout checkpoint folder, acting on a LIBERO observation: `python -m ebrl.bench.checkpoint`.

1. Writes a folder as lerobot 0.4's `save_pretrained` lays one out for pi0 (what tests/policies/test_lerobot_parity.py
   checks against the real writer at a small size): model.safetensors of random full-size weights in bfloat16 under
   "model." with PaliGemma's embed_tokens kept as its tied lm_head (safetensors' save_model drops the other name), the
   expert's unused lm_head, config.json, and the normaliser's processor files with random statistics; a SentencePiece
   model trained here stands in for PaliGemma's (its ids are a subset of the 257152 the embedding has).
2. Builds the policy from it as a run does (`build_policy` with policy.checkpoint=<folder>, policy.tokenizer, the
   camera slots mapped), and samples one deterministic chunk on one observation of LIBERO's libero_spatial task 0 (its
   own interpreter renders agentview and the wrist camera at 224 px), with the real prompt path.
Prints the time of each step and the process's peak memory. Needs about 16 GB and 8 GB of disk in --dir.
LIBERO's state is our adapter's vector, whose first 8 dims are openpi's LIBERO state (eef position, axis-angle,
gripper qpos) and the rest the objects': `policy.state_dims` picks those 8.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.tokenizer import train_gemma_like

SLOTS = {"base_0_rgb": "agentview", "left_wrist_0_rgb": "robot0_eye_in_hand", "right_wrist_0_rgb": None}
STATE_DIM, ACTION_DIM = 8, 7
OBS_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
from ebrl.envs.libero_env import LiberoEnv
env = LiberoEnv(suite="libero_spatial", task="0", cameras=["agentview", "robot0_eye_in_hand"], image_size=224)
obs = env.reset(seed=0)
np.savez({out!r}, instruction=env.spec.instruction, **{{k.replace("/", "__"): v for k, v in obs.items()}})
"""


def libero_observation(workdir: Path) -> tuple[dict[str, np.ndarray], str]:
    from ebrl.envs.setup import benchmark_python

    python = benchmark_python("libero")
    if python is None:
        raise SystemExit("LIBERO's interpreter is not set up: python -m ebrl.envs.setup libero")
    out = workdir / "obs.npz"
    repo = str(Path(__file__).resolve().parents[2])
    subprocess.run([str(python), "-c", OBS_SCRIPT.format(repo=repo, out=str(out))], check=True, capture_output=True)
    data = np.load(out)
    obs = {k.replace("__", "/"): data[k] for k in data.files if k != "instruction"}
    return obs, str(data["instruction"])


def write_lerobot_folder(folder: Path, spec: EnvSpec) -> dict[str, float]:
    """The folder of step 1; returns the seconds it took and the file's size."""
    from safetensors.torch import save_file

    from ebrl.bench.memory import fill
    from ebrl.policies.build import build_policy

    start = time.perf_counter()
    cfg = {"_target_": "ebrl.policies.openpi.OpenPIPolicy", "name": "openpi", "preset": "full", "cameras": SLOTS,
           "state_dims": list(range(STATE_DIM))}
    source = build_policy(cfg, spec, weights="given")  # bfloat16, allocated once
    fill(source)
    heads = tuple(source.rl_heads())
    state = {f"model.{k}": v for k, v in source.state_dict().items() if not k.startswith(heads)}
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = state.pop(embed)
    expert = source.dims.expert_width
    state["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(source.dims.vocab, expert,
                                                                                   dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    del source, state
    features = {"observation.state": {"type": "STATE", "shape": [STATE_DIM]},
                **{f"observation.images.{s}": {"type": "VISUAL", "shape": [3, 224, 224]} for s in SLOTS}}
    (folder / "config.json").write_text(json.dumps({
        "type": "pi0", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "chunk_size": 50,
        "n_action_steps": 50, "max_state_dim": 32, "max_action_dim": 32, "num_inference_steps": 10,
        "tokenizer_max_length": 48, "input_features": features,
        "output_features": {"action": {"type": "ACTION", "shape": [ACTION_DIM]}},
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}, indent=2))
    g = torch.Generator().manual_seed(0)
    stats = {f"observation.state.{k}": v for k, v in
             {"mean": torch.randn(STATE_DIM, generator=g), "std": torch.rand(STATE_DIM, generator=g) + 0.5}.items()}
    stats.update({f"action.{k}": v for k, v in
                  {"mean": 0.1 * torch.randn(ACTION_DIM, generator=g),
                   "std": torch.rand(ACTION_DIM, generator=g) * 0.5 + 0.1}.items()})
    save_file(stats, str(folder / "policy_preprocessor_step_5_normalizer_processor.safetensors"))
    (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "norm_map": {
            "VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}},
         "state_file": "policy_preprocessor_step_5_normalizer_processor.safetensors"}]}))
    return {"write_s": time.perf_counter() - start,
            "file_gib": (folder / "model.safetensors").stat().st_size / 2 ** 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the folder is written (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        raw, instruction = libero_observation(work)
        obs_s = time.perf_counter() - t0
        cams = {"agentview": raw["image/agentview"], "robot0_eye_in_hand": raw["image/robot0_eye_in_hand"]}
        spec = EnvSpec(obs={"state": ArraySpec(raw["state"].shape, "float32"),
                            **{f"image/{c}": ArraySpec(v.shape, "uint8") for c, v in cams.items()}},
                       action_dim=ACTION_DIM, instruction=instruction, max_episode_steps=220)
        written = write_lerobot_folder(work / "pi0_libero", spec)
        tokenizer = train_gemma_like(work / "paligemma_tokenizer.model", [instruction, "put the bowl on the plate"],
                                     vocab_size=300)

        from ebrl.policies.build import build_policy

        t0 = time.perf_counter()
        cfg = {"_target_": "ebrl.policies.openpi.OpenPIPolicy", "name": "openpi", "preset": "full",
               "checkpoint": str(work / "pi0_libero"), "tokenizer": str(tokenizer), "cameras": SLOTS,
               "state_dims": list(range(STATE_DIM))}
        policy = build_policy(cfg, spec)
        load_s = time.perf_counter() - t0
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([instruction]))
        obs = {"state": torch.from_numpy(raw["state"][None]), "tokens": tokens, "token_mask": mask,
               **{f"image/{c}": torch.from_numpy(v[None]) for c, v in cams.items()}}
        t0 = time.perf_counter()
        out = policy.sample(obs, deterministic=True)
        sample_s = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        print(f"LIBERO libero_spatial task 0 observation (own interpreter, 2 cameras at 224 px): {obs_s:.1f} s")
        print(f"instruction: {instruction!r} -> {int(mask.sum())} tokens "
              f"({policy.tokenizer.path.name}, prompt_style={policy.tokenizer.style})")
        print(f"lerobot-layout folder written: {written['file_gib']:.2f} GiB model.safetensors (bfloat16) in "
              f"{written['write_s']:.1f} s")
        print(f"built from policy.checkpoint=<folder>: {load_s:.1f} s ({policy.num_parameters() / 1e9:.2f} B "
              f"parameters, {policy.compute_dtype}, variant {policy.variant}, cameras {policy.camera_slots} <- "
              f"{policy.camera_sources})")
        print(f"one deterministic chunk at batch 1: {sample_s:.1f} s, shape {tuple(out.chunk.shape)}, "
              f"finite {bool(out.chunk.isfinite().all())}, first action {np.round(out.chunk[0, 0].float().numpy(), 3)}")
        print(f"peak RSS of this process: {peak:.2f} GiB")


if __name__ == "__main__":
    main()
