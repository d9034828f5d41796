"""The planner's split against optima worked out by hand and by brute force, and the controllers' hysteresis."""

from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np
import pytest

from ebrl.alloc.allocator import describe
from ebrl.alloc.planner import CYCLE, ElasticController, Plan, PlanError, StaticController, Totals, evaluate, plan
from ebrl.alloc.profile import STAGES, Point, StageProfile, linear_profile

CPU = {"simulate": "cores", "generate": "core_share", "train": "core_share"}
GPU = {"simulate": "cores", "generate": "sm", "train": "sm"}
COSTS = {"simulate": 0.010, "generate": 0.002, "train": 0.003}  # seconds per env step on one unit


def cpu_profile(batches: tuple[int, ...] = (8,)) -> StageProfile:
    return linear_profile(COSTS, batches, CPU, {"hw": "cpu8"}, {"simulate": 8, "generate": 8.0, "train": 8.0})


def test_cpu_split_matches_the_optimum_worked_out_by_hand():
    # Rates per unit: simulate 100, generate 500, train 333.3 env steps/s. 8 envs at batch 8 are one group, so the
    # cycle 1 / (1/(100 s) + 1/(500 g)), below both, binds with train. (The split of the slowest stage alone,
    # simulate 5, generate 1.25, train 1.75, would run at a cycle of 277.8: see the two-group test below.)
    # Train 1 core (333.3) leaves s + g = 7, where s 5, g 2 give a cycle of exactly 333.3 and s 4.75, g 2.25 334.0;
    # train 1.25 leaves 6.75, where no cycle reaches 333.3 (at best 322.0, s 4.75, g 2). Of the two at 333.3 the
    # larger second-slowest stage wins: simulate 500 over 475.
    best = plan(cpu_profile(), Totals(cores=8), num_envs=8)
    assert best.x == {"simulate": 5, "generate": 2, "train": 1} and best.batch == 8 and best.groups == 1
    assert best.throughput == pytest.approx(1000 / 3) and best.cycle == pytest.approx(1000 / 3)
    assert best.bottleneck == "train"


def test_two_cores_time_slice_between_all_stages():
    # One group: simulate 1.25 cores (125 env steps/s) and generate 0.5 (250) cycle at 1 / (1/125 + 1/250) = 83.3,
    # as fast as train on the last 0.25 (83.3); simulate 1 and generate 0.75 would cycle at 78.9, simulate 1.25
    # and generate 0.25 at 62.5 (without the cycle: simulate 1.25, generate 0.25, train 0.5 at 125)
    best = plan(cpu_profile(), Totals(cores=2), num_envs=8)
    assert best.x == {"simulate": 1.25, "generate": 0.5, "train": 0.25}
    assert best.throughput == pytest.approx(250 / 3)


def test_gpu_split_gives_sm_shares_of_one_gpu_in_granules():
    granule = 8 / 132  # green contexts on Hopper
    profile = linear_profile(
        {"simulate": 0.010, "generate": 0.0005, "train": 0.001},
        [8],
        GPU,
        {},
        {"simulate": 4, "generate": 1.0, "train": 1.0},
    )
    best = plan(profile, Totals(cores=6, gpus=1, sm_granule=granule), num_envs=8)
    assert best.x["simulate"] == 3  # one core each stays with the supervisor, generate and train
    assert best.x["generate"] + best.x["train"] <= 1 + 1e-9
    for stage in ("generate", "train"):
        units = best.x[stage] / granule
        assert units >= 1 - 1e-9 and abs(units - round(units)) < 1e-9
    # One group: simulate's 300 env steps/s cycles with generate. Train 5 granules (303) leaves generate 11 of the
    # 16 (1333.3): 1 / (1/300 + 1/1333.3) = 12000/49 = 244.9; train 4 granules (242.4) would cap it lower. (Without
    # the cycle: 300, which needs only generate 3 granules and train 5.)
    assert best.x["generate"] == pytest.approx(11 * granule) and best.x["train"] == pytest.approx(5 * granule)
    assert best.throughput == pytest.approx(12000 / 49) and best.limited_by == CYCLE
    assert best.bottleneck == "simulate"


