"""The allocator on a GPU node (hw=h200x1: 16 cores, one GPU): generate and train keep a core each for their CPU side,
and a calibration reads their rates per SM share, so it predicts what it measured."""

from __future__ import annotations

import dataclasses

import pytest

from ebrl.alloc.allocator import CALIBRATE_AT, Allocator, Measured, cpu_sets, totals_of
from ebrl.alloc.planner import Totals, plan
from ebrl.alloc.profile import STAGES, linear_profile
from tests.conftest import compose_config

GPU = {"simulate": "cores", "generate": "sm", "train": "sm"}
CORES = list(range(16))
# What iteration 2 of a calibrating run measures on the node (every stage on every core, the whole GPU): 400 env
# steps/s; the simulators used half of the 16 cores (20 ms of CPU per env step: 50 env steps/s per core); generation
# was busy 20% of the wall time (2000 env steps/s on the whole GPU), training 50% (800)
STEPS_PER_S, SIM_CPU_S = 400.0, 0.02
WHOLE_GPU = {"generate": 2000.0, "train": 800.0}


def figures(steps_per_s: float, sm: dict[str, float]) -> Measured:
    """What an iteration measures where each stage costs what it did at calibration, with SM shares `sm`."""
    return Measured(
        steps_per_s,
        {"simulate": SIM_CPU_S * steps_per_s / len(CORES), "generate": 0.05, "train": 0.05},
        {s: steps_per_s / (WHOLE_GPU[s] * sm[s]) for s in WHOLE_GPU},
    )


def test_the_planner_keeps_a_core_each_for_the_supervisor_generate_and_train():
    # simulate (50 env steps/s per core) is the bottleneck: it gets every core the node can spare
    profile = linear_profile(
        {"simulate": SIM_CPU_S, "generate": 1 / 2000, "train": 1 / 800},
        [4],
        GPU,
        {},
        {"simulate": 16, "generate": 1.0, "train": 1.0},
    )
    best = plan(profile, Totals(cores=16, gpus=1), num_envs=8)
    assert best.x["simulate"] == 16 - 1 - 2 and best.rates["simulate"] == pytest.approx(650.0)
    assert plan(profile, Totals(cores=16, gpus=1, gpu_stage_cores=2), num_envs=8).x["simulate"] == 16 - 1 - 4


def test_generate_and_train_lease_cores_of_their_own_next_to_the_simulators():
    sets = cpu_sets({"simulate": 13, "generate": 0.3, "train": 0.6}, CORES, gpu=True)
    assert sets["simulate"] == list(range(13))
    assert sets["generate"] == [13, 14] and sets["train"] == [15]  # generate's core and the supervisor's
    assert not set(sets["generate"]) & set(sets["train"])
    # a plan that leaves fewer: each still has its own; with one core left they share it
    assert cpu_sets({"simulate": 14, "generate": 0.3, "train": 0.6}, CORES, gpu=True)["generate"] == [14]
    assert cpu_sets({"simulate": 15, "generate": 0.3, "train": 0.6}, CORES, gpu=True) == {
        "simulate": list(range(15)),
        "generate": [15],
        "train": [15],
    }


def test_a_gpu_calibration_predicts_the_rates_it_measured_and_does_not_replan_without_a_change(tmp_path):
    cfg = compose_config(
        "scheduler=ebrl", "hw=h200x1", "allocator=elastic", "env.num_envs=8", f"allocator.profiles_dir={tmp_path}"
    )
    allocator = Allocator(cfg, CORES)
    assert allocator.profile is None and allocator.totals.gpu_stage_cores == 1
    calibration = figures(STEPS_PER_S, {"generate": 1.0, "train": 1.0})
    for _ in range(CALIBRATE_AT):
        line, metrics = allocator.observe(dataclasses.replace(calibration, foreign=1.0))
    assert line.startswith("allocator: calibrated from iteration 2")
    assert "; other processes kept 1.0 of the 16 cores busy (measured beside them" in line
    measured = {s: metrics[f"alloc/rate_{s}"] for s in STAGES}
    assert measured == pytest.approx({"simulate": 50.0 * 16, **WHOLE_GPU})
    batch = allocator.current.batch
    at_calibration = {"simulate": 16.0, "generate": 1.0, "train": 1.0}  # every core, the whole GPU
    assert {s: allocator.profile.rate(s, x, batch) for s, x in at_calibration.items()} == pytest.approx(measured)

    now = allocator.current
    assert now.x["simulate"] <= 13 and now.x["generate"] + now.x["train"] <= 1 + 1e-9
    leases = allocator.leases
    assert leases["simulate"] == list(range(int(now.x["simulate"])))
    assert (
        leases["train"] == [15]
        and 15 not in leases["generate"]
        and not set(leases["generate"]) & set(leases["simulate"])
    )
    # the stages go on costing what they did: every observation measures what the plan predicted, nothing moves
    for _ in range(6):
        line, metrics = allocator.observe(figures(now.throughput, now.x))
        assert line is None
        assert {s: metrics[f"alloc/rate_{s}"] for s in STAGES} == pytest.approx(now.rates)
    assert allocator.decisions == [] and allocator.current == now


def test_a_gpu_rank_with_few_cores_lets_generate_and_train_share_them():
    cfg = compose_config("hw=h200x1")
    assert totals_of(cfg, 4).gpu_stage_cores == 1 and totals_of(cfg, 4).max_sim_cores == 1
    assert totals_of(cfg, 3).gpu_stage_cores == 0 and totals_of(cfg, 3).max_sim_cores == 2


def test_sm_shares_follow_the_stages_kernel_time(tmp_path):
    # generation issues small kernels: a fifth of its time on the whole GPU fills the SMs, the host the rest, which a
    # smaller share does not stretch; sized by kernel time it gets less of the GPU than its time alone would give it
    def calibrated(kernel: dict[str, float] | None) -> tuple[Allocator, str]:
        cfg = compose_config("scheduler=ebrl", "hw=h200x1", "env.num_envs=8", f"allocator.profiles_dir={tmp_path}")
        allocator = Allocator(cfg, CORES)
        if kernel is not None:
            allocator.size_by_kernels(kernel, "the test's")
        for _ in range(CALIBRATE_AT):
            line, _ = allocator.observe(figures(STEPS_PER_S, {"generate": 1.0, "train": 1.0}))
        return allocator, line

    plain, _ = calibrated(None)
    sized, line = calibrated({"generate": 0.2, "train": 1.0})
    assert sized.current.x["generate"] < plain.current.x["generate"]
    assert sized.current.throughput > plain.current.throughput
    assert "SM shares by kernel time: generate's kernels 0.10 of its 0.50 GPU ms per env step" in line
    # the profile: the kernels' part stretches as 1 / share, the host's stays
    batch = sized.current.batch
    assert sized.profile.rate("generate", 0.25, batch) == pytest.approx(1 / (0.5e-3 * (0.8 + 0.2 * 4)))
