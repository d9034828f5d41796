"""One rank against several on the same node: `python -m ebrl.bench.ranks --ranks 1 2 --repeats 2 --iterations 8`.

Runs `run.py` (the embedded defaults: colocated PPO, tiny openpi, robosuite Lift) once per rank count and repeat,
alternating the rank counts (1 2 1 2 ...): 1 rank as `python run.py`, n ranks under
`torchrun --standalone --nproc-per-node n`. Every run has the same cores (the ranks split the node's) and the same
total envs (`env.num_envs`, 8 by default, is the total: each of n ranks gets env.num_envs / n), so every iteration
collects the same env steps. Prints per run the run-wide env steps/s after the warm-up iteration (rank 0's
summary.json), the last iteration's return and the wall-clock; then per rank count the mean env steps/s and its
ratio to the first rank count. On a 2-core machine parity is what to expect: the point is that several ranks run
and learn correctly; on GPU nodes each rank adds a GPU. Extra arguments are Hydra overrides for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.errors import HydraException

from ebrl.bench.schedulers import compose_overrides

ROOT = Path(__file__).resolve().parents[2]  # run.py's folder


def plural(ranks: int) -> str:
    return f"{ranks} rank" + "s" * (ranks != 1)


def command(ranks: int, logs: Path) -> list[str]:
    """How `ranks` ranks start on this node; torchrun prefixes each rank's lines with [default<rank>]: (--tee) and
    keeps its log files in `logs`."""
    if ranks == 1:
        return [sys.executable, "run.py"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--tee=3",
        f"--log-dir={logs}",
        "run.py",
    ]


def run_one(ranks: int, repeat: int, overrides: Sequence[str]) -> dict[str, Any]:
    """One run in a temp run folder; rank 0's summary.json, or SystemExit naming the run if it failed."""
    name = f"{plural(ranks)}, repeat {repeat}"
    print(f"running {name} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="ebrl-ranks-") as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*command(ranks, Path(tmp) / "torchrun"), *overrides, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wall = time.perf_counter() - t0
        if proc.returncode:
            lines = proc.stdout.splitlines()
            # the ranks' own lines: torchrun's traceback and report after them only say that a rank failed
            lines = [line for line in lines if line.startswith("[default")] or lines
            print("\n".join(lines[-20:]))
            sys.exit(f"ebrl.bench.ranks: the run with {name} failed (exit code {proc.returncode})")
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "ranks": ranks,
        "repeat": repeat,
        "env_steps_per_s": summary["rollout_steps_per_s"],
        "last_return": summary["mean_return"],
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="rank counts; the first is the base")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each running every rank count once")
    parser.add_argument("--iterations", type=int, default=8, help="per run; the first is warm-up (>= 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run; env.num_envs is the total")
    args = parser.parse_args(argv)
    if args.iterations < 2:
        sys.exit(f"--iterations={args.iterations}: need at least 2 (the first is warm-up)")
    try:  # a bad override fails here, once, rather than in every run
        cfg = compose_overrides(args.overrides)
    except HydraException as e:
        cause = f": {str(e.__cause__).splitlines()[0]}" if e.__cause__ else ""
        sys.exit(f"ebrl.bench.ranks: {' '.join(str(e).split())}{cause}")
    total, minibatches = cfg.env.num_envs, cfg.algo.minibatches
    chunks = cfg.algo.get("rollout_chunks")  # (none under GRPO: its batch is whole episodes, split by env)
    for n in args.ranks:
        if n < 1 or total % n:
            sys.exit(f"--ranks {n}: env.num_envs={total} (the total over ranks) must split evenly over the ranks")
        if (total // n * (chunks or 1)) % minibatches:
            batch = (
                f"env.num_envs x algo.rollout_chunks = {total // n} x {chunks}"
                if chunks
                else f"env.num_envs = {total // n} (algo=grpo batches whole episodes)"
            )
            sys.exit(f"--ranks {n}: algo.minibatches={minibatches} does not divide a rank's rollout batch {batch}")
    common = [o for o in args.overrides if not o.startswith("env.num_envs=")]
    common += ["progress=false", "logger=none", "checkpoint_every=1000000", f"iterations={args.iterations}"]
    rows = [
        run_one(n, repeat, [*common, f"env.num_envs={total // n}"])
        for repeat in range(args.repeats)
        for n in args.ranks
    ]

    print(
        f"\n{len(os.sched_getaffinity(0))} cores, {total} envs in all, {args.iterations} iterations per run "
        "(env steps/s after the first)"
    )
    print("| ranks | repeat | env steps/s | last return | wall s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['ranks']} | {r['repeat']} | {r['env_steps_per_s']:.1f} | {r['last_return']:.2f} | "
            f"{r['wall_s']:.0f} |"
        )
    means = {n: statistics.mean(r["env_steps_per_s"] for r in rows if r["ranks"] == n) for n in args.ranks}
    base = args.ranks[0]
    for n, mean in means.items():
        ratio = f"; {plural(n)} / {plural(base)} = {mean / means[base]:.2f}x" if n != base else ""
        print(f"{plural(n)}: mean {mean:.1f} env steps/s{ratio}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "ranks")
