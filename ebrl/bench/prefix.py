"""The frozen prefix and the proximal pass, measured: `python -m ebrl.bench.prefix`.

1. Where a row's frozen prefix comes from (docs/internals/design.md, "The frozen prefix"). Per family at full size
   (the trainer's copy with policy.train=action_expert on the meta device, `--cameras` at 224 px): the prefix's bytes
   per row, the roofline's time to compute it on each GPU of ebrl/forecast/gpu_cost.py, and the time to carry it from
   generation to the trainer instead: out of generation's GPU and into the trainer's over PCIe (`PCIE_BYTES_PER_S`) and
   twice through host shared memory (a copy measured here at the prefix's size).
2. On this CPU, the small preset: one row's prefix computed (ms, one thread) against its bytes copied through shared
   memory; and one PPO update of the rollout (`--envs` x `--chunks` rows, decoupled, half the rows sampled by older
   weights) with the prefix recomputed in every pass and the proximal pass over every row (before), with the prefix
   cached (algo.cache_prefix), and with both that and the proximal pass over the stale rows only (algo.proximal).
3. The proximal pass skipped: a row sampled by the weights an update starts from takes its behaviour log-prob. Per
   action, how far that is from the trainer's own pass (|generation's - the trainer's| log-prob), in float32 and in
   bfloat16, at the small preset: generation's batch and weights as a run has them (policy.dtype), the trainer's
   float32 masters under autocast in its micro-batches.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from ebrl.bench.memory import compose, env_spec
from ebrl.bench.policies import timed
from ebrl.envs.base import ArraySpec, EnvSpec

# host <-> GPU: PCIe 4.0 x16 (A100 nodes), 5.0 x16 (H100, H200), each way: PCI-SIG's published rates, 16 and 32 GT/s
# x 16 lanes (128b/130b)
PCIE_BYTES_PER_S = {"A100-SXM4-80GB": 31.5e9, "H100-SXM5-80GB": 63.0e9, "H200": 63.0e9}
FAMILIES = ("openpi", "openpi:pi05", "gr00t")


def median_s(fn: Callable[[], Any], reps: int) -> float:
    return timed(fn, reps) / 1e3


def shared_copy_s(nbytes: int, reps: int = 5) -> float:
    """One copy of `nbytes` into a tensor in shared memory (torch's send path moves a tensor's storage there)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    target = torch.empty_like(source).share_memory_()
    return median_s(lambda: target.copy_(source), reps)


def policy_cfg(family: str, preset: str, *overrides: str) -> dict[str, Any]:
    name, _, variant = family.partition(":")
    extra = [f"policy.variant={variant}"] if variant else []
    cfg = compose(f"policy={name}", f"policy.preset={preset}", "policy.train=action_expert", *extra, *overrides)
    return OmegaConf.to_container(cfg.policy, resolve=True)


def full_size(cameras: int) -> list[dict[str, Any]]:
    """Section 1 (see the module docstring)."""
    from ebrl.alloc.memory import MemoryModel
    from ebrl.forecast.gpu_cost import GPUS, PolicyOps, roofline

    spec = env_spec(cameras)
    rows = []
    for family in FAMILIES:
        cfg = policy_cfg(family, "full")
        nbytes = MemoryModel.of(cfg, spec, trace=False).prefix_per_row
        ops = PolicyOps.of(cfg, spec)
        host = 2 * shared_copy_s(nbytes)  # (into the supervisor's slot, then the trainer's batch)
        row = {"family": family, "prefix_mib": nbytes / 2**20}
        for name, gpu in GPUS.items():
            compute = roofline(ops.prefix, 8, gpu, 1.0, 0.0).seconds / 8  # (at a micro-batch's rows: per row)
            row[name] = {"compute_ms": 1e3 * compute, "carry_ms": 1e3 * (2 * nbytes / PCIE_BYTES_PER_S[name] + host)}
        rows.append(row)
    return rows


