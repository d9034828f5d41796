"""The fast control step against the stock simulator, in one process: bit for bit at every control step."""

import numpy as np
import pytest

from ebrl.envs.robosuite_env import RobosuiteEnv
from ebrl.envs.setup import SETUP_COMMAND, benchmark_python
from tests.envs.common import assert_identical, random_chunk, robosuite_state, run_in_interpreter, trajectory

ROBOSUITE_TASKS = ("Lift", "Stack", "NutAssemblySquare", "Door", "PickPlaceCan")


@pytest.mark.parametrize("task", ROBOSUITE_TASKS)
def test_robosuite_fast_step_is_the_stock_step_bit_for_bit(task):
    fast = RobosuiteEnv(task, max_episode_steps=1000, seed=0)
    stock = RobosuiteEnv(task, max_episode_steps=1000, fast_step=False, seed=0)
    assert fast.fast_step_off == "" and stock.fast_step_off == "env.fast_step=false"
    # the physics, and every array the robot's proprioception buffers and its controllers hold
    assert_identical(trajectory(fast, robosuite_state(fast.env), 40), trajectory(stock, robosuite_state(stock.env), 40))
    raw = stock.env._observables  # the observables' own clocks end where the stock code leaves them
    for name, obs in fast.env._observables.items():
        assert (obs._time_since_last_sample, obs._sampled) == (raw[name]._time_since_last_sample, raw[name]._sampled)


def test_stack_computes_its_staged_rewards_once_a_step_for_reward_and_success(monkeypatch):
    from robosuite.environments.manipulation.stack import Stack

    calls = []
    stock = Stack.staged_rewards
    monkeypatch.setattr(Stack, "staged_rewards", lambda self: calls.append(1) or stock(self))
    fast, plain = (RobosuiteEnv("Stack", max_episode_steps=40, fast_step=way, seed=0) for way in (True, False))
    for env in (fast, plain):
        env.begin_episode(1)
        calls.clear()
        for action in random_chunk(3, env.spec.action_dim):
            env.step(action)
        assert len(calls) == (3 if env is fast else 6)  # (the stock step: its reward's, then the success check's)


def test_the_compiled_controller_runs_alone_once_it_agreed_and_never_after_it_disagreed(monkeypatch):
    from ebrl.envs import fast_kernels
    from ebrl.envs.fast_kernels import CHECKED, Compiled, osc_kernel

    env = RobosuiteEnv("Lift", max_episode_steps=40, seed=0)
    env.begin_episode(1)
    for action in random_chunk(3, env.spec.action_dim):
        env.step(action)
    arm = env._step.__self__.workers[0]  # (the fast step's OSC worker: CHECKED substeps are one control step)
    assert arm.compiled.on is True  # what the trajectory tests above compared with the stock step
    monkeypatch.setattr(fast_kernels, "DECIDED", {})  # (a 2-joint layout this process has not decided)
    agrees, differs = (Compiled(osc_kernel(), [0, 1], [0, 1]) for _ in range(2))
    plain = agrees.state()
    for _ in range(CHECKED - 1):
        assert agrees.decide(plain) and agrees.on is None and differs.decide(plain)
    assert agrees.decide(plain) and agrees.on is True
    assert Compiled(osc_kernel(), [0, 1], [0, 1]).on is True  # (a controller rebuilt at a reset: decided)
    off_by_one_ulp = (*plain[:-1], np.nextafter(plain[-1], 1.0))
    assert not differs.decide(off_by_one_ulp) and differs.on is False
    assert Compiled(osc_kernel(), [0, 1], [0, 1]).on is False


def test_a_controller_numba_cannot_build_leaves_the_numpy_arithmetic_with_one_warning(monkeypatch):
    from ebrl.envs import fast_kernels

    def untypable() -> tuple:
        raise TypeError("no such signature\nand more lines")

    monkeypatch.setattr(fast_kernels, "_warm_up_inputs", untypable)
    fast_kernels.osc_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"compiled controller is off \(TypeError: no such signature\); its numpy"):
            assert fast_kernels.osc_kernel() is None
    finally:
        fast_kernels.osc_kernel.cache_clear()


