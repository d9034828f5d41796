"""The pipelined schedules (ebrl, async, hybrid, disaggregated) on real simulator processes and a real
trainer process: behaviour read from the run's trace and metrics, never from timings."""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict

import pytest
import torch

from ebrl.alloc.allocator import held_cores
from ebrl.bench.load import foreign_load
from ebrl.checks import _check_schedule, validate
from ebrl.config import ConfigError
from ebrl.rl.rollout import RolloutBatch, concat_envs, drop_stale
from ebrl.runs.experiment import Experiment
from ebrl.runtime.dispatcher import CorePool
from ebrl.runtime.schedule import Schedule
from ebrl.telemetry.trace import read_spans
from tests.conftest import compose_config

WORKLOAD = [
    "env.num_envs=4",
    "algo.rollout_chunks=2",
    "algo.minibatches=2",
    "algo.epochs=1",
    "iterations=3",
    "env.max_episode_steps=24",
    "progress=false",
    "logger=none",
    "checkpoint_every=1000",
    "init=null",
]  # from the family's initialisation: every env runs its chunks to the end


def run(tmp_path, *overrides: str) -> tuple[Experiment, list[dict]]:
    """A short real run; the finished Experiment (its scheduler keeps the trace) and its logged metrics."""
    exp = Experiment.from_config(compose_config(*WORKLOAD, *overrides), run_dir=tmp_path / "run")
    exp.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return exp, metrics


# --- the parts ---------------------------------------------------------------------------------
def test_a_freed_core_goes_to_the_ready_env_with_the_longest_step_estimate():
    pool = CorePool([0, 1])
    for env, step_s in [(0, 0.010), (1, 0.030), (2, 0.020), (3, 0.050)]:
        pool.observe(env, step_s)
    for env in (0, 1, 2, 3):
        pool.push(env)
    assert pool.dispatch() == [(3, 0), (1, 1)]  # two cores: the two slowest
    assert pool.dispatch() == []  # no core free
    assert pool.release(1) == 1
    assert pool.dispatch() == [(2, 1)]  # the freed core: the slowest of the rest
    pool.push(4)  # never measured: goes first, so that it gets an estimate
    pool.release(3)
    assert pool.dispatch() == [(4, 0)]
    assert all(chosen >= other for _, _, chosen, other in pool.decisions)


def test_by_readiness_a_freed_core_goes_to_the_group_closest_to_its_chunk_boundary_first():
    pool = CorePool([0, 1], order="readiness")
    for env, step_s in [(0, 0.010), (1, 0.030), (2, 0.050), (3, 0.040)]:
        pool.observe(env, step_s)
    pool.push(0, "a")  # group a: one env left before its chunk step ends
    for env in (1, 2, 3):
        pool.push(env, "b")  # group b: three
    assert pool.dispatch() == [(0, 0), (2, 1)]  # a's env first though its step is the shortest; then b's slowest
    assert all(chosen >= rival for _, _, chosen, rival in pool.decisions)  # the slowest of its own group
    assert CorePool([0], order="longest").order == "longest"


def test_a_spare_core_is_lent_only_when_every_sim_core_is_taken_and_its_env_moves_back_when_one_frees():
    pool = CorePool([0], spare=[1])
    for env, step_s in [(0, 0.010), (1, 0.030), (2, 0.020)]:
        pool.observe(env, step_s)
    pool.push(1)
    assert pool.dispatch() == [(1, 0)]  # one env ready: the sim core, though the spare one is free too
    pool.push(0)
    pool.push(2)
    assert pool.dispatch() == [(2, 1)]  # the sim core is taken: the spare one, to the slower of the two
    assert pool.promote() == []  # an env is ready: nothing moves
    pool.release(1)
    assert pool.dispatch() == [(0, 0)]
    pool.release(0)
    assert pool.dispatch() == [] and pool.promote() == [(2, 0)]  # the sim core frees, none is ready: env 2 moves
    assert pool.core_of == {2: 0} and sorted(pool.free) == [1] and (pool.lent, pool.promoted) == (1, 1)
    pool.resize([1], spare=[0])  # a new plan: env 2 finishes on core 0, now a spare one
    pool.push(0)
    assert pool.dispatch() == [(0, 1)]
    assert pool.release(2) == 0 and pool.free == [0]