def small_here(envs: int, chunks: int, reps: int) -> dict[str, Any]:
    """Section 2 (see the module docstring), on one thread."""
    from ebrl.policies.build import build_policy
    from ebrl.policies.layers import map_tensors
    from ebrl.rl.ppo import PPOTrainer, _flat

    spec = EnvSpec(
        obs={"state": ArraySpec((42,), "float32")}, action_dim=7, instruction="lift the red cube", max_episode_steps=100
    )
    torch.manual_seed(0)
    policy = build_policy(policy_cfg("openpi", "small"), spec, train=True)
    batch = rollout(policy, envs, chunks)
    one = {k: _flat(v)[:1] for k, v in batch.obs.items()}
    with torch.no_grad():
        prefix_s = median_s(lambda: policy.prefix(one), reps)
        sizes: list[int] = []
        map_tensors(policy.prefix(one), lambda t: sizes.append(t.numel() * t.element_size()))
    version = 1  # (the update starts from version 1: the first half of the chunk steps is stale)
    settings = {
        "before (recomputed, every row proximal)": ("algo.cache_prefix=false", "algo.proximal=all"),
        "prefix cached": ("algo.proximal=all",),
        "prefix cached, stale rows proximal": (),
    }
    updates = {}
    for name, overrides in settings.items():
        algo = compose(*overrides).algo
        trainer = PPOTrainer(copy.deepcopy(policy), algo)
        updates[name] = median_s(lambda: trainer.update(batch, decoupled=True, version=version), max(1, reps // 2))
    decisions = envs * chunks
    return {
        "prefix_ms_per_row": 1e3 * prefix_s,
        "prefix_kib_per_row": sum(sizes) / 1024,
        "shared_copy_ms_per_row": 1e3 * shared_copy_s(max(sum(sizes), 2)),
        "update_ms_per_decision": {k: 1e3 * v / decisions for k, v in updates.items()},
        "update_ms_per_env_step": {k: 1e3 * v / (decisions * policy.execute) for k, v in updates.items()},
    }


def rollout(policy: Any, envs: int, chunks: int) -> Any:
    """`chunks` chunk steps of `envs` envs, the policy's own samples on random states; the first half of the chunk
    steps sampled by weights of version 0, the rest by version 1."""
    from ebrl.rl.rollout import ChunkStep, stack_steps

    gen = torch.Generator().manual_seed(1)
    tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([policy.env_spec.instruction] * envs))
    steps = []
    for t in range(chunks):
        obs = {
            "state": torch.randn(envs, policy.env_spec.obs["state"].shape[0], generator=gen),
            "tokens": tokens,
            "token_mask": mask,
        }
        out = policy.sample(obs)
        steps.append(
            ChunkStep(
                obs=obs,
                chunk=out.chunk,
                extras=out.extras,
                log_prob=out.log_prob,
                value=out.value,
                reward=torch.rand(envs, generator=gen),
                done=torch.zeros(envs, dtype=torch.bool),
                mask=torch.ones(envs, policy.chunk_len, dtype=torch.bool),
                cutoff_value=torch.zeros(envs),
                version=torch.full((envs,), int(t >= chunks // 2)),
            )
        )
    return stack_steps(steps, torch.zeros(envs))


def logprob_noise(envs: int, micro_batch: int) -> dict[str, dict[str, float]]:
    """Section 3 (see the module docstring): per dtype, |generation's - the trainer's| log-prob per executed action
    of chunks generation sampled with the trainer's weights (mean, 99th percentile, max), and of a whole chunk."""
    from ebrl.policies.build import build_policy

    spec = EnvSpec(
        obs={"state": ArraySpec((42,), "float32")}, action_dim=7, instruction="lift the red cube", max_episode_steps=100
    )
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = policy_cfg("openpi", "small", f"policy.dtype={dtype}")
        torch.manual_seed(0)
        trainer = build_policy(cfg, spec, train=True)
        generation = build_policy(cfg, spec, train=False, weights="given")
        generation.load_state_dict(trainer.state_dict())  # (cast to policy.dtype, as the channel publishes)
        tokens, mask = (torch.from_numpy(a) for a in generation.tokenize([spec.instruction] * envs))
        gaps, chunks = [], []
        for seed in range(8):
            obs = {
                "state": torch.randn(envs, 42, generator=torch.Generator().manual_seed(seed)),
                "tokens": tokens,
                "token_mask": mask,
            }
            sampled = generation.sample(obs)
            with torch.no_grad():
                parts = [
                    trainer.evaluate(
                        {k: v[s] for k, v in obs.items()},
                        sampled.chunk[s],
                        {k: v[s] for k, v in sampled.extras.items()},
                    )[0]
                    for s in (slice(i, i + micro_batch) for i in range(0, envs, micro_batch))
                ]
            gap = (torch.cat(parts) - sampled.log_prob).abs()[:, : generation.execute]
            gaps.append(gap.flatten())
            chunks.append(gap.sum(-1))
        every, whole = torch.cat(gaps), torch.cat(chunks)
        out[dtype] = {
            "mean": float(every.mean()),
            "p99": float(every.quantile(0.99)),
            "max": float(every.max()),
            "chunk_mean": float(whole.mean()),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m ebrl.bench.prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--cameras", type=int, default=2, help="cameras at 224 px of the full-size policies")
    parser.add_argument("--envs", type=int, default=12, help="envs of the small preset's rollout")
    parser.add_argument("--chunks", type=int, default=10, help="chunk steps of the small preset's rollout")
    parser.add_argument("--micro-batch", type=int, default=5, help="the trainer's rows per pass (section 3)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # (as a run does, experiment.py: trained weights' subnormals slow the CPU tenfold)
    result = {"date": time.strftime("%Y-%m-%d"), "full": full_size(args.cameras)}
    print(
        f"1. full size, policy.train=action_expert, {args.cameras} cameras at 224 px: a row's prefix computed "
        "(roofline) or carried from generation (2 PCIe copies + 2 shared-memory copies measured here), ms per row"
    )
    gpus = [k for k in result["full"][0] if k not in ("family", "prefix_mib")]
    print("| family | prefix MiB per row | " + " | ".join(f"{g} compute / carry" for g in gpus) + " |")
    print("|---|---|" + "---|" * len(gpus))
    for row in result["full"]:
        print(
            f"| {row['family']} | {row['prefix_mib']:.2f} | "
            + " | ".join(f"{row[g]['compute_ms']:.3f} / {row[g]['carry_ms']:.3f}" for g in gpus)
            + " |",
            flush=True,
        )
    here = result["small"] = small_here(args.envs, args.chunks, args.reps)
    print(
        f"\n2. here, openpi small, one thread: a row's prefix {here['prefix_ms_per_row']:.2f} ms to compute, "
        f"{here['prefix_kib_per_row']:.0f} KiB, {here['shared_copy_ms_per_row']:.3f} ms to copy through shared "
        f"memory; one decoupled update of {args.envs} x {args.chunks} rows (half stale), ms per decision / per env "
        "step:"
    )
    for name, ms in here["update_ms_per_decision"].items():
        print(f"   {name}: {ms:.2f} / {here['update_ms_per_env_step'][name]:.3f}")
    noise = result["logprob_noise"] = logprob_noise(args.envs, args.micro_batch)
    print(
        f"\n3. generation's log-prob against the trainer's pass on the same weights, openpi small, |difference| per "
        f"executed action (generation batch {args.envs}, trainer micro-batch {args.micro_batch}):"
    )
    for dtype, figures in noise.items():
        print(
            f"   {dtype}: mean {figures['mean']:.2e}, 99th percentile {figures['p99']:.2e}, max {figures['max']:.2e};"
            f" a chunk's executed actions together {figures['chunk_mean']:.2e}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
