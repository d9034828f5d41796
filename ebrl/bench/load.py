"""A controlled foreign load beside a benchmark: busy processes at nice 0, as a user's node has (a data loader, a
second job, a compile), started and stopped around a measurement.

`python -m ebrl.bench.load` measures what a thread team pays beside that load: the tiny preset's training step and
sampling (`ebrl.bench.policies`, in a fresh process each, since OpenMP reads its wait policy once at start) at 1 and
2 torch threads, under OpenMP's default wait policy (a thread that finds no work spins a while before it sleeps) and
under OMP_WAIT_POLICY=PASSIVE (it sleeps at once), quiet and beside 1 and 2 busy processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

BUSY = "while True: pass"


@contextlib.contextmanager
def foreign_load(processes: int, cores: Sequence[int] | None = None) -> Iterator[list[int]]:
    """`processes` single-threaded busy loops at nice 0 for the duration; `cores`: process i pinned to
    cores[i % len(cores)] (None: where the kernel puts them). Yields their pids."""

    def start(i: int) -> subprocess.Popen:
        def at_nice_0() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
            except PermissionError:  # (a benchmark run under nice, without the right to lower it: its own)
                pass
            if cores:
                os.sched_setaffinity(0, {cores[i % len(cores)]})

        return subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=at_nice_0, stdin=subprocess.DEVNULL)

    busy = [start(i) for i in range(processes)]
    try:
        yield [p.pid for p in busy]
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()


def policy_costs(threads: int, wait_policy: str | None, load: int, reps: int) -> dict:
    """The tiny preset's sampling (batch 8, ms per chunk) and training step (ms per sample at batch 40) in a fresh
    process with `threads` torch threads and OMP_WAIT_POLICY=`wait_policy` (None: unset), beside `load` busy
    processes."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    with tempfile.TemporaryDirectory(prefix="ebrl-load-") as tmp, foreign_load(load):
        out = Path(tmp) / "costs.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ebrl.bench.policies",
                "--families",
                "openpi",
                "--presets",
                "tiny",
                "--batches",
                "8",
                "--train-batch",
                "40",
                "--reps",
                str(reps),
                "--threads",
                str(threads),
                "--json",
                str(out),
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        row = json.loads(out.read_text())["results"][0]
    return {"sample_ms": row["sample_ms"]["8"], "train_ms": row["train_ms_per_sample"]}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1, 2], help="busy processes beside each case")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    rows = []
    print(
        f"the tiny preset on {os.cpu_count()} cores: sampling ms per chunk at batch 8 / training ms per sample at "
        "batch 40 (medians); in brackets: against the same case quiet"
    )
    print("| torch threads | OMP_WAIT_POLICY | " + " | ".join(f"{n} busy" for n in args.loads) + " |")
    print("|---|---|" + "---|" * len(args.loads))
    for threads in args.threads:
        for policy in (None, "PASSIVE"):
            costs = [policy_costs(threads, policy, n, args.reps) for n in args.loads]
            rows += [
                {"threads": threads, "wait_policy": policy or "default", "load": n, **c}
                for n, c in zip(args.loads, costs)
            ]
            quiet = costs[0]
            cells = [
                f"{c['sample_ms']:.1f} / {c['train_ms']:.2f}"
                + (
                    f" ({c['sample_ms'] / quiet['sample_ms']:.1f}x / {c['train_ms'] / quiet['train_ms']:.1f}x)"
                    if c is not quiet
                    else ""
                )
                for c in costs
            ]
            print(f"| {threads} | {policy or 'default'} | " + " | ".join(cells) + " |", flush=True)
    return rows


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "load")
