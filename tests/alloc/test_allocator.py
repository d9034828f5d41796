"""The allocator in real runs: a profile that is wrong about the simulators is corrected by what the run measures
and the simulators get more cores; profiles are found by policy x env x hw, and a mismatching one is refused."""

from __future__ import annotations

import json
import os

import pytest

from ebrl.alloc.allocator import Allocator, cpu_sets, profile_key, stage_rates
from ebrl.alloc.profile import linear_profile, profile_path
from ebrl.config import ConfigError
from ebrl.runs.experiment import Experiment
from tests.conftest import compose_config

SMALL = ["scheduler=ebrl", "env.num_envs=4", "algo.rollout_chunks=4", "progress=false", "checkpoint_every=1000"]
CPU = {"simulate": "cores", "generate": "core_share", "train": "core_share"}


def test_cpu_sets_keep_generation_and_training_apart_and_let_the_simulators_fill_the_rest():
    assert cpu_sets({"simulate": 1, "generate": 0.5, "train": 0.5}, [0, 1]) == {
        "simulate": [0],
        "generate": [0],
        "train": [1],
    }
    # a fractional sim share spills onto the policy's cores, where the (niced) simulators fill what they leave
    assert cpu_sets({"simulate": 1.5, "generate": 0.25, "train": 0.25}, [4, 5]) == {
        "simulate": [4, 5],
        "generate": [4],
        "train": [5],
    }
    assert cpu_sets({"simulate": 5, "generate": 1.25, "train": 1.75}, list(range(8))) == {
        "simulate": [0, 1, 2, 3, 4],
        "generate": [4, 5],
        "train": [6, 7],
    }
    assert cpu_sets({"simulate": 1, "generate": 0.25, "train": 1.75}, [0, 1])["generate"] == [1]  # no core left
    # a GPU node: train its own core, generate its own and the supervisor's (tests/alloc/test_gpu_node.py)
    assert cpu_sets({"simulate": 5, "generate": 0.3, "train": 0.3}, list(range(8)), gpu=True) == {
        "simulate": [0, 1, 2, 3, 4],
        "generate": [5, 6],
        "train": [7],
    }


def test_stage_rates_from_cpu_time():
    # 100 env steps/s on 2 cores; the simulators used 80% of the cores: 16 ms of CPU per env step
    rates = stage_rates(
        {"simulate": 1.5, "generate": 0.25, "train": 0.25},
        100.0,
        {"simulate": 0.8, "generate": 0.05, "train": 0.1},
        {},
        cores=2,
        gpu=False,
    )
    assert rates["simulate"] == pytest.approx(1.5 / 0.016)
    assert rates["generate"] == pytest.approx(0.25 / 0.001) and rates["train"] == pytest.approx(0.25 / 0.002)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move the simulators between")
def test_elastic_allocator_gives_the_simulators_more_cores_when_they_are_slower_than_the_profile(tmp_path):
    # (fenced: a work-conserving run lends the simulators the other core from the start, and this checks the move)
    cfg = compose_config(
        *SMALL,
        "allocator=elastic",
        "allocator.window=2",
        "allocator.cooldown=0",
        "iterations=6",
        "hw.cpu_cores=2",
        f"allocator.profiles_dir={tmp_path / 'profiles'}",
        "scheduler.work_conserving=false",
        "env.fast_step=false",
        "algo.epochs=1",
    )
    # (the stock simulator step and one epoch: simulation must outweigh generation and training by far, on any
    # machine, for the move to pay: ~7 ms of CPU per env step here and on CI's machine, ~3x generation and training)
    # a profile that thinks simulation costs 2 ms of CPU per env step, generation and training 1 each: it plans
    # 1 core for the simulators and the other for generation and training
    wrong = linear_profile(
        {"simulate": 0.002, "generate": 0.001, "train": 0.001},
        [2],
        CPU,
        profile_key(cfg),
        {"simulate": 2.0, "generate": 2.0, "train": 2.0},
    )
    wrong.save(profile_path(tmp_path / "profiles", profile_key(cfg)))
    run = Experiment.from_config(cfg, run_dir=tmp_path / "run")
    allocator = run.placement.allocator
    assert allocator.current.x["simulate"] == 1
    first = allocator.leases
    run.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    decided = [r for r in rows if "alloc/decision" in r]
    assert decided, [r["alloc/rate_simulate"] for r in rows]
    assert "simulate is the bottleneck" in decided[0]["alloc/decision"]
    assert rows[0]["alloc/simulate"] == 1 and rows[-1]["alloc/simulate"] > 1
    assert allocator.decisions[0].step >= 2  # not on the first reading: the window is 2
    # the simulators really ran on the new cores: every chunk reports the affinity its process had
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    chunks = sorted((e for e in trace if e.get("cat") == "simulate"), key=lambda e: e["ts"])
    before, added = set(first["simulate"]), set(allocator.leases["simulate"]) - set(first["simulate"])
    assert added and set(chunks[0]["args"]["cpus"]) <= before
    moved = [e for e in chunks if set(e["args"]["cpus"]) & added]
    assert moved and moved[0]["ts"] > chunks[0]["ts"]
    leases = dict(run.placement.pool.leases)
    assert leases["simulate"].cpus == tuple(allocator.leases["simulate"]) and leases["simulate"].version >= 1


