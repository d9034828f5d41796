"""Many tasks in one run: which env runs which task (GRPO groups whole), one slot layout for tasks of different state
sizes (real robosuite workers: Lift and Stack), and each env's own instruction and per-task episodes."""
import numpy as np
import pytest

from ebrl.envs.base import ArraySpec, EnvSetupError, EnvSpec
from ebrl.envs.tasks import assign_tasks, joint_spec, task_list
from ebrl.envs.worker import SimWorkerPool

ROBOSUITE = {"_target_": "ebrl.envs.robosuite_env.RobosuiteEnv", "name": "robosuite", "task": "Lift",
             "max_episode_steps": 6, "cameras": [], "image_size": 64, "reward": "dense", "robot": "Panda",
             "control_freq": 20}


def test_envs_go_to_tasks_round_robin_and_a_grpo_group_keeps_one_task():
    cfg = {"tasks": ["Lift", "Stack", "Door"]}
    assert assign_tasks(cfg, 6) == ["Lift", "Stack", "Door", "Lift", "Stack", "Door"]
    assert assign_tasks(cfg, 12, group_size=4) == ["Lift"] * 4 + ["Stack"] * 4 + ["Door"] * 4
    assert assign_tasks({}, 4) is None


def test_task_weights_share_the_units_and_interleave_them():
    got = assign_tasks({"tasks": ["Lift", "Stack"], "task_weights": [3, 1]}, 8)
    assert got.count("Lift") == 6 and got.count("Stack") == 2
    assert got[:4].count("Stack") == 1  # interleaved: the first half already has its share
    got = assign_tasks({"tasks": ["A", "B", "C"], "task_weights": [100, 1, 1]}, 4)
    assert sorted(got) == ["A", "A", "B", "C"]  # every task gets a unit, however small its weight


@pytest.mark.parametrize("cfg, n, line", [
    ({"tasks": ["Lift", "Stack", "Door"]}, 2, "env.tasks has 3 tasks and the run has env.num_envs=2: each task needs "
                                              "at least one; give env.num_envs=3 or more"),
    ({"tasks": ["Lift", "Stack"], "task_weights": [1]}, 4, "env.task_weights=[1.0] must give one positive weight per"),
    ({"tasks": "Lift"}, 4, "env.tasks='Lift' must be a non-empty list of tasks"),
    ({"tasks": "all", **ROBOSUITE}, 4, "env.tasks=all: env=robosuite has no task list of its own"),
])
def test_a_task_assignment_that_cannot_work_is_one_line(cfg, n, line):
    with pytest.raises(EnvSetupError) as info:
        assign_tasks(cfg, n)
    assert str(info.value).startswith(line)


def test_all_means_a_libero_suite():
    cfg = {"_target_": "ebrl.envs.libero_env.LiberoEnv", "suite": "libero_10", "tasks": "all"}
    assert task_list(cfg) == [str(i) for i in range(10)]


def test_the_joint_spec_is_the_widest_and_refuses_other_keys():
    a = EnvSpec({"state": ArraySpec((10,), "float32")}, 7, "lift", 50)
    b = EnvSpec({"state": ArraySpec((23,), "float32")}, 6, "stack", 80)
    spec = joint_spec([a, b])
    assert spec.obs["state"].shape == (23,) and spec.action_dim == 7 and spec.max_episode_steps == 80
    c = EnvSpec({"state": ArraySpec((10,), "float32"), "image/agentview": ArraySpec((8, 8, 3), "uint8")}, 7, "x", 5)
    with pytest.raises(EnvSetupError, match="the envs of one run must observe the same keys"):
        joint_spec([a, c])


def test_a_pool_of_two_tasks_pads_the_narrower_state_and_reports_each_task():
    with SimWorkerPool({**ROBOSUITE, "tasks": ["Lift", "Stack"]}, num_envs=2, seed=0, chunk_len=4) as pool:
        lift, stack = (w.spec for w in pool.workers)
        assert lift.obs["state"].shape[0] < stack.obs["state"].shape[0] == pool.spec.obs["state"].shape[0]
        assert lift.instruction != stack.instruction
        pool.reset_all()
        width = lift.obs["state"].shape[0]
        obs = pool.stacked_obs()["state"]
        assert np.all(obs[0, width:] == 0) and np.any(obs[0, :width] != 0) and np.any(obs[1, width:] != 0)
        tasks = []
        for _ in range(2):  # 8 steps: each env ends its 6-step episode once
            pool.submit_all(4, np.zeros((2, 4, pool.spec.action_dim), np.float32))
            tasks += [r.episode["task"] for r in pool.wait_all() if r.episode]
        assert sorted(tasks) == ["Lift", "Stack"]
