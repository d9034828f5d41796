"""gpu_check's driver on this CPU machine: its two parts, a check ended by SIGTERM or --timeout (its MPS daemon
stopped, its processes ended), and the figures `python -m ebrl.bench.at_scale --gpu-costs` reads from it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ebrl.bench.at_scale import modelled_costs, read_gpu_costs
from ebrl.bench.gpu_check import CHECKS, PARTS, full_costs, write_results
from ebrl.bench.schedulers import compose_overrides
from ebrl.config import ConfigError

# a check that holds what a GPU check holds when the time is up: an MPS daemon of its own (the stand-in binary) and
# a spawned child, until it is stopped
HOLDING = """
import multiprocessing as mp, sys, time
from pathlib import Path
from ebrl.bench import gpu_check
from ebrl.runtime.resources import MpsDaemons

RUN_DIR = Path(sys.argv[1])

def holds(args):
    with MpsDaemons([0], RUN_DIR) as daemons:
        child = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
        child.start()
        print("HOLDING", daemons.daemons[0].control, child.pid, flush=True)
        time.sleep(600)
    return True, {}

gpu_check.RUNNERS["mps"] = holds
sys.argv = ["gpu_check", "--only", "mps", "green", "--out", sys.argv[2], "--timeout", sys.argv[3]]
sys.exit(gpu_check.main())
"""


def test_two_parts_hold_every_check_once():
    assert sorted(c for names in PARTS.values() for c in names) == sorted(CHECKS)
    assert {"egl", "mps", "full"} <= set(PARTS[1])  # issue 50's items 2 and 3, and the costs at_scale reads


@pytest.mark.parametrize("stop", ["SIGTERM", "--timeout"])
def test_a_check_ended_by_sigterm_or_its_timeout_stops_its_daemon_and_its_processes(
    stop, tmp_path, repo, fake_mps_control
):
    out = tmp_path / "figures.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDING, str(tmp_path / "run"), str(out), "600" if stop == "SIGTERM" else "4"],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = next(line for line in proc.stdout if line.startswith("HOLDING"))
    control, child = Path(line.split()[1]), int(line.split()[2])
    assert control.exists() and psutil.pid_exists(child)
    if stop == "SIGTERM":
        proc.send_signal(signal.SIGTERM)  # (as the device tool's time limit sends it)
    said = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert not control.exists() and not control.parent.exists()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    why = "SIGTERM came" if stop == "SIGTERM" else "--timeout=4 s passed"
    assert f"FAIL  mps        {why} during it; the processes it started are ended" in said
    assert json.loads(out.read_text()) == {
        "mps": {"status": "FAIL", "error": f"{why} during it"},
        "green": {"status": "SKIP", "reason": f"not reached: {why}"},
    }


def test_at_scale_reads_the_costs_that_gpu_check_writes(tmp_path):
    """The full check's figures as gpu_check writes them replace the roofline's; a file without them (part 2's) or
    whose full check failed is one line."""
    costs = full_costs("NVIDIA H200", {1: 10.0, 8: 20.0, 32: 50.0}, update_s=0.024, rows=8)
    part1, part2 = tmp_path / "part1.json", tmp_path / "part2.json"
    write_results({"basics": {"status": "PASS"}, "full": {"status": "PASS", "build_s": 30.0, "costs": costs}}, part1)
    write_results({"policy": {"status": "SKIP", "reason": "no CUDA device"}}, part2)
    read = read_gpu_costs(str(part1))
    overrides = ["hw=h200x1", "policy.preset=small", "env.num_envs=16", "algo.rollout_chunks=4", "algo.minibatches=1"]
    modelled = modelled_costs(compose_overrides(overrides), (6.0, 9.0), 2.0, 1, gpu_costs=read)
    assert modelled.on_gpu("sample", 8, 1.0).seconds == pytest.approx(0.02)
    assert modelled.on_gpu("train", 16, 1.0).seconds == pytest.approx(0.003 * 16 * int(modelled.shape.algo.epochs))
    with pytest.raises(ConfigError, match=r"holds no full check: give the JSON of .*gpu_check --part 1"):
        read_gpu_costs(str(part2))
    write_results({"full": {"status": "FAIL", "error": "OutOfMemoryError: CUDA out of memory"}}, part1)
    with pytest.raises(ConfigError, match=r"measured no costs \(FAIL: OutOfMemoryError: CUDA out of memory\)"):
        read_gpu_costs(str(part1))
