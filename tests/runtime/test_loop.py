"""The pipelined rollout's state machine (ebrl/runtime/loop.py) driven by hand: events in, decisions out; no
processes, no policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ebrl.envs.worker import ChunkReport
from ebrl.rl.rollout import ChunkStep
from ebrl.runtime.loop import RolloutLoop, Rules, Shipment

H = 2  # actions per chunk


def report(truncated: bool = False) -> ChunkReport:
    final = {"state": np.ones(3, np.float32)} if truncated else None
    return ChunkReport(
        executed=H,
        rewards=np.ones(H, np.float32),
        successes=np.zeros(H, bool),
        step_times=np.full(H, 0.01),
        terminated=False,
        truncated=truncated,
        episode={"return": 2.0, "length": 2, "success": 0.0} if truncated else None,
        final_obs=final,
    )


def make(num_envs: int, groups: int, **rules) -> RolloutLoop:
    return RolloutLoop(num_envs, groups, Rules(**rules))


def step(n: int, version: int) -> ChunkStep:
    return ChunkStep(
        obs={"state": torch.zeros(n, 3)},
        chunk=torch.zeros(n, H, 1),
        extras={},
        log_prob=torch.zeros(n, H),
        value=torch.zeros(n),
        version=torch.full((n,), version),
    )


def serve(loop: RolloutLoop, version: int = 0) -> tuple[list[int], list[Shipment]]:
    """What Scheduler._serve does, with zeros for values: the served groups' indices, and what shipped."""
    serving = loop.serve()
    shipped = []
    episodic = loop.rules.episodic
    for g in serving.cut:
        g.set_cutoff_values(torch.full((len(g.cut_obs),), 5.0))
    for g in serving.ending if episodic else serving.held:
        shipped.append(loop.finish_segment(g, torch.zeros(len(g.envs))))
    for g in serving.starting:
        if g in serving.ending and not episodic:
            shipped.append(loop.finish_segment(g, torch.zeros(len(g.envs))))
        loop.started(g, step(len(g.envs), version))
    loop.served(serving)
    return [g.index for g in serving.groups], [s for s in shipped if s is not None]


def run_chunk(loop: RolloutLoop, group: int, truncated: bool = False) -> None:
    for env in loop.groups[group].envs:
        loop.reported(env, report(truncated))


def test_a_segment_ships_once_every_group_collected_it_and_no_group_runs_more_than_ahead():
    loop = make(4, 2, chunks=2, iterations=3, ahead=1, max_staleness=1)
    assert serve(loop) == ([0, 1], [])  # both start their first chunk
    for chunk in range(2):
        run_chunk(loop, 0)
        assert serve(loop) == ([0], [])  # group 0 runs ahead into iteration 1 (ahead=1)
    assert loop.groups[0].segment == 1 and loop.groups[1].segment == 0
    for chunk in range(2):
        run_chunk(loop, 1)
        served, shipped = serve(loop)
    assert served == [1] and [s.iteration for s in shipped] == [0]
    batch = shipped[0].batch
    assert batch.reward.shape == (2, 4) and batch.reward.eq(H).all() and shipped[0].stats.env_steps == 2 * 4 * H
    # group 0 finishes iteration 1 and would start iteration 2: two beyond the 0 updates done, so it waits
    for chunk in range(2):
        run_chunk(loop, 0)
        serve(loop)
    assert loop.waiting == [loop.groups[0]] and loop.groups[0].pending is None and not loop.queue
    assert not loop.idle  # group 1 still has its chunk to run
    loop.trained()  # update 0 done: it may go on
    assert list(loop.queue) == [loop.groups[0]] and not loop.waiting
    assert serve(loop) == ([0], [])
    assert loop.groups[0].pending is not None


def test_synchronous_rollout_waits_for_every_update_and_stops_at_the_run_s_iterations():
    loop = make(2, 1, chunks=1, iterations=2, ahead=0, max_staleness=0)
    serve(loop)
    run_chunk(loop, 0)
    served, shipped = serve(loop)  # its segment ends, the next would be beyond the updates done: bootstrap only
    assert [s.iteration for s in shipped] == [0] and loop.waiting == loop.groups and loop.idle
    loop.trained()
    assert not loop.idle
    serve(loop)
    run_chunk(loop, 0)
    served, shipped = serve(loop)
    assert [s.iteration for s in shipped] == [1]
    loop.trained()
    assert list(loop.queue) == loop.groups
    serve(loop)  # past the run's iterations: it waits for good
    assert loop.groups[0].pending is None and loop.waiting == loop.groups and loop.idle


def test_chunk_steps_older_than_max_staleness_are_masked_when_their_segment_ships():
    loop = make(2, 1, chunks=3, iterations=10, ahead=1, max_staleness=1, base_version=4)
    for version in (2, 3, 4):  # the weights that sampled each chunk step; the update of iteration 0 trains at 4
        serve(loop, version)
        run_chunk(loop, 0)
    _, shipped = serve(loop, 4)
    assert shipped[0].dropped == 2 and shipped[0].staleness == pytest.approx((2 + 1 + 0) / 3)
    assert shipped[0].batch.mask[0].any(-1).eq(False).all() and shipped[0].batch.mask[1:].all()


