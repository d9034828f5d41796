"""The planner's split against optima worked out by hand and by brute force, and the controllers' hysteresis."""
from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np
import pytest

from ebrl.alloc.planner import ElasticController, Plan, PlanError, StaticController, Totals, plan
from ebrl.alloc.profile import STAGES, Point, StageProfile, linear_profile

CPU = {"simulate": "cores", "generate": "core_share", "train": "core_share"}
GPU = {"simulate": "cores", "generate": "sm", "train": "sm"}
COSTS = {"simulate": 0.010, "generate": 0.002, "train": 0.003}  # seconds per env step on one unit


def cpu_profile(batches: tuple[int, ...] = (8,)) -> StageProfile:
    return linear_profile(COSTS, batches, CPU, {"hw": "cpu8"}, {"simulate": 8, "generate": 8.0, "train": 8.0})


def test_cpu_split_matches_the_optimum_worked_out_by_hand():
    # Rates per unit: simulate 100, generate 500, train 333.3 env steps/s. With s sim cores the pipeline runs at
    # most 100 s; s = 5 needs generate >= 1.0 and train >= 1.5 for 500 (7.5 of 8 cores); s = 6 leaves 2 cores
    # and the best of those splits is min(500 * 0.75, 333.3 * 1.25) = 375 < 500. The spare 0.5 core goes to the
    # split with the best second-slowest stage: generate 1.25 (625), train 1.75 (583.3).
    best = plan(cpu_profile(), Totals(cores=8), num_envs=8)
    assert best.x == {"simulate": 5, "generate": 1.25, "train": 1.75} and best.batch == 8
    assert best.throughput == pytest.approx(500.0) and best.bottleneck == "simulate"
    assert best.rates["generate"] == pytest.approx(625.0) and best.rates["train"] == pytest.approx(1750 / 3)


def test_two_cores_time_slice_between_all_stages():
    # simulate 1.25 cores (125 env steps/s) leaves 0.75: generate 0.25 (125) and train 0.5 (166.7); simulate 1.5
    # would leave train 0.25 (83.3)
    best = plan(cpu_profile(), Totals(cores=2), num_envs=8)
    assert best.x == {"simulate": 1.25, "generate": 0.25, "train": 0.5}
    assert best.throughput == pytest.approx(125.0)


def test_gpu_split_gives_sm_shares_of_one_gpu_in_granules():
    granule = 8 / 132  # green contexts on Hopper
    profile = linear_profile({"simulate": 0.010, "generate": 0.0005, "train": 0.001}, [8], GPU, {},
                             {"simulate": 4, "generate": 1.0, "train": 1.0})
    best = plan(profile, Totals(cores=4, gpus=1, sm_granule=granule), num_envs=8)
    assert best.x["simulate"] == 3  # one core stays with the supervisor
    assert best.x["generate"] + best.x["train"] <= 1 + 1e-9
    for stage in ("generate", "train"):
        units = best.x[stage] / granule
        assert units >= 1 - 1e-9 and abs(units - round(units)) < 1e-9
    # 300 env steps/s needs generate >= 0.15 (3 granules) and train >= 0.3 (5 granules): 8 of 16 granules
    assert best.throughput == pytest.approx(300.0) and best.bottleneck == "simulate"


def test_fixed_amounts_are_honoured():
    pinned = plan(cpu_profile(), Totals(cores=8), num_envs=8, fixed={"simulate": 3, "generate": 0.5})
    assert pinned.x["simulate"] == 3 and pinned.x["generate"] == 0.5
    assert pinned.throughput == pytest.approx(250.0)  # generate 0.5 share: 250 env steps/s
    with pytest.raises(PlanError, match="leaves no room"):
        plan(cpu_profile(), Totals(cores=8), num_envs=8, fixed={"simulate": 8})
    gpu_profile = StageProfile(cpu_profile().points, resource=GPU)
    with pytest.raises(PlanError, match="whole cores in 1..3"):
        plan(gpu_profile, Totals(cores=4, gpus=1), num_envs=8, fixed={"simulate": 4})
    with pytest.raises(PlanError, match="unknown stage\\(s\\) learn"):
        plan(cpu_profile(), Totals(cores=8), num_envs=8, fixed={"learn": 1})


