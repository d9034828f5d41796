"""Per-family generation and training cost on this machine: `python -m ebrl.bench.policies`.

For each policy family and preset: sampling latency per chunk against batch size, and the time per sample of one
PPO-style training step (evaluate + backward + Adam) at a fixed batch. These are the figures the allocator's stage
profiles start from (docs/design.md, "Placement"); `--json` writes them for that.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf

from ebrl.config import register_configs
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.base import Policy
from ebrl.policies.build import family_kwargs

CONF = Path(__file__).resolve().parents[2] / "conf"
FAMILIES = ("openpi", "openpi:pi05", "openvla_oft", "gr00t", "wam")


def build(family: str, preset: str, spec: EnvSpec) -> Policy:
    """The policy `run.py policy=<family>` builds (family "openpi:pi05" sets policy.variant=pi05)."""
    name, _, variant = family.partition(":")
    overrides = [f"policy={name}", f"policy.preset={preset}"] + ([f"policy.variant={variant}"] if variant else [])
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides).policy, resolve=True)
    return get_class(cfg["_target_"])(env_spec=spec, **family_kwargs(cfg))


def make_obs(policy: Policy, batch: int) -> dict[str, torch.Tensor]:
    obs = {"state": torch.randn(batch, policy.env_spec.obs["state"].shape[0])}
    for key, spec in policy.env_spec.obs.items():
        if key.startswith("image/"):
            obs[key] = torch.randint(0, 256, (batch, *spec.shape), dtype=torch.uint8)
    tokens, mask = policy.tokenize([policy.env_spec.instruction] * batch)
    obs["tokens"], obs["token_mask"] = torch.from_numpy(tokens), torch.from_numpy(mask)
    return obs


def timed(fn, reps: int) -> float:
    """Median wall time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(policy: Policy, batches: list[int], train_batch: int, reps: int) -> dict:
    sample_ms = {}
    for b in batches:
        obs = make_obs(policy, b)
        sample_ms[b] = timed(lambda: policy.sample(obs), reps)
    obs = make_obs(policy, train_batch)
    out = policy.sample(obs)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-5)
    advantage = torch.randn(train_batch)

    def train_step() -> None:
        log_prob, entropy, value = policy.evaluate(obs, out.chunk, out.extras)
        loss = -(log_prob.mean(-1) * advantage).mean() + value.pow(2).mean() - 1e-3 * entropy.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_ms = timed(train_step, reps)
    return {"parameters": policy.num_parameters(), "chunk": policy.chunk_len, "sample_ms": sample_ms,
            "train_ms_per_sample": train_ms / train_batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--state-dim", type=int, default=42)  # robosuite Lift's state vector
    parser.add_argument("--action-dim", type=int, default=7)
    parser.add_argument("--cameras", type=int, default=0, help="cameras per observation (0: state only)")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    register_configs()
    if args.threads:
        torch.set_num_threads(args.threads)
    obs = {"state": ArraySpec((args.state_dim,), "float32")}
    obs.update({f"image/cam{i}": ArraySpec((args.image_size, args.image_size, 3), "uint8") for i in range(args.cameras)})
    spec = EnvSpec(obs=obs, action_dim=args.action_dim, instruction="lift the red cube", max_episode_steps=40)
    torch.manual_seed(0)
    results = []
    header = ["family", "preset", "params", "chunk"] + [f"B={b} ms" for b in args.batches] + ["train ms/sample"]
    print(f"{torch.get_num_threads()} torch threads, state dim {args.state_dim}, {args.cameras} cameras"
          f"{f' at {args.image_size} px' if args.cameras else ''}; sampling: ms per chunk (median of {args.reps}); "
          f"training: evaluate + backward + Adam at batch {args.train_batch}, ms per sample")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for family in args.families:
        for preset in args.presets:
            with torch.inference_mode(False):
                row = measure(build(family, preset, spec), args.batches, args.train_batch, args.reps)
            results.append({"family": family, "preset": preset, **row})
            cells = [family, preset, f"{row['parameters'] / 1e6:.2f}M", str(row["chunk"])]
            cells += [f"{row['sample_ms'][b]:.1f}" for b in args.batches] + [f"{row['train_ms_per_sample']:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "cameras": args.cameras,
                                         "image_size": args.image_size, "results": results}, indent=2))


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "policies")
