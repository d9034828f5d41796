"""scheduler.serial=true: every stage in the supervisor, the simulators answered in one of its threads by the code a
simulator process runs (ebrl/envs/serial.py); a real robosuite run, set beside the same run on processes."""

from __future__ import annotations

import json
import os
import sys
import threading

import psutil
import pytest

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.envs.base import EnvSetupError
from ebrl.envs.robosuite_env import RobosuiteEnv
from ebrl.envs.worker import SimWorkerPool
from ebrl.runs.experiment import Experiment
from tests.conftest import compose_config

RUN = [
    "env.num_envs=2",
    "algo.rollout_chunks=2",
    "algo.minibatches=2",
    "algo.epochs=1",
    "iterations=2",
    "env.max_episode_steps=24",
    "env.reward=dense",
    "progress=false",
    "logger=none",
    "checkpoint_every=1000",
    "init=null",
    "seed=3",
]


class BreakingLift(RobosuiteEnv):
    """robosuite's Lift with a breakpoint() in its first step, as a user debugging an adapter writes it."""

    def step(self, action):
        if not getattr(self, "stopped", False):
            self.stopped = True
            breakpoint()
        return super().step(action)


def trained(tmp_path, *overrides: str) -> tuple[Experiment, list[dict]]:
    exp = Experiment.from_config(compose_config(*RUN, *overrides), run_dir=tmp_path / "run")
    if "scheduler.serial=true" in overrides:
        children = [" ".join(c.cmdline()) for c in psutil.Process().children(recursive=True)]
        assert [c for c in children if "resource_tracker" not in c] == []  # its simulators are built, here
        assert {w.pid for w in exp.pool.workers} == {None}
        assert exp.pool.chunk_timeout_s is None  # a paused breakpoint is no hung simulator
    exp.train()
    return exp, [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_serial_run_is_the_same_run_in_one_process_and_a_breakpoint_in_its_adapter_stops_there(tmp_path, monkeypatch):
    stops = []  # (pid, thread name) of each breakpoint() a BreakingLift reached
    monkeypatch.setattr(sys, "breakpointhook", lambda: stops.append((os.getpid(), threading.current_thread().name)))
    target = f"env._target_={__name__}.BreakingLift"
    _, serial = trained(tmp_path / "serial", "scheduler.serial=true", target)
    assert stops == [(os.getpid(), "ebrl-simulators_0")] * 2  # each env's first step, in this process's thread
    _, spawned = trained(tmp_path / "spawned")  # robosuite's Lift itself, in processes
    keys = ["train/return_mean", "train/value_mean", "losses/policy", "losses/value", "train/approx_kl"]
    assert [[m[k] for k in keys] for m in serial] == [[m[k] for k in keys] for m in spawned]


def test_serial_takes_a_schedule_that_runs_in_this_process_and_an_env_of_this_interpreter():
    with pytest.raises(
        ConfigError,
        match="^scheduler.serial=true runs every stage in this process, one after "
        "another, and scheduler=ebrl trains in a process of its own; use "
        "scheduler=colocated scheduler.serial=true$",
    ):
        validate(compose_config(*RUN, "scheduler=ebrl", "scheduler.serial=true"))
    pool = SimWorkerPool(
        {
            "_target_": "ebrl.envs.robosuite_env.RobosuiteEnv",
            "name": "robosuite",
            "task": "Lift",
            "python": "/usr/bin/python3",
        },
        num_envs=1,
        seed=0,
        serial=True,
    )
    with pytest.raises(
        EnvSetupError,
        match="runs the simulators in this process .* and this env's run under "
        "/usr/bin/python3; serially, run an env of this interpreter",
    ):
        pool.start()


@pytest.mark.parametrize(
    "overrides,envs", [((), 2), (("algo=grpo",), 4), (("algo=sft",), 2), (("experiment=lift_ebrl",), 2)]
)
def test_debug_serial_turns_the_serial_mode_on(overrides, envs):
    """`python run.py debug=serial` (conf/debug/serial.yaml): scheduler.serial on the colocated schedule, no progress
    bar, two envs or one GRPO group; over an experiment too (lift_ebrl's schedule gives way to colocated)."""
    cfg = compose_config(*overrides, "debug=serial")
    assert (cfg.scheduler.name, cfg.scheduler.serial, cfg.progress, cfg.env.num_envs) == (
        "colocated",
        True,
        False,
        envs,
    )
    validate(cfg)
    assert compose_config(*overrides, "debug=serial", "env.num_envs=8").env.num_envs == 8  # the command line wins


def test_an_answer_that_comes_after_a_close_at_exit_writes_nothing(monkeypatch, caplog):
    """At the interpreter's exit the simulators' thread takes no new work, so a close runs at once, ahead of what is
    still queued there; those answers find the pipe closed and must not write to it (its descriptor may be another
    file's by then; it was logged as 'Bad file descriptor' at the end of serial runs)."""
    from concurrent.futures import ThreadPoolExecutor

    from omegaconf import OmegaConf

    from ebrl.envs import serial
    from ebrl.envs.process import Simulator

    thread = ThreadPoolExecutor(1, thread_name_prefix="ebrl-simulators")
    monkeypatch.setattr(serial, "_thread", thread)
    conn = serial.InProcess(Simulator, OmegaConf.to_container(compose_config(*RUN).env, resolve=True), 0)
    assert conn.recv()[0] == "spec"
    busy = threading.Event()
    thread.submit(busy.wait)  # the thread is busy, and a notice waits behind it ...
    conn.send(("reset",))
    thread.shutdown(wait=False)  # ... when the interpreter's exit stops the thread from taking more
    with caplog.at_level("ERROR", logger="concurrent.futures"):
        conn.close()  # (at once, here)
        busy.set()
        thread.shutdown(wait=True)  # the queued notice is answered after the close
    assert [r.getMessage() for r in caplog.records] == []
