"""The memory model against measured peaks, and what fits which GPU: `python -m ebrl.bench.memory`.

1. For each family at `full` (the trainer's copy on the meta device, no memory): parameters, and per `policy.train`
   option the trainer's weights, gradients, Adam moments and autocast copies, the activations of one micro-batch row
   with and without checkpointing, generation's conditioning per env, the trainer's frozen prefix per row
   (policy.train=action_expert: computed once per update and held for every row), the published payload.
2. pi0 on one H200 and one A100-80GB (hw/h200x1, hw/a100x8): full, expert-only and LoRA training at 16, 64 and 256
   envs, pipelined (trainer and generation processes, the published weights on the device, EGL contexts for the
   simulators' cameras), at algo.micro_batch=4.
3. Measured here, one process per `policy.train` option: full-size pi0 in bfloat16, one camera at 224 px, built with
   given weights (as the trainer and generation build it: meta device, then one allocation), one sample at batch 1,
   one PPO update of 2 rows at algo.micro_batch=1 with checkpointing; the process's peak RSS against the model's
   prediction (plus the process's RSS before building, measured); then one publication of its weights into the
   channel's host slots. `--measure` names the options (train=all needs about 56 GB, more than this machine has).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ebrl.alloc.memory import GiB, MemoryModel, gib
from ebrl.envs.base import ArraySpec, EnvSpec

CONF = Path(__file__).resolve().parents[2] / "conf"
FAMILIES = ("openpi", "openpi:pi05", "openvla_oft", "gr00t", "wam")
OPTIONS = ("all", "action_expert", "lora")
GPUS = {"H200 (hw/h200x1)": "h200x1", "A100-80GB (hw/a100x8)": "a100x8"}
RESERVE = 0.05  # of a GPU's memory kept for the allocator's fragmentation and kernel workspaces


def compose(*overrides: str) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ebrl.config import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return hydra_compose("config", overrides=list(overrides))


def policy_config(family: str, train: str, *overrides: str) -> dict[str, Any]:
    name, _, variant = family.partition(":")
    extra = [f"policy.variant={variant}"] if variant else []
    cfg = compose(f"policy={name}", "policy.preset=full", f"policy.train={train}", *extra, *overrides)
    return OmegaConf.to_container(cfg.policy, resolve=True)


def env_spec(cameras: int, state_dim: int = 8, action_dim: int = 7) -> EnvSpec:
    """LIBERO's shapes: an 8-dim state, 7-dim actions, cameras at 224 px."""
    obs = {"state": ArraySpec((state_dim,), "float32")}
    obs.update({f"image/cam{i}": ArraySpec((224, 224, 3), "uint8") for i in range(cameras)})
    return EnvSpec(obs=obs, action_dim=action_dim, instruction="put the bowl on the plate", max_episode_steps=520)


