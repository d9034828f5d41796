"""robosuite adapter: each task steps the real simulator (MuJoCo) for a few steps."""

import numpy as np
import pytest

from ebrl.envs.base import EnvSetupError
from ebrl.envs.process import build_adapter, release_build_memory
from ebrl.envs.robosuite_env import RobosuiteEnv
from tests.envs.common import assert_matches_spec, random_chunk

TASKS = ["Lift", "Stack", "PickPlaceCan", "Door", "NutAssemblySquare"]


def make(task: str = "Lift", **overrides) -> RobosuiteEnv:
    kwargs = dict(
        task=task,
        max_episode_steps=20,
        cameras=[],
        image_size=64,
        reward="dense",
        terminate_on_success=True,
        robot="Panda",
        control_freq=20,
        seed=0,
    )
    kwargs.update(overrides)
    return RobosuiteEnv(**kwargs)


@pytest.mark.parametrize("task", TASKS)
def test_task_resets_seeded_and_steps_a_chunk(task):
    env = make(task)
    try:
        assert env.spec.instruction
        assert env.spec.action_dim == 7
        assert env.spec.obs["state"].dtype == "float32"
        first = env.begin_episode(seed=11)
        assert_matches_spec(env, first)
        env.run_chunk(random_chunk(3, 7))
        assert np.array_equal(env.begin_episode(seed=11)["state"], first["state"])
        assert not np.array_equal(env.begin_episode(seed=12)["state"], first["state"])

        obs, result = env.run_chunk(random_chunk(5, 7, seed=1))
        assert_matches_spec(env, obs)
        assert result.executed == 5
        assert result.rewards.dtype == np.float32 and np.isfinite(result.rewards).all()
        assert result.successes.dtype == bool
        assert (result.step_times > 0).all()
        assert not np.array_equal(obs["state"], first["state"])
    finally:
        env.close()


def test_truncates_at_max_episode_steps_and_resets():
    env = make("Lift", max_episode_steps=7, reward="sparse")
    try:
        env.begin_episode()
        _, first = env.run_chunk(random_chunk(5, 7))
        assert first.executed == 5 and not first.done and first.episode is None
        obs, second = env.run_chunk(random_chunk(5, 7, seed=1))
        assert second.executed == 2  # stops at the episode's end, not the chunk's
        assert second.truncated and not second.terminated
        assert second.episode == {"return": 0.0, "length": 7, "success": 0.0}
        assert second.final_obs is not None and not np.array_equal(second.final_obs["state"], obs["state"])
        assert (first.rewards == 0).all()  # sparse: 1 on success only
        _, third = env.run_chunk(random_chunk(5, 7, seed=2))  # a fresh episode after the auto-reset
        assert third.executed == 5 and not third.done
    finally:
        env.close()


def test_unknown_task_is_one_line():
    with pytest.raises(EnvSetupError) as info:
        make("Lfit")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("env.task='Lfit' is not a robosuite task; choose one of: ")
    assert "Lift" in message and "NutAssemblySquare" in message


def test_camera_images_of_a_worker_build_which_gives_back_the_compile_cache():
    mujoco = pytest.importorskip("mujoco")
    cfg = dict(
        _target_="ebrl.envs.robosuite_env.RobosuiteEnv",
        task="Lift",
        max_episode_steps=20,
        cameras=["agentview"],
        image_size=48,
        reward="dense",
        robot="Panda",
        control_freq=20,
    )
    built = build_adapter(cfg, seed=0)
    assert mujoco.mj_getCacheSize(mujoco.mj_getCache()) == 0  # decoded meshes and textures given back
    direct = make("Lift", cameras=["agentview"], image_size=48)  # compiles again: the cache fills
    try:
        release_build_memory(keep_compile_cache=True)  # what a RoboCasa worker does: its resets recompile
        assert mujoco.mj_getCacheSize(mujoco.mj_getCache()) > 0
        assert built.spec.obs["image/agentview"].shape == (48, 48, 3)
        for env in (built, direct):
            obs = env.begin_episode(seed=3)
            assert_matches_spec(env, obs)
            assert obs["image/agentview"].dtype == np.uint8 and obs["image/agentview"].std() > 5  # not blank
        chunk = random_chunk(4, 7)
        (a, _), (b, _) = built.run_chunk(chunk), direct.run_chunk(chunk)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    finally:
        built.close()
        direct.close()