def test_cameras_sample_where_the_stock_step_samples_them():
    make = lambda fast: RobosuiteEnv("Lift", cameras=["agentview"], image_size=32, fast_step=fast, seed=0)
    fast, stock = make(True), make(False)
    fast.render_every_step = stock.render_every_step = True
    assert_identical(trajectory(fast, fast.env.sim, 8, seeds=(2,)), trajectory(stock, stock.env.sim, 8, seeds=(2,)))
    assert fast.gate.frames == stock.gate.frames > 0


def test_what_it_does_not_cover_runs_the_stock_step_and_says_why():
    import robosuite
    from robosuite.controllers import load_composite_controller_config

    from ebrl.envs.fast_step import fast_or_stock, fast_step_for

    config = load_composite_controller_config(controller="BASIC", robot="Panda")
    config["body_parts"]["right"]["interpolation"] = "linear"
    interpolated = robosuite.make(
        "Lift",
        robots="Panda",
        controller_configs=config,
        has_renderer=False,
        has_offscreen_renderer=False,
        use_camera_obs=False,
    )
    step, why = fast_step_for(interpolated)
    assert step is None and why == "right: an interpolator"
    assert fast_or_stock(interpolated, True) == (interpolated.step, "right: an interpolator")


LIBERO = benchmark_python("libero")


@pytest.mark.skipif(LIBERO is None, reason=f"no LIBERO venv: run `{SETUP_COMMAND.format(name='libero')}`")
def test_libero_fast_step_is_the_stock_step_bit_for_bit():
    """Two tasks of two suites under robosuite 1.4, in LIBERO's interpreter: each reset's settling steps too."""
    out = run_in_interpreter(
        LIBERO,
        """
import json
from ebrl.envs.libero_env import LiberoEnv
from tests.envs.common import assert_identical, trajectory
offs = []
for suite, task in (("libero_spatial", "0"), ("libero_10", "3")):
    fast, stock = (LiberoEnv(task=task, suite=suite, fast_step=way, seed=0) for way in (True, False))
    offs.append(fast.fast_step_off)
    assert_identical(trajectory(fast, fast.env.env.sim, 25), trajectory(stock, stock.env.env.sim, 25))
print(json.dumps({"offs": offs}))
""",
    )
    assert out["offs"] == ["", ""]  # the fast step ran (and equalled the stock one: the code asserts it)


ROBOCASA = benchmark_python("robocasa")


@pytest.mark.skipif(ROBOCASA is None, reason=f"no RoboCasa venv: run `{SETUP_COMMAND.format(name='robocasa')}`")
def test_robocasa_robot_fast_step_is_the_stock_step_bit_for_bit():
    """RoboCasa's PandaOmron under its hybrid mobile-base controller (OSC arm, gripper, joint-velocity base, torso),
    in RoboCasa's interpreter (its robosuite 1.5.2 fork), on robosuite's Lift: a kitchen needs the 10 GB of assets
    this machine does not have; the kitchens' step, _pre_action and observables are robosuite's own."""
    out = run_in_interpreter(
        ROBOCASA,
        """
import json
import numpy as np
import robosuite
from robosuite.controllers import load_composite_controller_config
from ebrl.envs.fast_step import fast_step_for
from tests.envs.common import assert_identical

def make():
    return robosuite.make("Lift", robots="PandaOmron", has_renderer=False, has_offscreen_renderer=False,
                          controller_configs=load_composite_controller_config(controller=None, robot="PandaOmron"),
                          use_camera_obs=False, ignore_done=True, hard_reset=False, seed=0)

def run(env, step):
    out = []
    for seed in (5, 6):
        env.rng = np.random.default_rng(seed)
        out.append(env.reset())
        for action in np.random.default_rng(seed).uniform(-1, 1, (30, env.action_dim)):
            obs, reward, done, info = step(action.copy())  # (the base's set_goal rotates the action in place)
            out.append((obs, reward, env._check_success(), np.array(env.sim.data.qpos), np.array(env.sim.data.qvel)))
    return out

fast, stock = make(), make()
step, why = fast_step_for(fast)
assert_identical(run(fast, step), run(stock, stock.step))
print(json.dumps({"why": why, "parts": sorted(fast.robots[0].composite_controller.part_controllers)}))
""",
    )
    assert out == {"why": "", "parts": ["base", "right", "right_gripper", "torso"]}