def test_batch_divides_num_envs():
    # generate gets faster with its batch; 16 would be fastest but does not divide 24 envs
    points = [Point("simulate", 1, 8, 1000.0), Point("train", 1.0, 8, 1000.0)]
    points += [Point("generate", 1.0, b, 10.0 * b) for b in (4, 8, 16)]
    profile = StageProfile(points, resource=CPU)
    assert plan(profile, Totals(cores=4), num_envs=24).batch == 8
    assert plan(profile, Totals(cores=4), num_envs=24, batches=[4, 5, 16]).batch == 4
    with pytest.raises(PlanError, match="no generation batch in \\[4, 8, 16\\] divides num_envs=6"):
        plan(profile, Totals(cores=4), num_envs=6)


def test_equal_rates_at_every_batch_pick_the_smaller_batch():
    assert plan(cpu_profile(batches=(2, 4, 8)), Totals(cores=8), num_envs=8).batch == 2


@pytest.mark.parametrize("totals, needed", [
    (Totals(cores=1), "a CPU-only node needs 1.5 cores"),
    (Totals(cores=0), "needs 1.5 cores"),
    (Totals(cores=1, gpus=1), "a GPU node needs 2 cores"),
])
def test_too_small_a_node_says_what_is_needed(totals, needed):
    with pytest.raises(PlanError, match=needed):
        plan(cpu_profile(), totals, num_envs=8)


def test_a_profile_from_other_hardware_is_refused():
    with pytest.raises(PlanError, match="profile.resource\\['generate'\\]='core_share', but on a GPU node"):
        plan(cpu_profile(), Totals(cores=8, gpus=1), num_envs=8)
    with pytest.raises(PlanError, match="on a CPU-only node generate takes 'core_share' or 'cores'"):
        plan(StageProfile(cpu_profile().points, resource=GPU), Totals(cores=8), num_envs=8)


def brute_force(profile: StageProfile, totals: Totals, num_envs: int) -> float:
    """The best least rate over every grid point, by enumeration."""
    gpu = totals.gpus > 0
    granule = totals.sm_granule if gpu else totals.core_granule
    shares = [k * granule for k in range(1, int(round((1 if gpu else totals.cores) / granule)) + 1)]
    sims = range(1, totals.cores) if gpu else np.arange(1, totals.cores + 1e-9, totals.core_granule)
    best = 0.0
    for batch in (b for b in profile.batches("generate") if num_envs % b == 0):
        for s, g, t in itertools.product(sims, shares, shares):
            if (g + t if gpu else s + g + t) <= (1 if gpu else totals.cores) + 1e-9:
                rates = [profile.rate("simulate", s, batch), profile.rate("generate", g, batch),
                         profile.rate("train", t, batch)]
                best = max(best, min(rates))
    return best


@pytest.mark.parametrize("seed", range(24))
def test_plan_is_the_best_split_on_random_profiles(seed):
    rng = np.random.default_rng(seed)
    gpu = seed % 2 == 1
    totals = Totals(cores=int(rng.integers(2, 6)), gpus=int(gpu), sm_granule=0.125, core_granule=0.5)
    points = []
    for stage, grid in (("simulate", [1, 2, 3]), ("generate", [0.25, 0.5, 1.0]), ("train", [0.25, 0.5, 1.0])):
        for batch in (2, 3, 4):  # rates need not grow with x or batch, and batches need not share xs
            xs = rng.choice(grid, size=int(rng.integers(1, 4)), replace=False)
            points += [Point(stage, float(x), batch, float(rng.uniform(10, 1000))) for x in xs]
    profile = StageProfile(points, resource=GPU if gpu else CPU)
    best = plan(profile, totals, num_envs=8)
    assert best.batch in (2, 4)
    assert best.throughput == min(best.rates.values())
    assert all(best.rates[s] == profile.rate(s, best.x[s], best.batch) for s in STAGES)
    assert best.x["simulate"] >= 1 and (best.x["simulate"] == int(best.x["simulate"]) if gpu else
                                        (best.x["simulate"] / totals.core_granule).is_integer())
    shares = best.x["generate"] + best.x["train"]
    assert (shares <= 1 + 1e-9 and best.x["simulate"] <= totals.cores - 1) if gpu else \
        best.x["simulate"] + shares <= totals.cores + 1e-9
    assert best.throughput == pytest.approx(brute_force(profile, totals, num_envs=8), rel=1e-12)