def test_the_plan_picks_the_generation_batch_and_the_envs_are_regrouped_for_it(tmp_path):
    cfg = compose_config(
        *SMALL,
        "scheduler.groups=1",
        "iterations=3",
        "hw.cpu_cores=2",
        f"allocator.profiles_dir={tmp_path / 'profiles'}",
    )
    # measured at batches 2 and 4 alike: ties go to the smaller batch (more groups to pipeline), 2 groups of 2 envs
    profile = linear_profile(
        {"simulate": 0.015, "generate": 0.001, "train": 0.0025},
        [2, 4],
        CPU,
        profile_key(cfg),
        {"simulate": 2.0, "generate": 2.0, "train": 2.0},
    )
    profile.save(profile_path(tmp_path / "profiles", profile_key(cfg)))
    run = Experiment.from_config(cfg, run_dir=tmp_path / "run")
    assert run.placement.allocator.current.batch == 2
    run.train()
    assert [g.envs for g in run.scheduler.loop.groups] == [[0, 1], [2, 3]]
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    served = [e["args"]["groups"] for e in trace if e.get("name") == "sample"]
    assert {g for groups in served for g in groups} == {0, 1}  # generation served the two groups, from the start


def test_a_profile_is_found_by_policy_env_and_hw_and_a_mismatching_one_is_refused(tmp_path):
    cfg = compose_config(*SMALL, f"allocator.profiles_dir={tmp_path}")
    assert Allocator(cfg, [0, 1]).profile is None  # none yet: calibrate from the costs of iteration 2
    profile = linear_profile(
        {"simulate": 0.015, "generate": 0.001, "train": 0.002},
        [2],
        CPU,
        profile_key(cfg),
        {"simulate": 2.0, "generate": 2.0, "train": 2.0},
    )
    path = profile.save(profile_path(tmp_path, profile_key(cfg)))
    found = Allocator(cfg, [0, 1])
    assert found.profile is not None and str(path) in found.source
    assert found.current.x["simulate"] > 1  # simulation is most of the work
    other = compose_config(*SMALL, "policy.preset=small", f"allocator.profile={path}")
    with pytest.raises(ConfigError) as e:
        Allocator(other, [0, 1])
    assert "was measured for preset=tiny, and this run has preset=small" in str(e.value)
    assert "\n" not in str(e.value)
    # hw=cpu is whatever machine runs it: a profile from one with other cores does not steer this one
    bigger = linear_profile(
        {"simulate": 0.015, "generate": 0.001, "train": 0.002},
        [2],
        CPU,
        {**profile_key(cfg), "cores": 64},
        {"simulate": 64.0, "generate": 64.0, "train": 64.0},
    )
    bigger.save(path)
    cores = profile_key(cfg)["cores"]
    with pytest.raises(ConfigError, match=f"was measured for cores=64, and this run has cores={cores}"):
        Allocator(cfg, [0, 1])


def test_a_multi_task_run_s_profile_is_of_its_mix_of_tasks(tmp_path):
    cfg = compose_config("env.num_envs=4", "env.tasks=[Lift,Stack]", f"allocator.profiles_dir={tmp_path}")
    assert profile_key(cfg)["task"] == "Lift+Stack"
    assert profile_path(tmp_path, profile_key(cfg)).name.startswith("openpi-tiny_robosuite-Lift_Stack_")
    assert profile_key(compose_config("env.task=Door"))["task"] == "Door"
