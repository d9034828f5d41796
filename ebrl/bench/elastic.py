"""The elastic allocator against the static one when demand shifts mid-run: `python -m ebrl.bench.elastic`.

Both run scheduler=ebrl on the same workload over `--repeats` rounds (ABBA order), without a stage profile: each
calibrates from its second iteration and plans once (static) or goes on re-planning (elastic). Every env starts
as the task is configured and, at its first reset after `--shift-after` iterations' worth of steps, switches to
a variant with `--slowdown` times the physics substeps per action (ebrl.bench.stragglers), as when a curriculum
moves on to contact-rich tasks: simulation's share of the work grows several-fold. Printed per allocator: env
steps/s before and after the shift (the first iteration and the switching one left out), the ratio elastic /
static, and every re-plan with its reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ebrl.bench.schedulers import Workload, compose, round_order

MODES = ("static", "elastic")


def run_one(workload: Workload, allocator: str, elastic: Sequence[str]) -> dict[str, Any]:
    from ebrl.runs.experiment import Experiment

    extra = [f"allocator={allocator}", *(elastic if allocator == "elastic" else [])]
    cfg = compose(Workload(**{**workload.__dict__, "overrides": [*workload.overrides, *extra]}), "ebrl")
    with tempfile.TemporaryDirectory(prefix="ebrl-elastic-") as tmp:
        Experiment.from_config(cfg, run_dir=Path(tmp)).train()
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "decisions": [r["alloc/decision"] for r in rows if "alloc/decision" in r]}


def rate(rows: list[dict[str, Any]], first: int, last: int) -> float:
    """Env steps/s over iterations first..last (1-based, inclusive)."""
    total = {r["iteration"]: r["env_steps"] for r in rows}  # env steps so far, after each iteration
    window = [r for r in rows if first <= r["iteration"] <= last]
    steps = sum(r["env_steps"] - total.get(r["iteration"] - 1, 0) for r in window)
    return steps / sum(r["time/iteration_s"] for r in window)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy-preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--shift-after", type=int, default=5, help="iterations before the envs slow down")
    parser.add_argument("--slowdown", type=int, default=3, help="physics substeps per action after the shift, x")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args(argv)
    if not 2 <= args.shift_after <= args.iterations - 2:  # an iteration measured on each side of the switch
        parser.error(f"--shift-after={args.shift_after}: between 2 and --iterations - 2 = {args.iterations - 2}")
    chunk, chunks = 10, 10
    workload = Workload(
        preset=args.policy_preset,
        num_envs=args.num_envs,
        iterations=args.iterations,
        rollout_chunks=chunks,
        overrides=[f"policy.chunk={chunk}", *args.overrides],
        stragglers=1.0,
        straggler_slowdown=args.slowdown,
        straggler_after_steps=args.shift_after * chunks * chunk,
    )
    elastic = ["allocator.window=2", "allocator.cooldown=1"]
    runs = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for mode in round_order(MODES, i):  # a drift of the machine favours neither
            runs[mode].append(run_one(workload, mode, elastic))
    # iteration shift_after + 1 holds the resets that switch: leave it out of both windows
    before, after = (2, args.shift_after), (args.shift_after + 2, args.iterations)
    result: dict[str, Any] = {"workload": workload.__dict__, "elastic_overrides": elastic, "modes": {}}
    for mode in MODES:
        result["modes"][mode] = {
            "before": statistics.median(rate(r["rows"], *before) for r in runs[mode]),
            "after": statistics.median(rate(r["rows"], *after) for r in runs[mode]),
            "overall": statistics.median(rate(r["rows"], 2, args.iterations) for r in runs[mode]),
            "decisions": [r["decisions"] for r in runs[mode]],
        }
    m = result["modes"]
    print(
        f"\nworkload: {args.num_envs} x Lift, openpi/{args.policy_preset}, scheduler=ebrl, {args.iterations} "
        f"iterations; from iteration {args.shift_after + 1} every env switches to {args.slowdown}x the physics "
        f"substeps; median of {args.repeats} rounds (env steps/s)"
    )
    print(
        f"| allocator | iterations {before[0]}-{before[1]} | iterations {after[0]}-{after[1]} | "
        f"iterations 2-{args.iterations} |"
    )
    print("|---|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {m[mode]['before']:.1f} | {m[mode]['after']:.1f} | {m[mode]['overall']:.1f} |")
    print(
        f"| elastic / static | {m['elastic']['before'] / m['static']['before']:.2f} | "
        f"{m['elastic']['after'] / m['static']['after']:.2f} | "
        f"{m['elastic']['overall'] / m['static']['overall']:.2f} |"
    )
    for mode in MODES:
        for i, decisions in enumerate(m[mode]["decisions"]):
            for line in decisions:
                print(f"{mode} round {i + 1}: {line}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "elastic")