def test_fixed_amounts_are_honoured():
    pinned = plan(cpu_profile(), Totals(cores=8), num_envs=8, fixed={"simulate": 3, "generate": 0.5})
    assert pinned.x["simulate"] == 3 and pinned.x["generate"] == 0.5
    # simulate 300 and generate 250 env steps/s cycle in one group at 1 / (1/300 + 1/250) = 136.4 (without: 250)
    assert pinned.throughput == pytest.approx(1500 / 11) and pinned.limited_by == CYCLE
    with pytest.raises(PlanError, match="leaves no room"):
        plan(cpu_profile(), Totals(cores=8), num_envs=8, fixed={"simulate": 8})
    gpu_profile = StageProfile(cpu_profile().points, resource=GPU)
    with pytest.raises(PlanError, match="whole cores in 1..3"):
        plan(gpu_profile, Totals(cores=6, gpus=1), num_envs=8, fixed={"simulate": 4})
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


@pytest.mark.parametrize(
    "totals, needed",
    [
        (Totals(cores=1), "a CPU-only node needs 1.5 cores"),
        (Totals(cores=0), "needs 1.5 cores"),
        (
            Totals(cores=3, gpus=1),
            "a GPU node needs 4 cores \\(1 to simulate, 1 for the supervisor, 1 each for generate",
        ),
        (Totals(cores=1, gpus=1, gpu_stage_cores=0), "a GPU node needs 2 cores"),
    ],
)
def test_too_small_a_node_says_what_is_needed(totals, needed):
    with pytest.raises(PlanError, match=needed):
        plan(cpu_profile(), totals, num_envs=8)


def test_a_profile_from_other_hardware_is_refused():
    with pytest.raises(PlanError, match="profile.resource\\['generate'\\]='core_share', but on a GPU node"):
        plan(cpu_profile(), Totals(cores=8, gpus=1), num_envs=8)
    with pytest.raises(PlanError, match="on a CPU-only node generate takes 'core_share' or 'cores'"):
        plan(StageProfile(cpu_profile().points, resource=GPU), Totals(cores=8), num_envs=8)


def test_one_group_loses_to_two_when_its_faster_generation_does_not_pay_for_the_lost_overlap():
    # Every amount pinned, so only the batch is chosen. At batch 8 (1 group of the 8 envs) generate runs 600 env
    # steps/s, 20% faster than 500 at batch 4 (2 groups); simulate 200 and train 1000 at both. The least stage
    # rate is 200 at both, and the old tie-break (larger second-slowest stage: 600) picked batch 8. But one group
    # serialises simulate and generate: 1 / (1/200 + 1/600) = 150, while two allow 2 / (1/200 + 1/500) = 285.7,
    # above simulate's 200. So batch 4: 200 env steps/s against 150.
    points = [
        Point("simulate", 2.0, 4, 200.0),
        Point("train", 1.0, 4, 1000.0),
        Point("generate", 1.0, 4, 500.0),
        Point("generate", 1.0, 8, 600.0),
    ]
    profile = StageProfile(points, resource=CPU)
    fixed = {"simulate": 2, "generate": 1, "train": 1}
    best = plan(profile, Totals(cores=4), num_envs=8, fixed=fixed)
    assert best.batch == 4 and best.groups == 2
    assert best.throughput == pytest.approx(200.0) and best.limited_by == "simulate"
    assert best.cycle == pytest.approx(2000 / 7)
    lockstep = evaluate(profile, fixed, batch=8, groups=1)
    assert lockstep.rates["generate"] == pytest.approx(1.2 * best.rates["generate"])
    assert lockstep.throughput == pytest.approx(150.0) and lockstep.limited_by == CYCLE