def test_a_core_runs_as_many_envs_at_once_as_its_slots_and_fewer_slots_take_places_back_as_envs_end():
    pool = CorePool([0, 1])
    for env in range(6):
        pool.push(env)
    assert sorted(core for _, core in pool.dispatch()) == [0, 1]  # quiet: one env per core
    pool.resize([0, 1], slots=3)  # (other processes hold the cores: every env at once)
    assert sorted(core for _, core in pool.dispatch()) == [0, 0, 1, 1] and not pool.ready
    pool.resize([0, 1], slots=1)  # the load left: the running envs finish, and a core is handed on once it is free
    released = [(env, pool.release(env)) for env in sorted(pool.core_of)]
    assert sorted(pool.free) == [0, 1] and len(released) == 6


def test_the_step_estimate_is_an_exponential_average():
    pool = CorePool([0], alpha=0.5)
    pool.observe(0, 1.0)
    pool.observe(0, 3.0)
    assert pool.estimate(0) == pytest.approx(2.0)
    assert pool.estimate(1) == math.inf


def _batch(T: int, N: int, version: list[int]) -> RolloutBatch:
    return RolloutBatch(
        obs={"state": torch.zeros(T, N, 3)},
        chunk=torch.zeros(T, N, 2, 1),
        extras={},
        log_prob=torch.zeros(T, N, 2),
        value=torch.zeros(T, N),
        reward=torch.zeros(T, N),
        done=torch.zeros(T, N, dtype=torch.bool),
        mask=torch.ones(T, N, 2, dtype=torch.bool),
        last_value=torch.zeros(N),
        cutoff_value=torch.zeros(T, N),
        version=torch.tensor(version).view(T, 1).expand(T, N).clone(),
    )


def test_chunks_beyond_the_staleness_bound_are_masked_and_counted():
    batch = _batch(4, 3, [3, 4, 5, 6])
    dropped, staleness = drop_stale(batch, train_version=6, max_staleness=2)
    assert dropped == 3  # the chunk step of version 3, in each of the 3 envs
    assert staleness == pytest.approx((3 + 2 + 1 + 0) / 4)
    assert not batch.mask[0].any() and batch.mask[1:].all()


def test_groups_are_joined_env_by_env():
    a, b = _batch(2, 1, [0, 1]), _batch(2, 3, [0, 1])
    b.reward += 1
    joined = concat_envs([a, b])
    assert joined.reward.shape == (2, 4) and joined.last_value.shape == (4,)
    assert joined.reward[:, 0].eq(0).all() and joined.reward[:, 1:].eq(1).all()


def test_a_regroup_waits_for_a_common_segment_boundary_and_loses_no_chunk(tmp_path):
    exp = Experiment.from_config(compose_config(*WORKLOAD, "scheduler=ebrl", "iterations=4"), run_dir=tmp_path / "run")
    sched = exp.scheduler
    try:
        first = sched.next_iteration()[0]  # 2 groups of 2 envs
        sched.regroup(4)
        later = [sched.next_iteration()[0] for _ in range(3)]
        shapes = sched.last_shapes
    finally:
        exp.close()
    assert [g.envs for g in sched.loop.groups] == [[0], [1], [2], [3]] and sched.loop.regroup_at is None
    served = [span.args["groups"] for span in sched.trace.spans if span.lane == "generate"]
    switch = next(k for k, groups in enumerate(served) if max(groups) > 1)
    assert (
        all(max(groups) <= 1 for groups in served[:switch])
        and all(  # old groups until the barrier, then new
            set(groups) <= {0, 1, 2, 3} for groups in served[switch:]
        )
    )
    # every iteration still holds every env's 2 chunks: the barrier moved no chunk from one iteration to another
    assert shapes["chunk"][:2] == (2, 4) and all(s.env_steps > 0 for s in [first, *later])
    assert not sched.loop.segments and not sched.loop.parked


