"""Under the dense (shaped) reward, succeeding is worth more than hovering just short of success: the real simulators'
rewards, driven by the scripted expert, as the run's config builds them (docs/use/environments.md, "Dense reward and
success")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ebrl.bench.phases import LiftProbe, phases_of
from ebrl.envs.experts import Arm, LiftExpert, RobosuiteArm, Waypoint, WaypointExpert, above, make_expert
from ebrl.envs.process import build_adapter
from ebrl.envs.robosuite_env import GRASPS, RobosuiteEnv
from ebrl.policies.openpi import PRESETS
from ebrl.rl.ppo import compute_gae
from tests.conftest import compose_config


def expert_episode(env: str) -> tuple[list[float], list[bool], bool, int, int, float]:
    """The scripted expert's episode in the adapter `env=<env> env.reward=dense` builds: each step's reward and
    success, whether the episode ended by the task (not its step limit), the step limit, the actions per chunk
    (the default policy's) and the discount per chunk."""
    cfg = compose_config(f"env={env}", "env.reward=dense", "env.num_envs=1")
    adapter = build_adapter(OmegaConf.to_container(cfg.env, resolve=True), seed=0)
    try:
        adapter.begin_episode(seed=0)
        expert = make_expert(cfg.env.name, cfg.env.task, adapter)
        rewards, successes = [], []
        while True:
            _, result = adapter.run_chunk(expert.act()[None])
            rewards.append(float(result.rewards[0]))
            successes.append(bool(result.successes[0]))
            if result.done:
                return (
                    rewards,
                    successes,
                    result.terminated,
                    adapter.spec.max_episode_steps,
                    PRESETS[cfg.policy.preset].chunk,
                    cfg.algo.gamma,
                )
    finally:
        adapter.close()


def discounted_return(rewards: list[float], terminated: bool, chunk: int, gamma: float, bootstrap: bool) -> float:
    """The return of an episode's first chunk step, as GAE takes it (lambda 1, no critic along the way). An episode
    cut off by its step limit is bootstrapped (with `bootstrap`) from the value of staying as its last step was: its
    reward at every step from then on."""
    per_chunk = torch.tensor([sum(rewards[i : i + chunk]) for i in range(0, len(rewards), chunk)]).view(-1, 1)
    T = per_chunk.shape[0]
    done = torch.zeros(T, 1, dtype=torch.bool)
    done[-1] = True
    cutoff = torch.zeros(T, 1)
    if not terminated:
        cutoff[-1] = rewards[-1] * chunk / (1.0 - gamma)
    _, ret = compute_gae(per_chunk, torch.zeros(T, 1), done, torch.zeros(1), gamma, 1.0, cutoff if bootstrap else None)
    return float(ret[0, 0])


@pytest.mark.parametrize("env", ["robosuite", "maniskill"])
def test_succeeding_is_worth_more_than_hovering_short_of_success(env):
    rewards, successes, terminated, limit, chunk, gamma = expert_episode(env)
    first = successes.index(True)  # (the expert succeeds)
    # the same episode, except that instead of succeeding it stays at its best reward short of success to the limit
    hover = rewards[:first] + [max(rewards[:first])] * (limit - first)
    for bootstrap in (False, True):
        succeeded = discounted_return(rewards, terminated, chunk, gamma, bootstrap)
        hovered = discounted_return(hover, False, chunk, gamma, bootstrap)
        assert succeeded >= hovered, (env, bootstrap, succeeded, hovered, np.round(rewards, 3).tolist())


class Press(WaypointExpert):
    """Lift's expert with its fingers closed from the start: down onto the cube's top, held there, then up."""

    def __init__(self, arm: Arm, action_dim: int) -> None:
        self.waypoints = [
            Waypoint(above("cube", 0.06), "closed", 0.015),
            Waypoint(above("cube", 0.0), "closed", None, hold=10),
            Waypoint(above("cube", 0.2), "closed", None),
        ]
        super().__init__(arm, action_dim)


def test_closed_fingers_pressed_on_the_cube_are_a_grasp_to_robosuite_and_no_squeeze():
    """robosuite's grasp check (both finger pads touch the cube) holds for closed fingers pressed on Lift's cube, so
    its shaped reward pays them the grasp term; under env.grasp=squeeze it does not, and a cube over the success height
    that nothing holds (as one pressed into the table springs up when let go) is no success there. The expert's grasp,
    which squeezes the cube between the pads, and its lift are paid the same under both."""
    returns = {}
    for grasp in GRASPS:
        adapter = RobosuiteEnv("Lift", max_episode_steps=40, reward="dense", terminate_on_success=False, grasp=grasp)
        try:
            for kind in (Press, LiftExpert):
                adapter.reset(seed=0)
                expert, probe = kind(RobosuiteArm(adapter), adapter.spec.action_dim), LiftProbe(adapter)
                rewards, trace = [], []
                for _ in range(40):
                    rewards.append(adapter.step(expert.act())[1])
                    trace.append(probe.read())
                returns[grasp, kind] = sum(rewards)
                phases = phases_of(trace)
                if kind is Press:
                    touched = int(sum(r["touching"] for r in trace))
                    assert touched >= 4 and phases["touched"] and not phases["squeezed"] and not phases["raised"]
                    assert all(r["pad_separation"] < 0.02 for r in trace if r["touching"])  # fingers closed
                else:
                    assert all(phases.values())
            env = adapter.env  # the cube put 5 cm up, the gripper far from it
            adapter.reset(seed=0)
            pose = np.array(env.sim.data.get_joint_qpos(env.cube.joints[0]))
            env.sim.data.set_joint_qpos(env.cube.joints[0], pose + np.array([0, 0, 0.05, 0, 0, 0, 0]))
            env.sim.forward()
            assert type(env)._check_success(env) and env._check_success() == (grasp == "contact")
        finally:
            adapter.close()
    assert returns["contact", Press] - returns["squeeze", Press] == pytest.approx(touched * 0.25 / 2.25, abs=1e-9)
    assert returns["contact", LiftExpert] == returns["squeeze", LiftExpert]