def test_from_two_groups_on_the_cycle_never_binds_and_the_slowest_stage_decides():
    # 16 envs at batch 8 are 2 groups: 2 / (1/s + 1/g) is at least min(s, g), so the split is the slowest stage's.
    # Rates per unit: simulate 100, generate 500, train 333.3 env steps/s. With s sim cores the pipeline runs at
    # most 100 s; s = 5 needs generate >= 1.0 and train >= 1.5 for 500 (7.5 of 8 cores); s = 6 leaves 2 cores
    # and the best of those splits is min(500 * 0.75, 333.3 * 1.25) = 375 < 500. The spare 0.5 core goes to the
    # split with the best second-slowest stage: generate 1.25 (625), train 1.75 (583.3).
    best = plan(cpu_profile(), Totals(cores=8), num_envs=16)
    assert best.x == {"simulate": 5, "generate": 1.25, "train": 1.75} and best.batch == 8 and best.groups == 2
    assert best.throughput == pytest.approx(500.0) and best.bottleneck == best.limited_by == "simulate"
    assert best.rates["generate"] == pytest.approx(625.0) and best.rates["train"] == pytest.approx(1750 / 3)
    assert best.cycle == pytest.approx(2 / (1 / 500 + 1 / 625))  # 555.6
    # simulate 1.25 cores (125 env steps/s) leaves 0.75: generate 0.25 (125) and train 0.5 (166.7); simulate 1.5
    # would leave train 0.25 (83.3). The cycle, 2 / (1/125 + 1/125) = 125, ties simulate and generate.
    two_cores = plan(cpu_profile(), Totals(cores=2), num_envs=16)
    assert two_cores.x == {"simulate": 1.25, "generate": 0.25, "train": 0.5}
    assert two_cores.throughput == pytest.approx(125.0) and two_cores.limited_by == "simulate"


def test_the_cycle_and_what_limits_a_plan():
    x = {"simulate": 2.0, "generate": 0.5, "train": 0.5}
    rates = {"simulate": 200.0, "generate": 900.0, "train": 1000.0}
    one = Plan(x, batch=8, groups=1, rates=rates)
    assert one.cycle == pytest.approx(1800 / 11)  # 1 / (1/200 + 1/900) = 163.6, below simulate's 200
    assert one.throughput == pytest.approx(1800 / 11)
    assert one.limited_by == CYCLE == "the group cycle" and one.bottleneck == "simulate"
    assert describe(one).endswith(
        "generation batch 8 (predicted 163.6 env steps/s, limited by the group cycle: 1 group)"
    )
    two = Plan(x, batch=4, groups=2, rates=rates)
    assert two.cycle == pytest.approx(3600 / 11) and two.throughput == 200.0  # 327.3: simulate binds
    assert two.limited_by == "simulate" and describe(two).endswith(
        "(predicted 200.0 env steps/s, simulate the bottleneck)"
    )
    # a stage with nothing to do (inf) does not slow the cycle; an unknown rate (nan) leaves everything unknown
    idle = Plan(x, batch=8, groups=1, rates={**rates, "generate": math.inf})
    assert idle.cycle == 200.0 and idle.throughput == 200.0 and idle.limited_by == "simulate"
    assert Plan(x, 8, 1, {**rates, "simulate": math.inf, "generate": math.inf}).cycle == math.inf
    unknown = Plan(x, batch=8, groups=1, rates={s: math.nan for s in STAGES})
    assert math.isnan(unknown.cycle) and math.isnan(unknown.throughput) and unknown.limited_by == "simulate"
    assert math.isnan(Plan(x, 8, 1, {**rates, "train": math.nan}).throughput)


