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

from ebrl.runtime.experiment import Experiment
from ebrl.runtime.generation import GenerationError
from ebrl.runtime.resources import environment, process_affinity
from ebrl.telemetry.timers import ProcessCpu
from tests.conftest import compose_config
from tests.runtime.test_pipeline import WORKLOAD


def test_a_respawned_generation_process_takes_over_with_its_new_environment_and_the_run_goes_on(tmp_path):
    exp = Experiment.from_config(compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.generation=process",
                                                "iterations=4"), run_dir=tmp_path / "run")
    s, pool = exp.scheduler, exp.resources
    first = s.generation.pid
    try:
        assert first != os.getpid() and first in pool._pids["generate"] and os.getpid() not in pool._pids["generate"]
        versions = [s.next_iteration()[1]["sched/weights_version"]]
        mark = s.trace.mark()
        # what a new MPS share calls (ResourcePool.on_requota); the marker stands in for the share's variable
        with environment({"EBRL_TEST_SHARE": "37"}):
            exp._requota_generation(pool.leases["generate"])
        for _ in range(3):
            stats, metrics = s.next_iteration()
            versions.append(metrics["sched/weights_version"])
            assert stats.env_steps == 2 * 4 * exp.policy.chunk_len  # every env's 2 chunks, none lost in the handover
        s.generation.wait_switch()
        second = s.generation.pid
        environ = open(f"/proc/{second}/environ", "rb").read().split(b"\0")
        lease_cpus = set(pool.leases["generate"].cpus)
        assert all(mask == lease_cpus for mask in process_affinity(second).values())

        # the serving process holds the last published weights: its samples' version, its values the trainer's
        obs = s._batch_obs([w.obs for w in exp.pool.workers], list(range(4)))
        sampled = s.generation.sample(obs)
        exp.policy.load_state_dict(s.trainer.channel.tensors)
        with torch.no_grad():
            local = exp.policy.value(obs)
        served = s.generation.value(obs)
    finally:
        exp.close()
    assert versions == [1.0, 2.0, 3.0, 4.0] and sampled.version == 4
    assert torch.allclose(served, local, atol=1e-6)
    assert second != first and not psutil.pid_exists(first) and not psutil.pid_exists(second)
    assert b"EBRL_TEST_SHARE=37" in environ
    assert pool._pids["generate"] == {second}  # the lease moved to the successor
    before, after = ([sp.args["pid"] for sp in part if sp.lane == "generate"]
                     for part in (s.trace.spans[:mark], s.trace.spans[mark:]))
    # the old process served until the successor was ready, then only the successor
    assert set(before) == {first} and set(after) <= {first, second}
    assert after == sorted(after, key=lambda pid: pid == second)


def test_cpu_shares_count_a_process_added_later_and_one_that_ended():
    burn = [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"]
    old = subprocess.Popen(burn)
    shares = ProcessCpu({"main": [old.pid]}, cores=1)
    old.wait()
    new = subprocess.Popen([*burn[:2], burn[2] + "\ntime.sleep(30)"])
    try:
        shares.add("main", new.pid)
        time.sleep(1.0)
        share = shares.read()["perf/cpu_share_main"]
    finally:
        new.kill()
        new.wait()
    # the ended process is not read as negative CPU; the new one counts from its add
    assert share > 0


def test_a_respawned_trainer_takes_over_between_updates_with_the_model_and_adam_state(tmp_path):
    exp = Experiment.from_config(compose_config(*WORKLOAD, "scheduler=ebrl", "iterations=4"), run_dir=tmp_path / "run")
    s, pool = exp.scheduler, exp.resources
    first = s.trainer.process.pid
    try:
        versions = [s.next_iteration()[1]["sched/weights_version"]]
        with environment({"EBRL_TEST_SHARE": "63"}):
            exp._requota_trainer(pool.leases["train"])
        s.wait_trainer_switch()  # (a run hands over at the first loop step after the successor is ready)
        second = s.trainer.process.pid
        environ = open(f"/proc/{second}/environ", "rb").read().split(b"\0")
        versions += [s.next_iteration()[1]["sched/weights_version"] for _ in range(3)]
        model, optimizer = s.training_state()
        published = {k: v.clone() for k, v in s.trainer.channel.tensors.items()}
    finally:
        exp.close()
    assert second != first and not psutil.pid_exists(first) and not psutil.pid_exists(second)
    assert b"EBRL_TEST_SHARE=63" in environ and pool._pids["train"] == {second}
    assert versions == [1.0, 2.0, 3.0, 4.0]  # the successor publishes into the same channel, counting on
    # Adam went on from the handed-over state: 4 updates of 2 minibatches x 1 epoch (a fresh one would count 6)
    assert {float(state["step"]) for state in optimizer["state"].values()} == {8.0}
    assert all(torch.equal(model[k], published[k]) for k in published)


def test_a_generation_process_that_dies_stops_the_run_in_one_line(tmp_path):
    exp = Experiment.from_config(compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.generation=process",
                                                "iterations=3"), run_dir=tmp_path / "run")
    s = exp.scheduler
    pid = s.generation.pid
    try:
        s.next_iteration()
        os.kill(pid, 9)
        with pytest.raises(GenerationError, match=rf"^generation process \(pid {pid}\) stopped; exit code -9$"):
            for _ in range(2):
                s.next_iteration()
    finally:
        exp.close()
