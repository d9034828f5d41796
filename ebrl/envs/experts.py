"""Scripted experts that record demonstrations (`python -m ebrl.demos record`; docs/internals/design.md,
"Demonstrations, SFT, RL").

An expert reads its simulator's state (privileged: the object poses a policy sees only through its observation) and
returns one action at a time in the adapter's own action space, the one RL trains in: robosuite's OSC_POSE and
ManiSkill's pd_ee_delta_pose (delta end-effector position, delta rotation, gripper). Each is a list of waypoints for
the end effector, followed by a proportional controller; a waypoint is left once the end effector is within its
tolerance of it (or after it held for its steps, or at its time limit). Numpy and the simulator only, like the
adapters.

ManiSkill ships motion-planning solutions for its tasks; they act in pd_joint_pos (absolute joint targets), which a
policy then RL-trained in the adapter's pd_ee_delta_pose could not replay, so these experts are written on the
end-effector controller for both simulators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ebrl.envs.base import EnvAdapter, EnvSetupError


class Arm:
    """How an expert moves one simulator's end effector and reads object positions."""

    reach: float  # metres the position target moves for an action of 1
    open: float  # gripper action that opens, and the one that closes
    closed: float

    def __init__(self, adapter: EnvAdapter) -> None:
        self.adapter = adapter

    def eef(self) -> np.ndarray:
        raise NotImplementedError

    def position(self, name: str) -> np.ndarray:
        """The position (3,) of the task's object `name` (a body or actor of the simulator)."""
        raise NotImplementedError


class RobosuiteArm(Arm):
    """robosuite 1.5's OSC_POSE (delta mode): an action of 1 moves the target 0.05 m; gripper 1 closes."""

    reach, open, closed = 0.05, -1.0, 1.0

    def eef(self) -> np.ndarray:
        env = self.adapter.env
        return np.array(env.sim.data.site_xpos[env.robots[0].eef_site_id["right"]])

    def position(self, name: str) -> np.ndarray:
        env = self.adapter.env
        return np.array(env.sim.data.body_xpos[getattr(env, f"{name}_body_id")])


class ManiSkillArm(Arm):
    """ManiSkill 3's pd_ee_delta_pose: an action of 1 moves the TCP 0.1 m; gripper -1 closes (to -0.01), 1 opens."""

    reach, open, closed = 0.1, 1.0, -1.0

    @staticmethod
    def _p(actor: Any) -> np.ndarray:
        p = actor.pose.p
        return np.asarray(p.cpu().numpy() if hasattr(p, "cpu") else p, np.float64).reshape(-1, 3)[0]

    def eef(self) -> np.ndarray:
        return self._p(self.adapter.env.unwrapped.agent.tcp)

    def position(self, name: str) -> np.ndarray:
        return self._p(getattr(self.adapter.env.unwrapped, name))


@dataclass(frozen=True)
class Waypoint:
    """Where the end effector goes next, with the gripper open or closed on the way."""

    target: Callable[[Arm], np.ndarray]
    grip: str  # open | closed
    tolerance: float | None = 0.01  # metres: reached once this close; None: stay for `hold` steps
    hold: int = 0  # steps to stay (closing a gripper); with no tolerance and no hold: until the episode ends
    limit: int = 40  # steps before it is left anyway (an expert that cannot get there goes on)


def above(name: str, dz: float, dx: float = 0.0) -> Callable[[Arm], np.ndarray]:
    """The position of object `name` offset by (dx, 0, dz)."""
    return lambda arm: arm.position(name) + np.array([dx, 0.0, dz])


class WaypointExpert:
    """Follows its waypoints with a proportional controller on the end-effector position (rotation held)."""

    waypoints: list[Waypoint]
    gain = 1.5  # of the position error, in units of the arm's reach per action

    def __init__(self, arm: Arm, action_dim: int) -> None:
        self.arm, self.action_dim = arm, action_dim
        self.reset()

    def reset(self) -> None:
        """A new episode: the first waypoint."""
        self.index, self.steps = 0, 0

    @property
    def done(self) -> bool:
        return self.index >= len(self.waypoints)

    def act(self) -> np.ndarray:
        """The action for the simulator's current state (float32, in [-1, 1])."""
        eef = self.arm.eef()
        while not self.done:
            w = self.waypoints[self.index]
            reached = w.tolerance is not None and np.linalg.norm(w.target(self.arm) - eef) < w.tolerance
            if reached or (w.hold and self.steps >= w.hold) or self.steps >= w.limit:
                self.index, self.steps = self.index + 1, 0
                continue
            break
        w = self.waypoints[min(self.index, len(self.waypoints) - 1)]
        self.steps += 1
        action = np.zeros(self.action_dim, np.float32)
        action[:3] = np.clip(self.gain * (w.target(self.arm) - eef) / self.arm.reach, -1.0, 1.0)
        action[-1] = self.arm.open if w.grip == "open" else self.arm.closed
        return action