def test_groups_that_find_the_queue_full_queue_after_the_next_generation(tmp_path):
    """scheduler.queue_size=1 with 4 groups of one env: when several report their chunk at once, one queues and
    the others wait for room; after that one's generation batch the next takes the room (they waited for an
    update, which in the first iteration never comes without them)."""
    exp = Experiment.from_config(
        compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.groups=4", "scheduler.queue_size=1"),
        run_dir=tmp_path / "run",
    )
    sched = exp.scheduler
    try:
        sched._step()  # the first generation: all four start their first chunk
        deadline = time.monotonic() + 60
        while sched.dispatcher.events.qsize() < 2 and time.monotonic() < deadline:  # two chunks reported
            time.sleep(0.05)
        sched._step()  # handles the reports: one group queues, the others find it full
        first = sched.loop.queue[0]
        held = [g for g in sched.loop.groups if g is not first and g.pending is None]  # reported, not queued
        assert list(sched.loop.queue) == [first] and held
        sched._step()  # serves the first, then a held one takes its room (before this step's own reports)
        assert len(sched.loop.queue) == 1 and sched.loop.queue[0] in held
    finally:
        exp.close()


def test_a_mode_that_cannot_run_here_says_so_in_one_line():
    with pytest.raises(ConfigError, match="scheduler.groups=5 must be between 1 and env.num_envs=4"):
        validate(compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.groups=5"))
    with pytest.raises(ConfigError, match="scheduler.groups=3 must be between 1 and 2 with algo=grpo"):
        grpo = [o for o in WORKLOAD if not o.startswith("algo.rollout_chunks=")]  # (GRPO has no rollout length)
        validate(compose_config(*grpo, "scheduler=ebrl", "algo=grpo", "algo.group_size=2", "scheduler.groups=3"))
    with pytest.raises(ConfigError, match="scheduler.train_share=0.1 must give training at least one"):
        validate(compose_config(*WORKLOAD, "scheduler=disaggregated", "scheduler.train_share=0.1"))
    # on a one-GPU node (checked past the GPU count, which this machine fails first)
    with pytest.raises(ConfigError, match="trains on a device of its own and hw=h200x1 has one GPU"):
        _check_schedule(compose_config(*WORKLOAD, "scheduler=disaggregated", "hw=h200x1"), cores=2)


# --- real runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ebrl_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ebrl")
    # (the simulators' core pinned, one of two: the plan calibrated at iteration 2 would move it, and these tests read
    # the final one; the other core is the policy's, lent to the simulators while it idles)
    return run(tmp, "scheduler=ebrl", "scheduler.groups=2", "allocator.simulate=1")


def chunk_spans(exp: Experiment):
    """The run's chunks from its trace.json (a run keeps only its latest spans in memory)."""
    return [s for s in read_spans(exp.run_dir / "trace.json") if s.stage == "simulate"]


def test_no_env_waits_for_another_inside_a_chunk(ebrl_run):
    """A chunk runs its steps back to back in its own process: its span is its steps plus the adapter's
    own bookkeeping, never time spent waiting for another env."""
    exp, _ = ebrl_run
    spans = chunk_spans(exp)
    assert spans
    for s in spans:
        overhead = (s.end - s.start) - s.args["step_s"]
        assert 0 <= overhead < 0.5 * (s.end - s.start) + 0.01, s


def test_with_core_rebinding_each_chunk_runs_on_one_sim_core_and_the_slowest_ready_env_gets_it(ebrl_run):
    exp, _ = ebrl_run
    cores = exp.scheduler.dispatcher.cores
    assert cores.cores == exp.placement.cpus("simulate") and cores.spare  # (work-conserving: the other core lent)
    for s in chunk_spans(exp):
        assert len(s.args["cpus"]) == 1 and s.args["cpus"][0] in cores.cores + cores.spare, s
    decisions = exp.scheduler.dispatcher.cores.decisions
    # one hand-over per chunk run; the rollout may have started more chunks when the last update ended
    assert len(chunk_spans(exp)) <= len(decisions) <= len(chunk_spans(exp)) + exp.cfg.env.num_envs
    assert all(chosen >= other for _, _, chosen, other in decisions)


def test_an_env_runs_only_while_it_holds_a_core(ebrl_run):
    """Never more chunks run at once than the scheduler has cores to give them (its own and the ones it may borrow),
    though 4 envs could."""
    exp, _ = ebrl_run
    events = sorted([(s.start, 1) for s in chunk_spans(exp)] + [(s.end, -1) for s in chunk_spans(exp)])
    running, most = 0, 0
    for _, d in events:
        running += d
        most = max(most, running)
    cores = exp.scheduler.dispatcher.cores
    assert most <= len(cores.cores + cores.spare) < exp.cfg.env.num_envs


def test_weights_reach_generation_with_increasing_versions(ebrl_run):
    exp, metrics = ebrl_run
    per_env = defaultdict(list)
    for s in sorted(chunk_spans(exp), key=lambda s: s.start):
        per_env[s.lane].append(s.args["version"])
    for versions in per_env.values():
        assert versions == sorted(versions)
    assert max(max(v) for v in per_env.values()) >= 1  # generation swapped in a published update
    assert [m["sched/weights_version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert all(m["sched/dropped_chunks"] == 0 for m in metrics)  # the rollout never runs past max_staleness


def test_the_trainer_takes_every_core_while_the_rollout_has_nothing_to_run(ebrl_run):
    """Work-conserving the other way: the last update has no rollout left beside it, so the trainer process trains it
    on every core with as many threads (beside a running rollout it has its share's one); a group that goes on takes
    the cores back. Cores that other processes kept busy (a machine running more than this test) are left to them."""
    exp, metrics = ebrl_run
    held = round(max(m["perf/foreign_cores"] for m in metrics))
    threads = metrics[-1]["sched/train_threads"]
    assert len(exp.cores) > exp.placement.threads("train") == 1
    assert threads == len(exp.cores) or (held > 0 and threads == max(1, len(exp.cores) - held))


def test_the_trace_file_parses_and_its_intervals_are_consistent(ebrl_run):
    """trace.json (what ui.perfetto.dev opens): every lane named, no negative time, one thing at a time per lane
    (an env runs one chunk, generation one batch, the trainer one update then its publication), and every update
    followed by the publication of the version generation later swaps in."""
    exp, metrics = ebrl_run
    events = json.loads((exp.run_dir / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} <= set(names)
    lanes = set(names.values())
    assert {"train", "generate"} | {f"simulate/env{i}" for i in range(4)} <= lanes
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    for tid in names:
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == tid)
        assert all(end <= start + 1.0 for (_, end), (start, _) in zip(mine, mine[1:])), names[tid]  # 1 us rounding
    train = sorted((e for e in spans if names[e["tid"]] == "train"), key=lambda e: e["ts"])
    assert [e["name"] for e in train] == ["update", "publish"] * len(metrics)
    assert [e["args"]["version"] for e in train if e["name"] == "publish"] == [1, 2, 3]


def test_the_rollout_runs_max_ahead_iterations_ahead_and_by_default_keeps_every_chunk():
    def schedule(*overrides: str) -> Schedule:
        return Schedule.from_config(dict(compose_config(*WORKLOAD, *overrides).scheduler))

    ebrl = schedule("scheduler=ebrl")
    assert (ebrl.ahead, ebrl.max_staleness) == (1, 1)  # staleness never exceeds 1: nothing to drop
    further = schedule("scheduler=ebrl", "scheduler.max_ahead=3", "scheduler.max_staleness=1")
    assert (further.ahead, further.max_staleness) == (3, 1)  # ... what is older than 1 is dropped
    assert schedule("scheduler=hybrid", "scheduler.max_ahead=3").ahead == 0  # no overlap: none ahead


def test_stale_chunks_are_dropped_and_counted_when_the_bound_is_zero(tmp_path):
    _, metrics = run(tmp_path, "scheduler=async", "scheduler.max_staleness=0")
    dropped = [m["sched/dropped_chunks"] for m in metrics]
    staleness = [m["sched/staleness_mean"] for m in metrics]
    assert dropped[0] == 0  # the first rollout is made by the weights its update starts from
    assert sum(dropped) > 0 and all(s > 0 for s, d in zip(staleness, dropped) if d)


@pytest.mark.parametrize("mode", ["colocated", "async", "hybrid", "disaggregated"])
def test_every_mode_produces_the_same_trajectory_shapes(mode, ebrl_run, tmp_path):
    exp, _ = ebrl_run
    other, metrics = run(tmp_path, f"scheduler={mode}")
    assert other.scheduler.last_shapes == exp.scheduler.last_shapes
    assert len(metrics) == 3 and all(math.isfinite(m["losses/policy"]) for m in metrics)
    if mode == "hybrid":  # no overlap: training runs alone after the rollout, on every core, with no plan to split
        assert other.placement.allocator is None and other.scheduler.trainer.threads == len(other.cores)
    if mode == "colocated" and len(other.cores) > 1:
        # the supervisor's team (generation and training, a thread per core) leaves the cores other processes hold:
        # each iteration runs the count the last one's foreign load left, and a start looks at the cores first
        placement, n = other.placement, len(other.cores)
        for last, now in zip(metrics, metrics[1:]):
            assert now["perf/supervisor_threads"] == max(1, n - held_cores(last["perf/foreign_cores"]))
        assert placement.supervisor_threads(0.0) == n and placement.supervisor_threads(1.0) == n - 1
        with foreign_load(1, [other.cores[0]]):
            time.sleep(0.5)  # (its interpreter started)
            assert placement.supervisor_threads() == n - 1


def test_simulators_yield_shared_cores_to_the_policy_and_an_idle_rollout_lends_the_trainer_every_core(tmp_path):
    exp = Experiment.from_config(
        compose_config(*WORKLOAD, "scheduler=ebrl", "scheduler.sim_nice=7"), run_dir=tmp_path / "run"
    )
    try:
        assert {os.getpriority(os.PRIO_PROCESS, w.pid) for w in exp.pool.workers} == {7}
        assert os.getpriority(os.PRIO_PROCESS, exp.scheduler.trainer.process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        # the trainer lent every core while the rollout has nothing to run, and its share's back after
        trainer, placement = exp.scheduler.trainer, exp.placement
        for idle, threads, cpus in [(True, len(exp.cores), exp.cores), (False, 1, placement.cpus("train"))]:
            placement.lend_to_trainer(trainer, idle)
            assert trainer.shared_threads.count == threads and os.sched_getaffinity(trainer.pid) == set(cpus)
        # mid-update on the lent threads, it keeps every core until it runs no more threads than its lease has (OpenMP
        # threads stacked on a core wait for each other at every barrier)
        lent = trainer.shared_threads
        placement.lend_to_trainer(trainer, True)
        lent.running.value = len(exp.cores)  # (as the process's follow() says: 0 between updates)
        placement.lend_to_trainer(trainer, False)
        assert lent.count == 1 and os.sched_getaffinity(trainer.pid) == set(exp.cores)
        lent.running.value = 1
        placement.lend_to_trainer(trainer, False)
        assert os.sched_getaffinity(trainer.pid) == set(placement.cpus("train")) and not lent.leaving
        # the cores' busy time that none of the run's processes used is other processes' load: lent, the trainer runs
        # no more threads than the cores they leave
        shares = {"simulate": 0.3, "main": 0.1, "trainer": 0.1}
        assert placement.measured(100.0, shares, {}, cpu_busy=1.0).foreign == pytest.approx(0.5 * len(exp.cores))
        placement.account().foreign = 1.0
        placement.lend_to_trainer(trainer, True)
        assert lent.count == len(exp.cores) - 1 and os.sched_getaffinity(trainer.pid) == set(exp.cores)
        # and the simulators run every env at once where such a load holds a core (niced, one per core gets a tenth
        # of it), one per core again once it leaves
        spread = math.ceil(4 / len(placement.cpus("simulate") + placement.spare()))
        for foreign, slots in [(1.0, spread), (0.0, 1)]:
            placement.follow_load(foreign)
            assert exp.scheduler.dispatcher.cores.slots == slots
        # the first iteration's: a look at the cores, which real busy processes hold
        with foreign_load(len(exp.cores)):
            time.sleep(0.5)
            placement.follow_load(None)
        assert exp.scheduler.dispatcher.cores.slots == spread
    finally:
        exp.close()


def test_an_ebrl_run_checkpoints_the_trainer_and_resumes_where_it_stopped(tmp_path):
    first, metrics = run(tmp_path, "scheduler=ebrl", "iterations=2", "checkpoint_every=1")
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)
    assert ckpt["iteration"] == 2 and ckpt["optimizer"]["state"]  # Adam's moments, from the trainer process
    resumed = Experiment.from_config(compose_config(*WORKLOAD, "scheduler=ebrl", f"resume={tmp_path / 'run'}"))
    resumed.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[-1]["sched/weights_version"] == 3.0  # versions go on from the checkpoint's updates
