"""The runtime in virtual time: the CPU model's shares, and the real Scheduler driven through every schedule on
costs whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from ebrl.bench.at_scale import predict
from ebrl.bench.schedulers import compose_overrides
from ebrl.forecast.virtual import Cpu, Task, World, weight


def rates(cpu: Cpu, *tasks: Task) -> list[float]:
    for t in tasks:
        cpu.add(t)
    cpu.allot()
    return [cpu.rate(t) for t in tasks]


def test_cores_divide_by_weight_pinned_threads_first_and_free_ones_even_out():
    one = lambda name, cores, nice=0: Task(name, 1.0, 1, cores, nice)  # noqa: E731
    assert rates(Cpu(1), one("a", (0,)), one("b", (0,))) == [0.5, 0.5]
    niced = rates(Cpu(1), one("a", (0,)), one("b", (0,), nice=5))
    assert niced == pytest.approx([1024 / (1024 + weight(5)), weight(5) / (1024 + weight(5))])
    # three free threads on two cores: each 2/3 of a core over time; a pinned one keeps its core
    assert rates(Cpu(2), *(one(n, (0, 1)) for n in "abc")) == pytest.approx([2 / 3] * 3)
    assert rates(Cpu(2), one("pinned", (0,)), one("free", (0, 1))) == [1.0, 1.0]
    # sharing a core costs the measured time-slicing overhead; a core of one's own does not
    assert rates(Cpu(2, timeslice=0.1), one("a", (0,)), one("b", (0,)), one("c", (1,))) == pytest.approx(
        [0.5 / 1.1, 0.5 / 1.1, 1.0]
    )


def test_a_multithreaded_task_moves_at_its_slowest_threads_pace():
    train = Task("train", 1.0, 2, (0, 1), efficiency=0.8)
    sim = Task("simulate/env0", 1.0, 1, (0,))
    assert rates(Cpu(2), train, sim) == pytest.approx([2 * 0.5 * 0.8, 0.5])  # (its thread on core 1 waits)


def one_by_one(cores: int, tasks: list[Task], timeslice: float) -> list[float]:
    """The rates placing every thread by itself onto the least-loaded allowed core (pinned tasks first, then in
    start order), free one-thread tasks of the same cores and nice at their mean share: what cohorts must give."""
    load, placed = [0.0] * cores, []
    for task in sorted(tasks, key=lambda t: len(t.cores)):
        for _ in range(task.threads):
            core = min(task.cores, key=lambda c: (load[c], c))
            load[core] += weight(task.nice)
            placed.append((task, core))
    on = [sum(1 for _, c in placed if c == core) for core in range(cores)]
    share = {id(t): [] for t in tasks}
    for task, core in placed:
        share[id(task)].append(weight(task.nice) / load[core] / (1 + timeslice if on[core] > 1 else 1))
    free = lambda t: t.threads == 1 and len(t.cores) > 1  # noqa: E731
    rates = []
    for task in tasks:
        if free(task):
            alike = [share[id(t)][0] for t in tasks if free(t) and (t.cores, t.nice) == (task.cores, task.nice)]
            rates.append(sum(alike) / len(alike) * task.efficiency)
        else:
            rates.append(task.threads * min(share[id(task)]) * task.efficiency)
    return rates


def test_cohorts_give_the_rates_of_placing_every_thread_by_itself():
    """Random mixes of pinned, free and multi-threaded tasks at two nice values, with cohorts of every size (a
    cohort is placed at its first member's place, so tasks of one length of allowed cores start cohort by cohort)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        cores = int(rng.integers(1, 9))
        tasks = [
            Task(f"simulate/pinned{i}", 1.0, 1, (int(rng.integers(cores)),), int(rng.choice([0, 10])))
            for i in range(int(rng.integers(0, 2 * cores)))
        ]
        if cores > 1:
            tasks.append(Task("train", 1.0, int(rng.integers(1, cores + 1)), tuple(range(cores)), 0, 0.7))
            span = tuple(range(1, cores)) if cores > 2 else tuple(range(cores))
            tasks += [Task(f"simulate/env{i}", 1.0, 1, tuple(range(cores)), 10) for i in range(int(rng.integers(60)))]
            tasks += [Task(f"generate/{i}", 1.0, 1, span, 0, 0.9) for i in range(int(rng.integers(3)))]
        timeslice = float(rng.choice([0.0, 0.1]))
        assert rates(Cpu(cores, timeslice), *tasks) == pytest.approx(one_by_one(cores, tasks, timeslice), rel=1e-12)


def test_a_cohorts_members_end_at_their_own_work_and_move_only_through_the_world():
    """Three free tasks of 1, 2 and 3 s on two cores: 2/3 of a core each until 1.5 s, then a core each."""
    world, ends = World(2), {}
    tasks = [Task(f"simulate/env{i}", float(i + 1), 1, (0, 1)) for i in range(3)]
    for task in tasks:
        task.done = lambda task=task: ends.setdefault(task.name, world.now)
    world.start(*tasks)
    while world.step():
        if len(ends) == 1:  # (the last one moves onto core 1 alone: pinned, it keeps the rate of a core)
            world.change(tasks[2], cores=(1,))
            world.cpu.allot()
    assert ends == pytest.approx({"simulate/env0": 1.5, "simulate/env1": 2.5, "simulate/env2": 3.5})
    assert world.cpu.spent["simulate"] == pytest.approx(6.0) and not world.cpu.cohorts
    moved = World(2)
    moved.start(*(Task(f"simulate/env{i}", 1.0, 1, (0, 1)) for i in range(2)))
    next(iter(moved.cpu.tasks.values())).cores = (1,)  # (behind the CPU's back)
    with pytest.raises(RuntimeError, match="World.change"):
        moved.step()


class Flat:
    """Every step `step` s, a sample `gen` s, a value `val` s, training `row` s per decision (one thread); episodes
    longer than the run."""

    action_dim, max_episode_steps, execute, chunk_len, timeslice = 7, 10**9, 4, 4, 0.0

    def __init__(self, step=1e-3, gen=2e-3, val=1e-3, row=1e-4):
        self.step, self.gen, self.val, self.row = step, gen, val, row

    def sim_steps(self, env, n, rng):
        return np.full(n, self.step)

    def episode_length(self, env, rng):
        return self.max_episode_steps

    def generate(self, batch):
        return self.gen

    def value(self, batch):
        return self.val

    def train(self, rows, proximal=0):
        return self.row * rows

    def efficiency(self, stage, threads):
        return 1.0

    def reset(self):
        return 0.0


def config(mode: str, envs: int = 4, chunks: int = 3):
    return compose_overrides(
        [
            f"env.num_envs={envs}",
            f"algo.rollout_chunks={chunks}",
            "algo.minibatches=1",
            "logger=none",
            "progress=false",
            "iterations=4",
        ],
        mode,
    )


def test_colocated_in_virtual_time_gives_the_known_answer():
    """Colocated on 2 cores, 4 envs: each chunk step all envs share the cores (N H step / C), then one sample on
    every core (gen / C); each iteration ends with the bootstrap value and the update, both on every core."""
    costs, n, c, chunks, cores = Flat(), 4, 4, 3, 2
    out = predict(config("colocated", n, chunks), costs, iterations=4, cores=cores)
    per_iteration = chunks * (n * c * costs.step + costs.gen) / cores + (costs.val + costs.row * n * chunks) / cores
    assert out["env_steps_per_s"] == pytest.approx(n * chunks * c / per_iteration, rel=1e-9)
    assert out["cpu_share"]["simulate"] + out["cpu_share"]["generate"] + out["cpu_share"]["train"] == pytest.approx(
        1.0
    )  # (work-conserving: while anything runs, both cores do)


class Serial(Flat):
    """Training twice simulation's work and no faster on two threads than on one: colocated trains on both cores
    while the rollout waits, the overlapping schedules train on one beside it (at most 48 env steps per 96 ms)."""

    def efficiency(self, stage, threads):
        return 1.0 / threads


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "hybrid", "async", "ebrl"])
def test_every_schedule_runs_in_virtual_time_and_overlap_hides_training(mode):
    costs = Serial(row=8e-3)
    out = predict(config(mode), costs, iterations=4, cores=2)
    assert len(out["per_iteration"]) == 4 and out["virtual_seconds"] > 0
    colocated = predict(config("colocated"), costs, iterations=4, cores=2)["env_steps_per_s"]
    assert colocated == pytest.approx(48 / (0.024 + 0.006 + 0.001 + 0.096))  # (as the test above, serial stages)
    if mode in ("async", "ebrl"):
        assert 1.2 * colocated < out["env_steps_per_s"] <= 48 / 0.096 + 1e-6


