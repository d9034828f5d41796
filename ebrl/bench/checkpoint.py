"""A full-size pi0 from a lerobot-layout checkpoint folder, acting on a LIBERO observation:
`python -m ebrl.bench.checkpoint`.

1. Writes a folder as lerobot 0.4's `save_pretrained` lays one out for pi0 (what tests/policies/test_lerobot_parity.py
   checks against the real writer at a small size): model.safetensors of random full-size weights in bfloat16 under
   "model." with PaliGemma's embed_tokens kept as its tied lm_head (safetensors' save_model drops the other name), the
   expert's unused lm_head, config.json, and the normaliser's processor files with random statistics; a SentencePiece
   model trained here stands in for PaliGemma's (its ids are a subset of the 257152 the embedding has).
2. Builds the policy from it as a run does (`build_policy` with policy.checkpoint=<folder>, policy.tokenizer, the
   camera slots mapped), and samples one deterministic chunk with the real prompt path, then a second one warm.
`load_and_act` does both, on any device, for one observation with LIBERO's keys. Here it runs on CPU on an observation
of LIBERO's libero_spatial task 0 (its own interpreter renders agentview and the wrist camera at 224 px) and prints
the time of each step and the process's peak memory; needs about 16 GB and 8 GB of disk in --dir. The `checkpoint`
check of `python -m ebrl.bench.gpu_check` runs it on CUDA with a synthetic observation of the same shapes.
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
from typing import Any

import numpy as np
import torch

from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.tokenizer import train_gemma_like

SLOTS = {"base_0_rgb": "agentview", "left_wrist_0_rgb": "robot0_eye_in_hand", "right_wrist_0_rgb": None}
STATE_DIM, ACTION_DIM, CHUNK = 8, 7, 50
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
    cfg = {
        "_target_": "ebrl.policies.openpi.OpenPIPolicy",
        "name": "openpi",
        "preset": "full",
        "cameras": SLOTS,
        "state_dims": list(range(STATE_DIM)),
    }
    source = build_policy(cfg, spec, weights="given")  # bfloat16, allocated once
    fill(source)
    heads = tuple(source.rl_heads())
    state = {f"model.{k}": v for k, v in source.state_dict().items() if not k.startswith(heads)}
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = state.pop(embed)
    expert = source.dims.expert_width
    state["model.paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(
        source.dims.vocab, expert, dtype=torch.bfloat16
    )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    del source, state
    features = {
        "observation.state": {"type": "STATE", "shape": [STATE_DIM]},
        **{f"observation.images.{s}": {"type": "VISUAL", "shape": [3, 224, 224]} for s in SLOTS},
    }
    (folder / "config.json").write_text(
        json.dumps(
            {
                "type": "pi0",
                "paligemma_variant": "gemma_2b",
                "action_expert_variant": "gemma_300m",
                "chunk_size": CHUNK,
                "n_action_steps": CHUNK,
                "max_state_dim": 32,
                "max_action_dim": 32,
                "num_inference_steps": 10,
                "tokenizer_max_length": 48,
                "input_features": features,
                "output_features": {"action": {"type": "ACTION", "shape": [ACTION_DIM]}},
                "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
            },
            indent=2,
        )
    )
    g = torch.Generator().manual_seed(0)
    stats = {
        f"observation.state.{k}": v
        for k, v in {
            "mean": torch.randn(STATE_DIM, generator=g),
            "std": torch.rand(STATE_DIM, generator=g) + 0.5,
        }.items()
    }
    stats.update(
        {
            f"action.{k}": v
            for k, v in {
                "mean": 0.1 * torch.randn(ACTION_DIM, generator=g),
                "std": torch.rand(ACTION_DIM, generator=g) * 0.5 + 0.1,
            }.items()
        }
    )
    save_file(stats, str(folder / "policy_preprocessor_step_5_normalizer_processor.safetensors"))
    (folder / "policy_preprocessor.json").write_text(
        json.dumps(
            {
                "name": "policy_preprocessor",
                "steps": [
                    {
                        "registry_name": "normalizer_processor",
                        "config": {
                            "eps": 1e-8,
                            "norm_map": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
                        },
                        "state_file": "policy_preprocessor_step_5_normalizer_processor.safetensors",
                    }
                ],
            }
        )
    )
    return {"write_s": time.perf_counter() - start, "file_gib": (folder / "model.safetensors").stat().st_size / 2**30}


def load_and_act(work: Path, raw_obs: dict[str, np.ndarray], instruction: str, device: torch.device) -> dict[str, Any]:
    """Steps 1 and 2 in `work` on one observation of LIBERO's keys, the policy on `device`: their figures."""
    cams = {c: raw_obs[f"image/{c}"] for c in SLOTS.values() if c is not None}
    spec = EnvSpec(
        obs={
            "state": ArraySpec(raw_obs["state"].shape, "float32"),
            **{f"image/{c}": ArraySpec(v.shape, "uint8") for c, v in cams.items()},
        },
        action_dim=ACTION_DIM,
        instruction=instruction,
        max_episode_steps=220,
    )
    figures: dict[str, Any] = write_lerobot_folder(work / "pi0_libero", spec)
    tokenizer = train_gemma_like(
        work / "paligemma_tokenizer.model", [instruction, "put the bowl on the plate"], vocab_size=300
    )

    from ebrl.policies.build import build_policy

    cuda = device.type == "cuda"

    def elapsed(t0: float) -> float:
        if cuda:  # kernels run asynchronously: a stage ends when the device is done
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    cfg = {
        "_target_": "ebrl.policies.openpi.OpenPIPolicy",
        "name": "openpi",
        "preset": "full",
        "checkpoint": str(work / "pi0_libero"),
        "tokenizer": str(tokenizer),
        "cameras": SLOTS,
        "state_dims": list(range(STATE_DIM)),
    }
    policy = build_policy(cfg, spec, device)
    load_s = elapsed(t0)
    tokens, mask = (torch.from_numpy(a).to(device) for a in policy.tokenize([instruction]))
    obs = {
        "state": torch.from_numpy(raw_obs["state"][None]),
        "tokens": tokens,
        "token_mask": mask,
        **{f"image/{c}": torch.from_numpy(v[None]) for c, v in cams.items()},
    }
    obs = {k: v.to(device) for k, v in obs.items()}
    t0 = time.perf_counter()
    out = policy.sample(obs, deterministic=True)
    first_s = elapsed(t0)
    t0 = time.perf_counter()
    policy.sample(obs, deterministic=True)
    warm_s = elapsed(t0)
    chunk = out.chunk.float().cpu()
    figures.update(
        {
            "load_s": load_s,
            "first_chunk_s": first_s,
            "warm_chunk_s": warm_s,
            "tokens": int(mask.sum()),
            "tokenizer": policy.tokenizer.path.name,
            "prompt_style": policy.tokenizer.style,
            "parameters_b": round(policy.num_parameters() / 1e9, 3),
            "dtype": str(policy.compute_dtype),
            "variant": policy.variant,
            "cameras": dict(zip(policy.camera_slots, policy.camera_sources)),
            "chunk_shape": list(chunk.shape),
            "finite": bool(chunk.isfinite().all()),
            "first_action": [round(float(a), 3) for a in chunk[0, 0]],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
    )
    if cuda:
        figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}


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
        f = load_and_act(work, raw, instruction, torch.device("cpu"))
    print(f"LIBERO libero_spatial task 0 observation (own interpreter, 2 cameras at 224 px): {obs_s:.1f} s")
    print(f"instruction: {instruction!r} -> {f['tokens']} tokens ({f['tokenizer']}, prompt_style={f['prompt_style']})")
    print(
        f"lerobot-layout folder written: {f['file_gib']:.2f} GiB model.safetensors (bfloat16) in {f['write_s']:.1f} s"
    )
    print(
        f"built from policy.checkpoint=<folder>: {f['load_s']:.1f} s ({f['parameters_b']:.2f} B parameters, "
        f"{f['dtype']}, variant {f['variant']}, cameras {f['cameras']})"
    )
    print(
        f"one deterministic chunk at batch 1: {f['first_chunk_s']:.1f} s (warm: {f['warm_chunk_s']:.1f} s), shape "
        f"{tuple(f['chunk_shape'])}, finite {f['finite']}, first action {f['first_action']}"
    )
    print(f"peak RSS of this process: {f['peak_rss_gib']:.2f} GiB")


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "checkpoint")