def drive(controller: ElasticController | StaticController, profile: StageProfile, truth: Callable[[int], float],
          steps: int) -> list[Plan]:
    """Feed `steps` observations where simulate really runs at truth(step) times the profile's prediction."""
    plans = []
    for step in range(1, steps + 1):
        now = controller.current
        measured = {s: profile.rate(s, now.x[s], now.batch) for s in STAGES}
        measured["simulate"] *= truth(step)
        controller.observe(measured, busy={"simulate": 1.0, "generate": 0.4, "train": 0.5})
        plans.append(controller.current)
    return plans


def test_a_single_blip_does_not_replan():
    profile = cpu_profile()
    for blip in (1 / 3, 1 / 100):
        controller = ElasticController(profile, Totals(cores=8), num_envs=8)
        drive(controller, profile, lambda step: blip if step == 5 else 1.0, steps=20)
        assert controller.decisions == []


def test_a_sustained_shift_replans_once_after_window_observations():
    profile = cpu_profile()
    for window in (3, 5):
        controller = ElasticController(profile, Totals(cores=8), num_envs=8, window=window)
        first = controller.current
        assert first == plan(profile, Totals(cores=8), num_envs=8)
        drive(controller, profile, lambda step: 1 / 3 if step >= 5 else 1.0, steps=20)
        assert len(controller.decisions) == 1
        decision = controller.decisions[0]
        assert decision.step == 4 + window
        assert decision.old.x == first.x and decision.new == controller.current
        assert decision.new.x["simulate"] > first.x["simulate"]
        assert decision.gain > 0.10 and decision.new.throughput > decision.old.throughput
        assert decision.reason.startswith("simulate is the bottleneck (")
        assert f"for {window} observations; sim cores 5 -> 6" in decision.reason
        assert "busy simulate 100%" in decision.reason and "\n" not in decision.reason


def test_cooldown_ignores_the_observations_after_a_switch():
    # No smoothing (ema=1): simulate at a third from step 5 switches at step 7; back to normal from step 8, the
    # way back needs `window` votes once `cooldown` observations have passed.
    profile = cpu_profile()
    for cooldown, steps in ((2, [7, 12]), (0, [7, 10]), (4, [7, 14])):
        controller = ElasticController(profile, Totals(cores=8), num_envs=8, cooldown=cooldown, ema=1.0)
        drive(controller, profile, lambda step: 1 / 3 if 5 <= step <= 7 else 1.0, steps=20)
        assert [d.step for d in controller.decisions] == steps
        assert controller.current.x == plan(profile, Totals(cores=8), num_envs=8).x


def test_small_drift_below_min_gain_does_not_replan():
    profile = cpu_profile()
    controller = ElasticController(profile, Totals(cores=8), num_envs=8)
    drive(controller, profile, lambda step: 0.95, steps=20)  # a 5% slower simulator: no split gains 10%
    assert controller.decisions == []
    assert controller.factors["simulate"] == pytest.approx(0.95)


def test_static_controller_never_replans():
    profile = cpu_profile()
    controller = StaticController(profile, Totals(cores=8), num_envs=8)
    plans = drive(controller, profile, lambda step: 1 / 3 if step >= 5 else 1.0, steps=20)
    assert controller.decisions == [] and all(p == plans[0] for p in plans)
    assert controller.current == plan(profile, Totals(cores=8), num_envs=8)


def test_observe_rejects_unknown_stages_and_bad_rates():
    controller = ElasticController(cpu_profile(), Totals(cores=8), num_envs=8)
    with pytest.raises(ValueError, match="measured\\['learn'\\]: unknown stage"):
        controller.observe({"learn": 1.0})
    with pytest.raises(ValueError, match="measured\\['train'\\]=nan"):
        controller.observe({"train": math.nan})
