"""How promptly a run stops on a shared node: `python -m ebrl.bench.stop`.

Beside `--foreign-load` busy processes at nice 0 (ebrl/bench/load.py), it starts `python run.py` (the small
overrides the tests use, `--schedules` in turn) and, once the run has logged `--after` iterations, sends it SIGTERM;
then the same again with a second SIGTERM `--second` seconds after the first. It prints, per schedule and stop: the
seconds from the first signal to the process's exit, its exit code and last line, the iteration of the checkpoint
left behind against the run's last logged one, and whether the run resumes from it (one more iteration). And the same
for the scheduler benchmark (`python -m ebrl.bench.schedulers`), signalled `--bench-after` seconds after its start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from ebrl.bench.load import foreign_load

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "env.num_envs=2",
    "algo.rollout_chunks=4",
    "algo.minibatches=2",
    "algo.epochs=2",
    "env.max_episode_steps=24",
    "progress=false",
    "logger=none",
    "init=null",
    "checkpoint_every=1",
]


def stopped(
    cmd: list[str], ready: Callable[[], bool], twice: float | None, timeout: float = 600
) -> tuple[float, int, str]:
    """Start `cmd`, wait until `ready()`, send SIGTERM (and again `twice` s later); seconds to exit, code, last line."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        while not ready() and proc.poll() is None and time.monotonic() - start < timeout:
            time.sleep(0.1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if twice is not None:
            time.sleep(twice)
            proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=timeout)[1]
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    # (a warning's second line echoes the source line that raised it: the message is the one before)
    lines = [line for line in err.splitlines() if line.strip() and not line[0].isspace()]
    return took, proc.returncode, lines[-1] if lines else ""


def logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def stop_run(schedule: str, after: int, twice: float | None, work: Path) -> dict:
    """One run.py stopped after `after` logged iterations; what it left behind, and whether it resumes."""
    import torch

    run_dir = work / f"{schedule}-{'twice' if twice is not None else 'once'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "run.py", *SMALL, f"scheduler={schedule}", "iterations=1000", f"hydra.run.dir={run_dir}"]
    took, code, line = stopped(cmd, lambda: logged(run_dir) >= after, twice)
    at_stop = logged(run_dir)  # (before the resumed iteration adds its own)
    ckpt = run_dir / "checkpoints" / "last.pt"
    kept = torch.load(ckpt, weights_only=False, map_location="cpu")["iteration"] if ckpt.exists() else None
    resumed = None
    if kept is not None:
        again = subprocess.run(
            [sys.executable, "run.py", *SMALL, f"scheduler={schedule}", f"resume={run_dir}", f"iterations={kept + 1}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        resumed = again.returncode == 0
    return {
        "what": f"run.py scheduler={schedule}",
        "signals": 2 if twice is not None else 1,
        "seconds": took,
        "exit": code,
        "line": line,
        "logged": at_stop,
        "checkpoint": kept,
        "resumed": resumed,
    }


def stop_bench(after_s: float, twice: float | None) -> dict:
    cmd = [sys.executable, "-m", "ebrl.bench.schedulers", "--modes", "colocated", "ebrl", "async", "--no-gym"]
    start = time.monotonic()
    took, code, line = stopped(cmd, lambda: time.monotonic() - start >= after_s, twice)
    return {
        "what": "bench.schedulers",
        "signals": 2 if twice is not None else 1,
        "seconds": took,
        "exit": code,
        "line": line,
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--foreign-load", type=int, default=2, metavar="N", help="busy processes at nice 0 beside it")
    parser.add_argument("--schedules", nargs="+", default=["colocated", "ebrl"])
    parser.add_argument("--after", type=int, default=2, help="iterations logged before the signal")
    parser.add_argument("--second", type=float, default=1.0, help="seconds between the first and a second SIGTERM")
    parser.add_argument("--bench-after", type=float, default=40.0, help="seconds into the scheduler benchmark")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebrl-stop-") as tmp, foreign_load(args.foreign_load):
        for schedule in args.schedules:
            for twice in (None, args.second):
                rows.append(stop_run(schedule, args.after, twice, Path(tmp)))
        for twice in (None, args.second):
            rows.append(stop_bench(args.bench_after, twice))
        load = os.getloadavg()[0]
    print(
        f"\nbeside {args.foreign_load} busy process(es) at nice 0 ({os.cpu_count()} cores; load average "
        f"{load:.1f} at the end):"
    )
    print("| what | SIGTERMs | seconds to exit | exit | last line | iterations logged | checkpoint | resumed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['what']} | {r['signals']} | {r['seconds']:.1f} | {r['exit']} | {r['line'][:90]} | "
            f"{r.get('logged', '-')} | {r.get('checkpoint', '-')} | {r.get('resumed', '-')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "stop")