def model_table(families: list[str], cameras: int) -> list[dict]:
    spec = env_spec(cameras)
    print(f"\n1. The model at full size ({cameras} cameras at 224 px, GiB; activations per micro-batch row):")
    print(
        "| family | policy.train | parameters | trained | weights | gradients | Adam | autocast copies | "
        "activations/row (ckpt / none) | cache per env | trainer's prefix per row | payload |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for family in families:
        for train in OPTIONS:
            m = MemoryModel.of(policy_config(family, train), spec)
            t = m.trainer(1).parts
            plain = MemoryModel.of(policy_config(family, train, "policy.grad_checkpoint=false"), spec)
            rows.append(
                {
                    "family": family,
                    "train": train,
                    "parameters": m.parameters,
                    "trained": m.trained,
                    **{k: v for k, v in t.items()},
                    "activations_row_plain": plain.activations_per_row,
                    "cache_per_env": m.cache_per_env,
                    "prefix_per_row": m.prefix_per_row,
                    "payload": m.payload_bytes,
                }
            )
            print(
                f"| {family} | {train} | {m.parameters / 1e9:.3f}B | {m.trained / 1e9:.3f}B | {gib(t['weights'])} | "
                f"{gib(t['gradients'])} | {gib(t['optimizer'])} | {gib(t['autocast copies'])} | "
                f"{m.activations_per_row / 2**20:.0f} MiB / {plain.activations_per_row / 2**20:.0f} MiB | "
                f"{m.cache_per_env / 2**20:.1f} MiB | {m.prefix_per_row / 2**20:.1f} MiB | {gib(m.payload_bytes)} |",
                flush=True,
            )
    return rows


def fit_table(envs: list[int], micro_batch: int, cameras: int, rollout_chunks: int) -> list[dict]:
    spec = env_spec(cameras)
    names = {"all": "full", "action_expert": "expert only", "lora": "LoRA (+ expert)"}
    print(
        f"\n2. pi0 on one GPU, pipelined (trainer + generation, published weights on the device, EGL contexts), "
        f"algo.micro_batch={micro_batch}, {rollout_chunks} chunks per env, {cameras} cameras; GiB needed, "
        f"and whether it fits in the GPU less {RESERVE:.0%}:"
    )
    header = ["pi0 training", "moments"] + [f"{n} envs" for n in envs]
    print("| " + " | ".join(header) + " | " + " | ".join(GPUS) + " |")
    print("|" + "---|" * (len(header) + len(GPUS)))
    rows = []
    for train in OPTIONS:
        for moments in ("float32", "bfloat16"):
            m = MemoryModel.of(policy_config("openpi", train), spec, optimizer_dtype=moments)
            need = [m.gpu(micro_batch, n, rollout_chunks, rendering=cameras > 0).total for n in envs]
            fits = []
            for gpu, hw in GPUS.items():
                have = compose(f"hw={hw}").hw.gpu_memory_gb * GiB * (1 - RESERVE)
                fits.append(", ".join(f"{n}: {'yes' if x <= have else 'no'}" for n, x in zip(envs, need)))
            rows.append({"train": train, "moments": moments, "need": dict(zip(envs, need)), "fits": fits})
            print(
                f"| {names[train]} | {moments} | " + " | ".join(gib(x) for x in need) + " | " + " | ".join(fits) + " |",
                flush=True,
            )
    return rows


# --- measured here -----------------------------------------------------------------------------
def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def fill(policy: torch.nn.Module) -> None:
    """Weights as a checkpoint would bring them (small random values, drawn once and tiled: a few seconds)."""
    pool = torch.randn(1 << 24) * 0.02
    with torch.no_grad():
        for p in policy.parameters():
            flat = p.view(-1)
            for start in range(0, flat.numel(), pool.numel()):
                part = flat[start : start + pool.numel()]
                part.copy_(pool[: part.numel()])


def measure_one(train: str, micro_batch: int) -> dict:
    """One process's figures (run by `--child`): see the module docstring."""
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer
    from ebrl.rl.rollout import RolloutBatch

    torch.manual_seed(0)
    cfg = policy_config("openpi", train)
    spec = env_spec(1)
    if train == "lora":
        import peft  # noqa: F401  (its import is part of the process before the build)
    before = current_rss()
    t0 = time.perf_counter()
    policy = build_policy(cfg, spec, "cpu", train=True, weights="given")
    fill(policy)
    build_s = time.perf_counter() - t0
    obs = {"state": torch.randn(1, 8), "image/cam0": torch.randint(0, 256, (1, 224, 224, 3), dtype=torch.uint8)}
    tokens, mask = policy.tokenize([spec.instruction])
    obs["tokens"], obs["token_mask"] = torch.from_numpy(tokens), torch.from_numpy(mask)
    t0 = time.perf_counter()
    out = policy.sample(obs)
    sample_s = time.perf_counter() - t0
    rows = 2
    batch = RolloutBatch(
        obs={k: v.expand(rows, *v.shape[1:])[None] for k, v in obs.items()},
        chunk=out.chunk.expand(rows, -1, -1)[None],
        extras={k: v.expand(rows, *v.shape[1:])[None] for k, v in out.extras.items()},
        log_prob=out.log_prob.expand(rows, -1)[None],
        value=out.value.expand(rows)[None],
        reward=torch.tensor([[1.0, -1.0]]),
        done=torch.zeros(1, rows, dtype=torch.bool),
        mask=torch.ones(1, rows, policy.chunk_len, dtype=torch.bool),
        last_value=torch.zeros(rows),
        cutoff_value=torch.zeros(1, rows),
    )
    algo = compose("algo.epochs=1", "algo.minibatches=1", f"algo.micro_batch={micro_batch}").algo
    trainer = PPOTrainer(policy, algo)
    t0 = time.perf_counter()
    trainer.update(batch)
    update_s = time.perf_counter() - t0
    peak = rss_gib()
    predicted = MemoryModel.of(cfg, spec, device="cpu").trainer(micro_batch, rows).parts
    return {
        "train": train,
        "micro_batch": micro_batch,
        "build_s": build_s,
        "sample_b1_s": sample_s,
        "update_s": update_s,
        "peak_rss_gib": peak,
        "process_before_gib": before / GiB,
        "predicted": {k: v / GiB for k, v in predicted.items()},
        "predicted_gib": before / GiB + sum(predicted.values()) / GiB,
    }


def measure_publication(train: str) -> dict:
    """One publication of the trainer's weights (float32 masters and frozen bfloat16 ones) into the channel's host
    slots, cast to the bfloat16 payload; in a process of its own (the slots take 2 x the payload of shared memory,
    which would not fit beside a trained model's freed memory here)."""
    from ebrl.policies.build import build_policy
    from ebrl.policies.training import split_lora
    from ebrl.runtime.channel import WeightChannel

    policy = build_policy(policy_config("openpi", train), env_spec(1), "cpu", train=True, weights="given")
    fill(policy)
    state = policy.state_dict()
    channel = WeightChannel(
        split_lora(state)[0],
        torch.multiprocessing.get_context("spawn"),
        policy.compute_dtype,
        lora_scaling=policy.lora_scaling,
    )  # (in a run, from the supervisor's policy: this layout)
    t0 = time.perf_counter()
    channel.publish(state)
    return {"publish_s": time.perf_counter() - t0, "payload_gib": channel.payload_bytes / GiB}


def fresh_build_s() -> dict:
    """A from-scratch full pi0 build (init in bfloat16 and the first policy's fit), for comparison."""
    from ebrl.policies.build import build_policy

    torch.manual_seed(0)
    t0 = time.perf_counter()
    build_policy(policy_config("openpi", "all"), env_spec(1), "cpu")
    return {"fresh_build_s": time.perf_counter() - t0, "peak_rss_gib": rss_gib()}


def measured_table(options: list[str], micro_batch: int, fresh: bool) -> list[dict]:
    print(
        f"\n3. Measured on this machine ({torch.get_num_threads()} threads): full pi0 in bfloat16, 1 camera, one PPO "
        f"update of 2 rows at algo.micro_batch={micro_batch}, one process each:"
    )
    print(
        "| policy.train | build (given weights) | sample, batch 1 | update | publish (payload) | peak RSS | "
        "predicted | error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for train in options:
        r = child("--child", train, "--micro-batch", str(micro_batch))
        if "error" in r:
            print(f"| {train} | failed: {r['error']} |")
            continue
        r.update(child("--child-publish", train))
        rows.append(r)
        error = (r["predicted_gib"] - r["peak_rss_gib"]) / r["peak_rss_gib"]
        publish = (
            f"{r['publish_s']:.1f} s ({r['payload_gib']:.2f} GiB)" if "publish_s" in r else f"failed: {r['error']}"
        )
        print(
            f"| {train} | {r['build_s']:.1f} s | {r['sample_b1_s']:.1f} s | {r['update_s']:.1f} s | {publish} | "
            f"{r['peak_rss_gib']:.2f} GiB | {r['predicted_gib']:.2f} GiB | {error:+.1%} |",
            flush=True,
        )
        print(
            "  predicted: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["predicted"].items())
            + f", process before the build {r['process_before_gib']:.2f} (GiB)"
        )
    if fresh:
        r = child("--child-fresh")
        rows.append(r)
        if "error" not in r:
            print(
                f"From scratch (bfloat16 init and the first policy's fit), one camera: {r['fresh_build_s']:.1f} s, "
                f"peak RSS {r['peak_rss_gib']:.2f} GiB"
            )
    return rows


def child(*args: str) -> dict:
    """Run this module with `args` in a fresh process; its JSON line, or {"error": why}."""
    out = subprocess.run([sys.executable, "-m", "ebrl.bench.memory", *args], capture_output=True, text=True)
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        return {"error": f"exit code {out.returncode} {last}".strip()}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--envs", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--cameras", type=int, default=2, help="cameras of the model and fit tables (LIBERO: 2)")
    parser.add_argument("--fit-micro-batch", type=int, default=4)
    parser.add_argument("--rollout-chunks", type=int, default=10)
    parser.add_argument("--measure", nargs="*", default=["action_expert", "lora"], choices=OPTIONS)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--no-fresh", action="store_true", help="skip the from-scratch build")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=OPTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--child-fresh", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-publish", choices=OPTIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_one(args.child, args.micro_batch)))
        return
    if args.child_fresh:
        print(json.dumps(fresh_build_s()))
        return
    if args.child_publish:
        print(json.dumps(measure_publication(args.child_publish)))
        return
    result = {
        "model": model_table(args.families, args.cameras),
        "fit": fit_table(args.envs, args.fit_micro_batch, args.cameras, args.rollout_chunks),
        "measured": measured_table(args.measure, args.micro_batch, not args.no_fresh) if args.measure else [],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "memory")
