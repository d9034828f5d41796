"""Cameras render only at the steps whose observation is read (a chunk's last, the step limit's, a reset), and what
is read is what rendering at every step gives, bit for bit: the same frames, states, rewards and physics."""

import numpy as np
import pytest

from ebrl.envs.maniskill_env import ManiSkillEnv
from ebrl.envs.robosuite_env import RobosuiteEnv
from tests.envs.common import CHUNKS, assert_same, frames, random_chunk, read_over_chunks


@pytest.mark.parametrize(
    "make",
    [
        lambda: RobosuiteEnv(
            task="Lift", max_episode_steps=12, cameras=["agentview"], image_size=48, reward="dense", seed=0
        ),
        lambda: ManiSkillEnv(
            task="PickCube-v1", max_episode_steps=12, cameras=["base_camera"], image_size=48, reward="dense", seed=0
        ),
    ],
    ids=["robosuite", "maniskill"],
)
def test_frames_rendered_at_the_boundaries_are_those_of_every_step(make):
    every, gated = make(), make()
    try:
        before = frames(every), frames(gated)
        want, rendered_every = read_over_chunks(every, every_step=True)
        got, rendered_gated = read_over_chunks(gated, every_step=False)
        assert_same(want, got)
        image = next(k for k in want[0] if k.startswith("image/"))
        assert want[1][image].std() > 5  # a rendered scene at a boundary, not the blank frame
        if isinstance(every, RobosuiteEnv):
            assert np.array_equal(every.env.sim.data.qpos, gated.env.sim.data.qpos)
        # every step: 16 steps (the third chunk stops after 2) and 2 resets; gated: a frame per chunk (the third's at
        # the step limit) and the resets'
        assert rendered_every - before[0] == 16 + 2
        assert rendered_gated - before[1] == len(CHUNKS) + 2
    finally:
        every.close()
        gated.close()


def test_an_episode_that_ends_before_its_chunks_last_step_has_its_final_frame():
    env = RobosuiteEnv(task="Lift", max_episode_steps=40, cameras=["agentview"], image_size=48, reward="sparse", seed=0)
    try:
        env.begin_episode(seed=3)
        env.step = lambda action, step=env.step: (*step(action)[:2], True, False, {"success": True})  # ends at once
        _, result = env.run_chunk(random_chunk(4, env.spec.action_dim))
        assert result.executed == 1 and result.terminated
        assert result.final_obs["image/agentview"].std() > 5  # rendered after the step, not the blank frame
    finally:
        env.close()