class LiftExpert(WaypointExpert):
    """robosuite Lift: above the cube, down to it, close, lift."""

    def __init__(self, arm: Arm, action_dim: int) -> None:
        self.waypoints = [
            Waypoint(above("cube", 0.06), "open", 0.015),
            Waypoint(above("cube", 0.0), "open"),
            Waypoint(above("cube", 0.0), "closed", None, hold=4),
            Waypoint(above("cube", 0.2), "closed", None),
        ]
        super().__init__(arm, action_dim)


class StackExpert(WaypointExpert):
    """robosuite Stack: pick the red cube (A, 2 cm) and set it on the green one (B, 2.5 cm), then let go."""

    def __init__(self, arm: Arm, action_dim: int) -> None:
        self.waypoints = [
            Waypoint(above("cubeA", 0.06), "open", 0.015),
            Waypoint(above("cubeA", 0.0), "open"),
            Waypoint(above("cubeA", 0.0), "closed", None, hold=4),
            Waypoint(lambda arm: np.r_[arm.eef()[:2], arm.position("cubeB")[2] + 0.1], "closed", 0.02),
            Waypoint(above("cubeB", 0.1), "closed", 0.01),
            Waypoint(above("cubeB", 0.05), "closed", 0.008),
            Waypoint(above("cubeB", 0.05), "open", None, hold=3),
            Waypoint(above("cubeB", 0.15), "open", None),
        ]
        super().__init__(arm, action_dim)


class PickCubeExpert(WaypointExpert):
    """ManiSkill PickCube-v1: above the cube, down, close, carry it to the goal and stay there (success needs the
    robot at rest)."""

    def __init__(self, arm: Arm, action_dim: int) -> None:
        goal = lambda arm: arm.position("goal_site")  # noqa: E731
        self.waypoints = [
            Waypoint(above("cube", 0.05), "open", 0.01),
            Waypoint(above("cube", 0.0), "open", 0.005),
            Waypoint(above("cube", 0.0), "closed", None, hold=5),
            Waypoint(goal, "closed", None),
        ]
        super().__init__(arm, action_dim)


class PushCubeExpert(WaypointExpert):
    """ManiSkill PushCube-v1: gripper closed, behind the cube (the goal lies along +x), down, push it to the goal."""

    def __init__(self, arm: Arm, action_dim: int) -> None:
        goal = lambda arm: arm.position("goal_region") + np.array([-0.05, 0.0, 0.0])  # noqa: E731
        self.waypoints = [
            Waypoint(above("obj", 0.05, dx=-0.05), "closed", 0.01),
            Waypoint(above("obj", 0.0, dx=-0.05), "closed", 0.005),
            Waypoint(lambda arm: np.r_[goal(arm)[:2], arm.position("obj")[2]], "closed", None),
        ]
        super().__init__(arm, action_dim)


# (env.name, env.task) -> the expert and the arm it drives
EXPERTS: dict[tuple[str, str], tuple[type[WaypointExpert], type[Arm]]] = {
    ("robosuite", "Lift"): (LiftExpert, RobosuiteArm),
    ("robosuite", "Stack"): (StackExpert, RobosuiteArm),
    ("maniskill", "PickCube-v1"): (PickCubeExpert, ManiSkillArm),
    ("maniskill", "PushCube-v1"): (PushCubeExpert, ManiSkillArm),
}


def expert_for(env_name: str, task: str) -> tuple[type[WaypointExpert], type[Arm]]:
    """The expert and arm classes of `env_name`'s `task`; one line naming the tasks that have one."""
    if (env_name, task) not in EXPERTS:
        have = ", ".join(f"env={e} env.task={t}" for e, t in EXPERTS)
        raise EnvSetupError(f"env={env_name} env.task={task} has no scripted expert; these have: {have}")
    return EXPERTS[(env_name, task)]


def make_expert(env_name: str, task: str, adapter: EnvAdapter) -> WaypointExpert:
    """The scripted expert of `env_name`'s `task`, driving this adapter."""
    expert, arm = expert_for(env_name, task)
    return expert(arm(adapter), adapter.spec.action_dim)
