"""Many tasks in one run: which env runs which task (GRPO groups whole), one slot layout for tasks of different state
sizes (real robosuite workers: Lift and Stack; robosuite beside LIBERO in its venv), and each env's own instruction
and per-task episodes."""

import numpy as np
import pytest
from omegaconf import OmegaConf

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.envs.base import ArraySpec, EnvSetupError, EnvSpec
from ebrl.envs.setup import benchmark_python
from ebrl.envs.tasks import assign_tasks, joint_spec, task_config, task_list
from ebrl.envs.worker import SimWorkerPool
from tests.conftest import compose_config

ROBOSUITE = {
    "_target_": "ebrl.envs.robosuite_env.RobosuiteEnv",
    "name": "robosuite",
    "task": "Lift",
    "max_episode_steps": 6,
    "cameras": [],
    "image_size": 64,
    "reward": "dense",
    "robot": "Panda",
    "control_freq": 20,
}


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


@pytest.mark.parametrize(
    "cfg, n, line",
    [
        (
            {"tasks": ["Lift", "Stack", "Door"]},
            2,
            "env.tasks has 3 tasks and the run has env.num_envs=2: each task needs "
            "at least one; give env.num_envs=3 or more",
        ),
        (
            {"tasks": ["Lift", "Stack"], "task_weights": [1]},
            4,
            "env.task_weights=[1.0] must give one positive weight per",
        ),
        ({"tasks": "Lift"}, 4, "env.tasks='Lift' must be a non-empty list of tasks"),
        ({"tasks": "all", **ROBOSUITE}, 4, "env.tasks=all: env=robosuite has no task list of its own"),
    ],
)
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
    with SimWorkerPool({**ROBOSUITE, "tasks": ["Lift", "Stack"]}, num_envs=2, seed=0, execute=4) as pool:
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


# --- several benchmarks side by side -------------------------------------------------------------
LIBERO_PYTHON = benchmark_python("libero")


def test_a_task_of_another_benchmark_becomes_its_whole_env_config():
    cfg = compose_config("env.num_envs=4", "env.cameras=[]", "env.tasks=[Lift,{env:libero,task:'3',suite:libero_10}]")
    validate(cfg)
    lift, libero = cfg.env.tasks
    assert lift == "Lift"
    assert (libero["_target_"], libero["name"], libero["suite"], libero["task"]) == (
        "ebrl.envs.libero_env.LiberoEnv",
        "libero",
        "libero_10",
        "3",
    )
    assert libero["max_episode_steps"] == 512 and libero["cameras"] == []  # its suite's limit; the run's observation
    env = OmegaConf.to_container(cfg.env)
    assert assign_tasks(env, 4) == ["Lift", "libero:3"] * 2
    assert task_config(env, "libero:3")["name"] == "libero" and task_config(env, "Lift")["task"] == "Lift"
    for tasks, line in [
        ("[Lift,{env:libero,tsk:'3'}]", r"env=libero: tsk is not one of its keys \(_target_, name,"),
        ("[Lift,{env:gym,task:'3'}]", "must name a benchmark as env: one of robosuite, maniskill"),
    ]:
        with pytest.raises(ConfigError, match=line):
            validate(compose_config("env.num_envs=2", f"env.tasks={tasks}"))


@pytest.mark.slow  # (LIBERO's build: 15 s)
@pytest.mark.skipif(LIBERO_PYTHON is None, reason="no LIBERO venv: run `python -m ebrl.envs.setup libero`")
def test_robosuite_and_libero_envs_run_side_by_side_under_their_own_interpreters():
    cfg = compose_config(
        "env.num_envs=2", "env.max_episode_steps=6", "env.tasks=[Lift,{env:libero,task:'0',max_episode_steps:6}]"
    )
    validate(cfg)
    with SimWorkerPool(OmegaConf.to_container(cfg.env), num_envs=2, seed=0, execute=4) as pool:
        lift, libero = (w.spec for w in pool.workers)
        assert pool.workers[1].launch.python == str(LIBERO_PYTHON) != pool.workers[0].launch.python
        widths = sorted(s.obs["state"].shape[0] for s in (lift, libero))
        assert widths[0] < widths[1] == pool.spec.obs["state"].shape[0]  # the narrower padded
        assert lift.instruction == "lift the red cube" != libero.instruction
        pool.reset_all()
        tasks = []
        for _ in range(2):  # 8 steps: each env ends its 6-step episode once
            pool.submit_all(4, np.zeros((2, 4, pool.spec.action_dim), np.float32))
            tasks += [r.episode["task"] for r in pool.wait_all() if r.episode]
        assert sorted(tasks) == ["Lift", "libero:0"]