@pytest.mark.parametrize("mode", ["colocated", "ebrl"])
def test_grpo_segments_reset_and_run_in_virtual_time(mode):
    """Episodic segments: each group's envs reset together (the supervisor waits for the last), whole episodes of 16
    steps; every iteration's env steps are the envs' episodes."""
    costs = Flat()
    costs.max_episode_steps = 16
    costs.episode_length = lambda env, rng: 16
    cfg = compose_overrides(
        [
            "env.num_envs=4",
            "algo=grpo",
            "algo.group_size=2",
            "algo.minibatches=1",
            "logger=none",
            "progress=false",
            "iterations=4",
        ],
        mode,
    )
    out = predict(cfg, costs, iterations=4, cores=2)
    assert out["env_steps_per_s"] > 0 and len(out["per_iteration"]) == 4


def test_a_gpu_nodes_stages_run_on_its_gpu_and_no_schedule_beats_the_bounds():
    """hw=h200x1 on modelled costs (ebrl/forecast/gpu_cost.py's roofline of the small policy): colocated's calls take
    the whole GPU, ebrl's the SM shares its calibrated plan leases; neither exceeds what the GPU's kernels or the
    simulators allow."""
    from ebrl.bench.at_scale import gpu_capacity, modelled_costs

    overrides = ["hw=h200x1", "policy.preset=small", "env.num_envs=16", "algo.rollout_chunks=4", "algo.minibatches=1"]
    costs = modelled_costs(compose_overrides(overrides), (6.0, 9.0), 2.0, 1)
    rows = []
    for mode in ("colocated", "ebrl"):
        cfg = compose_overrides(overrides, mode)
        cfg.policy.execute = costs.execute
        out = predict(cfg, costs, 5)
        assert 0 < sum(out["gpu_sm_busy"].values()) <= 1 and 0 <= out["gpu_idle"] < 1
        rows.append({"mode": mode, "simulated": out})
    assert any("calibrated" in line for line in rows[1]["simulated"]["decisions"])
    capacity = gpu_capacity(costs, rows, compose_overrides(overrides))
    for row in rows:
        assert row["simulated"]["env_steps_per_s"] <= 1.01 * min(capacity["gpu_rate"], capacity["sim_rate"])
    # gpu_check's measured costs replace the roofline's: on the whole GPU as measured, at a share as much longer as
    # the roofline says
    at_half = costs.on_gpu("sample", 8, 0.5).seconds / costs.on_gpu("sample", 8, 1.0).seconds
    costs.measured_gpu = {
        "gpu": "H200",
        "policy": "-",
        "sample_s": {"1": 0.01, "8": 0.02, "32": 0.05},
        "train_s_per_row_epoch": 0.003,
    }
    assert costs.on_gpu("sample", 8, 1.0).seconds == pytest.approx(0.02)
    assert costs.on_gpu("sample", 8, 0.5).seconds == pytest.approx(0.02 * at_half)
    assert costs.on_gpu("sample", 64, 1.0).seconds == pytest.approx(0.05 + 0.03 / 24 * 32)  # (the last slope)
    assert costs.on_gpu("train", 40, 1.0).seconds == pytest.approx(0.003 * 40 * int(costs.shape.algo.epochs))