def test_a_cut_off_episode_gets_its_value_at_the_group_s_next_serving():
    loop = make(2, 1, chunks=2, iterations=1, ahead=0, max_staleness=0)
    serve(loop)
    run_chunk(loop, 0, truncated=True)
    assert len(loop.groups[0].cut_obs) == 2
    serve(loop)
    assert loop.groups[0].steps[0].cutoff_value.tolist() == [5.0, 5.0] and not loop.groups[0].cut_obs


def test_a_full_queue_refills_as_soon_as_a_batch_is_served():
    loop = make(3, 3, chunks=4, iterations=1, ahead=0, max_staleness=0, queue_size=1)
    assert list(loop.queue) == loop.groups  # at the start every group is ready
    serve(loop)
    for g in range(3):
        run_chunk(loop, g)
    assert [g.index for g in loop.queue] == [0] and [g.index for g in loop.overflow] == [1, 2]
    assert serve(loop)[0] == [0] and [g.index for g in loop.queue] == [1]  # taken out: the next has its room
    assert serve(loop)[0] == [1] and [g.index for g in loop.queue] == [2]


def test_a_regroup_parks_every_group_at_one_segment_boundary_then_splits_anew():
    loop = make(4, 2, chunks=1, iterations=5, ahead=1, max_staleness=1)
    serve(loop)
    run_chunk(loop, 0)
    serve(loop)  # group 0 now runs iteration 1; group 1 is still in iteration 0
    loop.regroup(4)
    assert loop.regroup_at == (4, 2)  # the furthest group ends iteration 1 there
    run_chunk(loop, 1)
    _, shipped = serve(loop)  # group 1 ends iteration 0 and goes on into iteration 1
    assert [s.iteration for s in shipped] == [0] and len(loop.groups) == 2
    loop.trained()
    for g in (0, 1):
        run_chunk(loop, g)
    _, shipped = serve(loop)  # both end iteration 1 at the boundary and park; then four groups start iteration 2
    assert [s.iteration for s in shipped] == [1]
    assert [g.envs for g in loop.groups] == [[0], [1], [2], [3]] and loop.regroup_at is None and not loop.parked
    assert all(g.segment == 2 for g in loop.groups) and list(loop.queue) == loop.groups
    with pytest.raises(ValueError, match="between 1 and 4"):
        loop.regroup(5)


def end(loop: RolloutLoop, group: int, ended: set[int], running: list[int] | None = None) -> None:
    """One chunk of a group's `running` envs (all) in which the episodes of envs `ended` end; the others go on."""
    for env in loop.groups[group].envs if running is None else running:
        done = env in ended
        loop.reported(
            env,
            ChunkReport(
                executed=H,
                rewards=np.ones(H, np.float32),
                successes=np.zeros(H, bool),
                step_times=np.full(H, 0.01),
                terminated=done,
                truncated=False,
                episode={"return": 2.0, "length": 2, "success": 1.0} if done else None,
            ),
        )


def test_an_episodic_segment_is_one_episode_per_env_and_groups_hold_whole_units():
    """GRPO: a group's segment ends once every env's episode ended; an env whose episode ended runs nothing more in
    its segment; groups of whole units of envs (GRPO's groups); groups that ended after fewer chunk steps are padded
    with chunk steps that carry nothing."""
    loop = make(6, 2, chunks=4, iterations=2, ahead=0, max_staleness=0, episodic=True, unit=2)
    assert [g.envs for g in loop.groups] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="between 1 and 3"):
        loop.regroup(4)
    serving = loop.serve()
    assert serving.beginning == loop.groups  # every env resets from its group's seed first
    for g in serving.starting:
        assert loop.started(g, step(len(g.envs), 0)) == g.envs
    loop.served(serving)
    end(loop, 0, {0, 3})
    serving = loop.serve()
    assert not serving.ending and not serving.beginning
    running = loop.started(loop.groups[0], step(4, 0))
    assert running == [1, 2]  # 0 and 3 ended: they report an empty chunk at once
    loop.served(serving)
    end(loop, 0, {1, 2}, running)
    end(loop, 1, {4, 5})
    _, shipped = serve(loop)  # both end: group 1 after one chunk step, group 0 after two
    assert [s.iteration for s in shipped] == [0]
    batch = shipped[0].batch
    assert batch.reward.shape == (2, 6) and not batch.mask[1, :, 4:].any() and not batch.done[1, 4:].any()
    assert batch.mask[0].all() and batch.mask[1, 1:3].all() and not batch.mask[1, [0, 3]].any()
    assert shipped[0].stats.env_steps == 8 * H and len(shipped[0].stats.returns) == 6
    assert loop.waiting == loop.groups  # synchronous: both wait for the update
    loop.trained()
    assert loop.serve().beginning == loop.groups  # the next segment: every env resets again


def test_an_episode_that_does_not_end_within_its_chunks_is_an_error():
    loop = make(2, 1, chunks=1, iterations=1, ahead=0, max_staleness=0, episodic=True, unit=2)
    serve(loop)
    end(loop, 0, {0})
    with pytest.raises(RuntimeError, match="1 of 2 episodes of group 0 did not end within 1 chunks"):
        loop.serve()
