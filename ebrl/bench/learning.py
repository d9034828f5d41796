"""Does a schedule change what is learned? `python -m ebrl.bench.learning --modes colocated ebrl --seeds 0 1 2`.

Runs the embedded defaults (robosuite Lift, tiny openpi, PPO) under each mode and seed, the modes in ABBA order
over the seeds, and prints per run the first and final returns (mean of the first 3 and of the last
4 iterations), the wall-clock and env steps until the return (mean of 3 consecutive iterations) first
reached `--target`, and the throughput; then per mode the means over seeds. Extra arguments are
Hydra overrides for every run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ebrl.bench.schedulers import compose_overrides, round_order


def time_to_target(rows: list[dict[str, Any]], target: float, window: int = 3) -> tuple[float, float]:
    """(seconds, env steps) from the run's start until the mean return of `window` consecutive iterations
    first reached `target`; nan if it never did."""
    elapsed = 0.0
    for i, row in enumerate(rows):
        elapsed += row["time/iteration_s"]
        recent = [r["env/return"] for r in rows[max(0, i - window + 1): i + 1] if "env/return" in r]
        if len(recent) == window and statistics.mean(recent) >= target:
            return elapsed, float(row["env_steps"])
    return float("nan"), float("nan")


def run_one(mode: str, seed: int, iterations: int, target: float, overrides: Sequence[str]) -> dict[str, Any]:
    from ebrl.runtime.experiment import Experiment

    cfg = compose_overrides([f"seed={seed}", f"iterations={iterations}", "progress=false", "logger=none",
                             "checkpoint_every=1000000", *overrides], mode)
    with tempfile.TemporaryDirectory(prefix="ebrl-learning-") as tmp:
        summary = Experiment.from_config(cfg, run_dir=Path(tmp)).train()
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    returns = [r["env/return"] for r in rows if "env/return" in r]
    seconds, steps = time_to_target(rows, target)
    return {"mode": mode, "seed": seed, "first": statistics.mean(returns[:3]), "final": statistics.mean(returns[-4:]),
            "seconds_to_target": seconds, "steps_to_target": steps, "wall_s": summary.wall_s,
            "env_steps_per_s": summary.rollout_steps_per_s, "returns": returns}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["colocated", "ebrl"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--target", type=float, default=3.0, help="return per episode that counts as learned")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    runs = [run_one(mode, seed, args.iterations, args.target, args.overrides)
            for i, seed in enumerate(args.seeds) for mode in round_order(args.modes, i)]
    print(f"\n{args.iterations} iterations per run; target: mean return of 3 consecutive iterations >= {args.target}")
    print("| mode | seed | return first 3 | return last 4 | seconds to target | env steps to target | "
          "wall s | env steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['mode']} | {r['seed']} | {r['first']:.2f} | {r['final']:.2f} | {r['seconds_to_target']:.0f} | "
              f"{r['steps_to_target']:.0f} | {r['wall_s']:.0f} | {r['env_steps_per_s']:.1f} |")
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        reached = [r["seconds_to_target"] for r in mine if r["seconds_to_target"] == r["seconds_to_target"]]
        print(f"{mode}: final return {statistics.mean(r['final'] for r in mine):.2f} over {len(mine)} seeds; "
              f"reached the target in {len(reached)}/{len(mine)}"
              + (f", mean {statistics.mean(reached):.0f} s" if reached else ""))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return runs


if __name__ == "__main__":
    main()
