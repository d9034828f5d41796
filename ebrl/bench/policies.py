"""Per-family generation and training cost on this machine: `python -m ebrl.bench.policies`.

For each policy family and preset: sampling latency per chunk against batch size, and the time per sample of one
PPO-style training step (evaluate + backward + Adam) at a fixed batch. These are the figures the allocator's stage
profiles start from (docs/internals/design.md, "Placement"); `--json` writes them for that.

`--capture off compile` compares `policy.capture` settings instead (the flow families): sampling latency under each,
the settings alternated within each round, and each one's first call per batch (its compile or capture).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf

from ebrl.config import register_configs
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.base import Policy, PolicySample
from ebrl.policies.build import family_kwargs
from ebrl.policies.capture import CAPTURES

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
    return {
        "parameters": policy.num_parameters(),
        "chunk": policy.chunk_len,
        "sample_ms": sample_ms,
        "train_ms_per_sample": train_ms / train_batch,
    }


def sampled(
    policy: Policy,
    capture: str,
    obs: dict[str, torch.Tensor],
    seed: int | None = None,
) -> tuple[PolicySample, float]:
    """policy.sample under `policy.capture=capture` (on the draws `seed` fixes, if given) and its wall time in s,
    the device synchronised."""
    policy.capture = capture
    sync = torch.cuda.synchronize if next(policy.parameters()).is_cuda else (lambda: None)
    if seed is not None:
        torch.manual_seed(seed)
    sync()
    t0 = time.perf_counter()
    out = policy.sample(obs)
    sync()
    return out, time.perf_counter() - t0


def capture_differences(
    policy: Policy, settings: list[str], obs: dict[str, torch.Tensor], seed: int
) -> dict[str, dict]:
    """Each setting's largest difference from the first's on the same draws, in actions and in log-probs, and
    whether its actions are bitwise the same and finite."""
    want = sampled(policy, settings[0], obs, seed)[0]
    out = {}
    for setting in settings[1:]:
        got = sampled(policy, setting, obs, seed)[0]
        out[setting] = {
            "action": float((got.chunk - want.chunk).abs().max()),
            "log_prob": float((got.log_prob - want.log_prob).abs().max()),
            "bitwise": torch.equal(got.chunk, want.chunk),
            "finite": bool(got.chunk.isfinite().all()),
        }
    return out


def compare_capture(
    policy: Policy,
    settings: list[str],
    batches: list[int],
    rounds: int,
    obs_of: Callable[[int], dict[str, torch.Tensor]],
) -> dict[int, dict]:
    """Per batch, on one policy: each `policy.capture` setting's first call in s (its capture or compile happens
    there), its ms per chunk (median; the settings alternated within each round) and its differences from the first
    setting's samples (`capture_differences`)."""
    out: dict[int, dict] = {}
    for b in batches:
        obs = obs_of(b)
        first = {setting: sampled(policy, setting, obs, b)[1] for setting in settings}
        times: dict[str, list[float]] = {setting: [] for setting in settings}
        for _ in range(rounds):
            for setting in settings:
                times[setting].append(sampled(policy, setting, obs)[1])
        out[b] = {
            "first_s": first,
            "ms": {s: 1e3 * statistics.median(t) for s, t in times.items()},
            "differences": capture_differences(policy, settings, obs, b),
        }
    return out


def print_capture(args: argparse.Namespace, spec: EnvSpec) -> list[dict]:
    """The `--capture` table: a row per family, preset and setting."""
    from ebrl.policies.flow import FlowPolicy

    header = (
        ["family", "preset", "capture"]
        + [f"B={b} ms" for b in args.batches]
        + [f"first call s, B={'/'.join(map(str, args.batches))}", "max |diff| action / log-prob"]
    )
    print(
        f"{torch.get_num_threads()} torch threads, state dim {args.state_dim}, {args.cameras} cameras; ms per chunk "
        f"(median of {args.reps} rounds, the settings alternated in each; in brackets: against {args.capture[0]}); "
        "the first call's s includes the compile or capture; differences from the first setting on the same draws"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = []
    for family in args.families:
        for preset in args.presets:
            policy = build(family, preset, spec)
            if not isinstance(policy, FlowPolicy):
                print(f"| {family} | {preset} | (no denoising loop to capture) |", flush=True)
                continue
            with torch.inference_mode(False):
                rows = compare_capture(policy, args.capture, args.batches, args.reps, lambda b: make_obs(policy, b))
            results.append({"family": family, "preset": preset, "batches": rows})
            for setting in args.capture:
                ms = {b: rows[b]["ms"] for b in args.batches}
                cells = [family, preset, setting]
                cells += [
                    f"{ms[b][setting]:.1f} ({ms[b][setting] / ms[b][args.capture[0]]:.2f}x)" for b in args.batches
                ]
                cells.append("/".join(f"{rows[b]['first_s'][setting]:.1f}" for b in args.batches))
                diffs = [rows[b]["differences"][setting] for b in args.batches if setting in rows[b]["differences"]]
                cells.append(
                    f"{max(d['action'] for d in diffs):.1e} / {max(d['log_prob'] for d in diffs):.1e}" if diffs else "-"
                )
                print("| " + " | ".join(cells) + " |", flush=True)
    return results


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
    parser.add_argument(
        "--capture",
        nargs="+",
        default=None,
        choices=CAPTURES,
        help="compare these policy.capture settings' sampling instead (flow families)",
    )
    args = parser.parse_args()
    register_configs()
    if args.threads:
        torch.set_num_threads(args.threads)
    obs = {"state": ArraySpec((args.state_dim,), "float32")}
    obs.update(
        {f"image/cam{i}": ArraySpec((args.image_size, args.image_size, 3), "uint8") for i in range(args.cameras)}
    )
    spec = EnvSpec(obs=obs, action_dim=args.action_dim, instruction="lift the red cube", max_episode_steps=40)
    torch.manual_seed(0)
    if args.capture:
        results = print_capture(args, spec)
        if args.json:
            args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "capture": results}, indent=2))
        return
    results = []
    header = ["family", "preset", "params", "chunk"] + [f"B={b} ms" for b in args.batches] + ["train ms/sample"]
    print(
        f"{torch.get_num_threads()} torch threads, state dim {args.state_dim}, {args.cameras} cameras"
        f"{f' at {args.image_size} px' if args.cameras else ''}; sampling: ms per chunk (median of {args.reps}); "
        f"training: evaluate + backward + Adam at batch {args.train_batch}, ms per sample"
    )
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
        args.json.write_text(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "cameras": args.cameras,
                    "image_size": args.image_size,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "policies")