@pytest.mark.parametrize("task", ["PushCube-v1", "PickCube-v1"])
def test_maniskill_fast_action_is_the_stock_step_bit_for_bit(task):
    """pd_ee_delta_pose on the CPU backend. Actions in +-1.6 go past the clip and past a rotation of norm 1 (the
    controller's two branches); every articulation's and actor's pose, velocity and drive targets are compared."""
    from ebrl.envs.maniskill_env import ManiSkillEnv

    def state(env):
        px = env.env.unwrapped.scene.px

        def arrays():
            bodies = px.get_articulation_link_components() + px.get_rigid_dynamic_components()
            robots = {id(link.articulation): link.articulation for link in px.get_articulation_link_components()}
            out = [x for b in bodies for x in (b.entity_pose.p, b.entity_pose.q, b.linear_velocity, b.angular_velocity)]
            for robot in robots.values():
                out += [robot.qpos, robot.qvel, *(joint.drive_target for joint in robot.active_joints)]
            return out

        return arrays

    fast, stock = (ManiSkillEnv(task, max_episode_steps=1000, fast_step=way, seed=0) for way in (True, False))
    assert fast.fast_step_off == "" and stock.fast_step_off == "env.fast_step=false"
    assert_identical(trajectory(fast, state(fast), 40, scale=1.6), trajectory(stock, state(stock), 40, scale=1.6))


def test_maniskill_fast_action_sets_the_stock_drive_targets_over_many_states_and_actions():
    """The action alone, 600 times from 12 states of a moving arm: the drive targets and the controller's target
    pose and joint targets bit for bit."""
    import torch

    from ebrl.envs.maniskill_env import ManiSkillEnv
    from ebrl.envs.maniskill_fast import FastAction

    env = ManiSkillEnv("PickCube-v1", max_episode_steps=1000, fast_step=False, seed=0)
    agent = env.env.unwrapped.agent
    fast, robot = FastAction(env.env.unwrapped), agent.robot._objs[0]
    rng = np.random.default_rng(0)
    for _ in range(12):
        env.step(rng.uniform(-1, 1, 7))  # (the stock step: a new state)
        for action in torch.from_numpy(rng.uniform(-1.6, 1.6, (50, 1, 7)).astype(np.float32)):
            results = []
            for set_action in (agent.controller.set_action, fast):
                set_action(action)
                arm = agent.controller.controllers["arm"]
                results.append(
                    (
                        np.array([j.drive_target for j in robot.active_joints]),
                        arm._target_pose.raw_pose.numpy().copy(),
                        arm._target_qpos.numpy().copy(),
                    )
                )
            assert_identical([results[1]], [results[0]])


def test_maniskill_rotation_quaternions_are_the_stock_ones_over_20000_rotations():
    """The action's rotation as a quaternion, the one place a square root enters: torch's float32 sqrt differs from
    a correctly rounded one for about 1 in 1,000 inputs, which 20,000 rotations meet (ManiSkill's batched call as the
    reference, its elementwise kernels checked against single calls on the first 200)."""
    import torch
    from mani_skill.utils.geometry.rotation_conversions import (
        _sqrt_positive_part,
        euler_angles_to_matrix,
        matrix_to_quaternion,
    )

    from ebrl.envs.maniskill_fast import _quaternion

    angles = torch.from_numpy(np.random.default_rng(0).uniform(-0.1, 0.1, (20000, 3)).astype(np.float32))
    matrices = euler_angles_to_matrix(angles, "XYZ")
    stock = matrix_to_quaternion(matrices).numpy()
    assert np.array_equal(stock[:200], np.concatenate([matrix_to_quaternion(m[None]).numpy() for m in matrices[:200]]))
    ours = np.array([_quaternion(m, _sqrt_positive_part) for m in matrices.numpy()], np.float32)
    assert np.array_equal(ours, stock)


def test_maniskill_controllers_it_does_not_cover_run_the_stock_action_and_say_why():
    from ebrl.envs.maniskill_env import ManiSkillEnv

    env = ManiSkillEnv("PushCube-v1", control_mode="pd_joint_delta_pos", seed=0)
    assert env.fast_step_off == "arm controller PDJointPosController with this configuration"
    assert "set_action" not in vars(env.env.unwrapped.agent)  # the agent's own method runs
