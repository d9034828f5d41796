"""A new MPS share is a new process (a share is read when a process's CUDA starts): generation in a process of its
own (scheduler.generation=process, the placement under MPS) and the trainer are respawned in the environment of the
moment and hand over to the successor while the run goes on. An environment variable stands in for
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (this machine has no MPS daemon); real simulators, trainer and generation."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from ebrl.node import process_affinity
from ebrl.runs.experiment import Experiment
from ebrl.runtime.generation import GenerationError
from ebrl.runtime.resources import environment
from ebrl.telemetry.timers import ProcessCpu
from tests.conftest import compose_config
from tests.runtime.test_pipeline import WORKLOAD


@pytest.mark.slow  # (the default suite's time)
def test_respawned_generation_and_trainer_take_over_with_their_new_environment_and_the_run_goes_on(tmp_path):
    exp = Experiment.from_config(
        compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.generation=process", "iterations=4"),
        run_dir=tmp_path / "run",
    )
    s, pool = exp.scheduler, exp.placement.pool
    first, first_trainer = s.generation.pid, s.trainer.process.pid
    try:
        assert first != os.getpid() and first in pool._pids["generate"] and os.getpid() not in pool._pids["generate"]
        versions = [s.next_iteration()[1]["sched/weights_version"]]
        mark = s.trace.mark()
        # what a plan with new MPS shares calls (ResourcePool.on_requota); a marker stands in for the share's variable
        with environment({"EBRL_TEST_SHARE": "37"}):
            exp.placement._requota_generation(pool.leases["generate"])
        with environment({"EBRL_TEST_SHARE": "63"}):
            exp.placement._requota_trainer(pool.leases["train"])
        s.wait_trainer_switch()  # (a run hands over at the first loop step after the successor is ready)
        for _ in range(3):
            stats, metrics = s.next_iteration()
            versions.append(metrics["sched/weights_version"])
            assert stats.env_steps == 2 * 4 * exp.policy.chunk_len  # every env's 2 chunks, none lost in the handovers
        s.generation.wait_switch()
        second, second_trainer = s.generation.pid, s.trainer.process.pid
        environ = {pid: open(f"/proc/{pid}/environ", "rb").read().split(b"\0") for pid in (second, second_trainer)}
        affinity = {stage: process_affinity(pid) for stage, pid in (("generate", second), ("train", second_trainer))}

        # the serving generation holds the last published weights: its samples' version, its values the trainer's
        obs = s.observations.of(range(4))
        sampled = s.generation.sample(obs)
        model, optimizer = s.training_state()
        exp.policy.load_state_dict(s.trainer.weights.state())
        with torch.no_grad():
            local = exp.policy.value(obs)
        served = s.generation.value(obs)
        os.kill(second, 9)
        with pytest.raises(GenerationError, match=rf"^generation process \(pid {second}\) stopped; exit code -9$"):
            s.generation.value(obs)
    finally:
        exp.close()
    assert versions == [1.0, 2.0, 3.0, 4.0] and sampled.version == 4  # the successors count on, in the same channel
    assert torch.allclose(served, local, atol=1e-6)
    assert all(torch.equal(model[k], v) for k, v in exp.policy.state_dict().items())
    # Adam went on from the handed-over state: 4 updates of 2 minibatches x 1 epoch (a fresh one would count 6)
    assert {float(state["step"]) for state in optimizer["state"].values()} == {8.0}
    for pid, share in ((second, b"37"), (second_trainer, b"63")):
        assert b"EBRL_TEST_SHARE=" + share in environ[pid]
    assert not any(psutil.pid_exists(pid) for pid in (first, second, first_trainer, second_trainer))
    for stage, pid in (("generate", second), ("train", second_trainer)):  # the leases moved to the successors
        assert pool._pids[stage] == {pid}
        assert all(mask == set(pool.leases[stage].cpus) for mask in affinity[stage].values())
    before, after = (
        [sp.args["pid"] for sp in part if sp.lane == "generate"]
        for part in (s.trace.spans[:mark], s.trace.spans[mark:])
    )
    # the old generation served until the successor was ready, then only the successor
    assert set(before) == {first} and set(after) <= {first, second}
    assert after == sorted(after, key=lambda pid: pid == second)


def test_cpu_shares_count_a_process_added_later_and_do_not_take_back_one_that_ended():
    def burner(seconds: float) -> tuple[subprocess.Popen, psutil.Process]:
        code = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {seconds}: pass\ntime.sleep(60)"
        proc = subprocess.Popen([sys.executable, "-c", code])
        return proc, psutil.Process(proc.pid)

    def burnt(p: psutil.Process, seconds: float) -> None:
        while sum(p.cpu_times()[:2]) < seconds:
            time.sleep(0.02)

    old, old_ps = burner(0.6)
    new = None
    try:
        shares = ProcessCpu({"main": [old.pid]}, cores=1)
        burnt(old_ps, 0.6)
        shares.read()  # the old process's 0.6 CPU-seconds are counted here
        old.kill()
        old.wait()
        new, new_ps = burner(0.2)
        shares.add("main", new.pid)
        burnt(new_ps, 0.2)
        share = shares.read()["perf/cpu_share_main"]
    finally:
        for proc in (old, new):
            if proc is not None:
                proc.kill()
                proc.wait()
    # the new process's CPU since its add counts; the ended one's 0.6 s are not taken back (which would read < 0)
    assert share > 0