def brute_force(profile: StageProfile, totals: Totals, num_envs: int) -> float:
    """The best throughput over every grid point, by enumeration: the least stage rate, or the group cycle's."""
    gpu = totals.gpus > 0
    granule = totals.sm_granule if gpu else totals.core_granule
    shares = [k * granule for k in range(1, int(round((1 if gpu else totals.cores) / granule)) + 1)]
    sims = range(1, totals.max_sim_cores + 1) if gpu else np.arange(1, totals.cores + 1e-9, totals.core_granule)
    best = 0.0
    for batch in (b for b in profile.batches("generate") if num_envs % b == 0):
        for s, g, t in itertools.product(sims, shares, shares):
            if (g + t if gpu else s + g + t) <= (1 if gpu else totals.cores) + 1e-9:
                rates = [
                    profile.rate("simulate", s, batch),
                    profile.rate("generate", g, batch),
                    profile.rate("train", t, batch),
                ]
                cycle = (num_envs // batch) / (1 / rates[0] + 1 / rates[1])
                best = max(best, min(*rates, cycle))
    return best


@pytest.mark.parametrize("seed", range(24))
def test_plan_is_the_best_split_on_random_profiles(seed):
    rng = np.random.default_rng(seed)
    gpu = seed % 2 == 1
    # (a GPU node keeps 3 cores from simulate: the supervisor's, generate's and train's)
    totals = Totals(cores=int(rng.integers(2, 6)) + 2 * gpu, gpus=int(gpu), sm_granule=0.125, core_granule=0.5)
    points = []
    for stage, grid in (("simulate", [1, 2, 3]), ("generate", [0.25, 0.5, 1.0]), ("train", [0.25, 0.5, 1.0])):
        for batch in (2, 3, 4, 8):  # rates need not grow with x or batch, and batches need not share xs
            xs = rng.choice(grid, size=int(rng.integers(1, 4)), replace=False)
            points += [Point(stage, float(x), batch, float(rng.uniform(10, 1000))) for x in xs]
    profile = StageProfile(points, resource=GPU if gpu else CPU)
    best = plan(profile, totals, num_envs=8)
    assert best.batch in (2, 4, 8) and best.groups == 8 // best.batch  # batch 8: one group, where the cycle binds
    assert best.throughput == min(*best.rates.values(), best.cycle)
    assert all(best.rates[s] == profile.rate(s, best.x[s], best.batch) for s in STAGES)
    assert best.x["simulate"] >= 1 and (
        best.x["simulate"] == int(best.x["simulate"])
        if gpu
        else (best.x["simulate"] / totals.core_granule).is_integer()
    )
    shares = best.x["generate"] + best.x["train"]
    assert (
        (shares <= 1 + 1e-9 and best.x["simulate"] <= totals.max_sim_cores)
        if gpu
        else best.x["simulate"] + shares <= totals.cores + 1e-9
    )
    assert best.throughput == pytest.approx(brute_force(profile, totals, num_envs=8), rel=1e-12)


def drive(
    controller: ElasticController | StaticController, profile: StageProfile, truth: Callable[[int], float], steps: int
) -> list[Plan]:
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


@pytest.mark.parametrize(
    "num_envs, late, limit",
    [
        (16, 0, "simulate is the bottleneck ("),  # 2 groups: simulate binds
        # 1 group: the cycle binds, and a simulator at a third of its rate slows it less (333 -> 143 env steps/s), so
        # the EMA's first steps predict less than 10% to gain: the votes start 4 observations later
        (8, 4, "the group cycle (simulate 1"),
    ],
)
def test_a_sustained_shift_replans_once_after_window_observations(num_envs, late, limit):
    profile = cpu_profile()
    for window in (3, 5):
        controller = ElasticController(profile, Totals(cores=8), num_envs=num_envs, window=window)
        first = controller.current
        assert first == plan(profile, Totals(cores=8), num_envs=num_envs)
        drive(controller, profile, lambda step: 1 / 3 if step >= 5 else 1.0, steps=20)
        assert len(controller.decisions) == 1
        decision = controller.decisions[0]
        assert decision.step == 4 + window + late
        assert decision.old.x == first.x and decision.new == controller.current
        assert decision.new.x["simulate"] > first.x["simulate"]
        assert decision.gain > 0.10 and decision.new.throughput > decision.old.throughput
        assert decision.reason.startswith(limit)
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
