"""ManiSkill's `pd_ee_delta_pose` action on the CPU backend without the torch around it, giving the same trajectories.

Of a stock PushCube-v1 control step (2.1 ms here, of which PhysX 0.25 ms), 1.3 ms is the arm controller's
`set_action`: on one env, ManiSkill's batched pose code runs about 400 small torch operations (eleven quaternion
products, each two `unbind`s, 28 arithmetic ops and a `stack`; the end effector's pose in the base frame computed twice,
once for an argument the CPU solver does not read), for 80 us of pinocchio IK. `FastAction` replaces the agent's
`set_action` and computes the same float32 values with numpy: each +, -, * and / in the stock order on float32
operands (IEEE rounds each one alike in torch and numpy), torch kept for everything else (the Euler angles' matrix:
cosines, sines, matmul; the rotation's norm; the square roots, where torch and numpy differ in the last bit), the
same pinocchio call with the same arguments, and the
same drive targets set on the same PhysX joints. The controllers' attributes (`_start_qpos`, `_target_pose`,
`_target_qpos`, `_step`) are left as the stock `set_action` leaves them. Task code (evaluation, reward, observation)
and the physics run stock.

Covered: one env on the CPU backend, a `CombinedController` of ManiSkill's `PDEEPoseController` (delta pose, the
root-translation/root-aligned-rotation frame, no target, no interpolation, normalised actions, the CPU solver) and a
`PDJointPosMimicController` gripper (absolute, normalised), the Panda's `pd_ee_delta_pose`. Anything else runs the
stock code, and `fast_action_for` says why. tests/envs/test_fast_step.py checks qpos, qvel, observations, rewards and
success bit for bit against the stock step in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import sapien
import torch
from mani_skill.utils.geometry.rotation_conversions import _sqrt_positive_part, euler_angles_to_matrix
from mani_skill.utils.structs import Pose

F32 = np.float32
ONE, HALF, TWO, FLOOR = F32(1.0), F32(0.5), F32(2.0), F32(0.1)


def _mul(a: Any, b: Any) -> tuple:
    """ManiSkill's `quaternion_raw_multiply` on float32 scalars, term for term."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return (
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    )


def _standard(q: tuple) -> tuple:
    """`standardize_quaternion`: the real part made non-negative."""
    return tuple(-x for x in q) if q[0] < 0 else q


def _apply(q: tuple, p: Any) -> tuple:
    """`quaternion_apply`: q (0, p) q^-1, the inverse as q times (1, -1, -1, -1)."""
    inverse = (q[0] * ONE, -q[1], -q[2], -q[3])
    return _mul(_mul(q, (F32(0.0), p[0], p[1], p[2])), inverse)[1:]


def _quaternion(m: np.ndarray, sqrt_positive: Callable) -> tuple:
    """`matrix_to_quaternion` of one 3x3 float32 matrix, the best-conditioned candidate as the stock picks it; the
    square roots by ManiSkill's `_sqrt_positive_part` (torch's float32 sqrt is not numpy's: 1.9995124 against
    1.9995126 for 3.9980502, a case a run met)."""
    m00, m01, m02, m10, m11, m12, m20, m21, m22 = m.reshape(9)
    squares = np.array([ONE + m00 + m11 + m22, ONE + m00 - m11 - m22, ONE - m00 + m11 - m22, ONE - m00 - m11 + m22])
    q_abs = sqrt_positive(torch.from_numpy(squares)).numpy()
    best = int(np.argmax(q_abs))
    row = (
        (q_abs[0] * q_abs[0], m21 - m12, m02 - m20, m10 - m01),
        (m21 - m12, q_abs[1] * q_abs[1], m10 + m01, m02 + m20),
        (m02 - m20, m10 + m01, q_abs[2] * q_abs[2], m12 + m21),
        (m10 - m01, m20 + m02, m21 + m12, q_abs[3] * q_abs[3]),
    )[best]
    denominator = TWO * max(q_abs[best], FLOOR)
    return _standard(tuple(x / denominator for x in row))


def _scaled(action: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """`gym_utils.clip_and_scale_action`: 0.5 (high + low) + 0.5 (high - low) clip(action, -1, 1)."""
    return HALF * (high + low) + HALF * (high - low) * np.clip(action, F32(-1.0), ONE)


@dataclass(frozen=True)
class _Ik:
    """The arm's pinocchio IK call and the indices it takes (ManiSkill's `Kinematics`, CPU path)."""

    solve: Callable
    link: int
    mask: Any
    active: np.ndarray  # the articulation's joints the model has, in its order
    controlled: np.ndarray  # the result's joints the arm drives


class _Arm:
    """The arm's `PDEEPoseController.set_action`: the stock float32 values (module docstring)."""

    def __init__(self, controller: Any, span: slice) -> None:
        self.c, self.span = controller, span
        self.ee = controller.ee_link._objs[0]  # noqa: SLF001  (the one env's PhysX link)
        self.root = controller.root_link._objs[0]  # noqa: SLF001
        self.index = controller.active_joint_indices.numpy()
        self.low, self.high = controller.action_space_low.numpy(), controller.action_space_high.numpy()
        self.rot_scale = F32(controller.config.rot_lower)
        self.joints = [j._objs[0] for j in controller.joints]  # noqa: SLF001
        k = controller.kinematics
        self.ik = _Ik(
            k.pmodel.compute_inverse_kinematics,
            k.end_link_idx,
            k.qmask,
            k.pmodel_active_joint_indices.numpy(),
            k.pmodel_controlled_joint_indices.numpy(),
        )

    def __call__(self, values: np.ndarray, qpos: np.ndarray) -> None:
        action = values[self.span]
        position = _scaled(action[:3], self.low[:3], self.high[:3])
        rotation = action[3:].copy()
        norm = torch.linalg.norm(torch.from_numpy(rotation)[None], axis=1)  # (torch's reduction order)
        if norm[0] > 1:
            rotation = rotation * (ONE / norm.numpy())  # `1 / t` is torch's reciprocal, times 1
        rotation = rotation * self.rot_scale
        start = qpos[self.index]

        root, ee = self.root.entity_pose, self.ee.entity_pose
        root_q = tuple(root.q.astype(F32))
        inverse_q = (root_q[0], -root_q[1], -root_q[2], -root_q[3])  # Pose.inv
        inverse_p = _apply(inverse_q, -root.p.astype(F32))
        base_q = _standard(_mul(inverse_q, tuple(ee.q.astype(F32))))  # Pose.__mul__: the ee in the base frame
        base_p = np.array(inverse_p, F32) + np.array(_apply(inverse_q, ee.p.astype(F32)), F32)

        # the rotation's matrix by torch (its cos, sin and matmul round as the stock's)
        matrix = euler_angles_to_matrix(torch.from_numpy(rotation)[None], "XYZ").numpy()[0]
        target_q = np.array(_standard(_mul(_quaternion(matrix, _sqrt_positive_part), base_q)), F32)
        target_p = base_p + position
        target = np.concatenate([target_p, target_q])

        ik = self.ik
        result, success, _ = ik.solve(
            ik.link,
            sapien.Pose(target_p, target_q),
            initial_qpos=qpos[ik.active],
            active_qmask=ik.mask,
            max_iterations=100,
        )
        target_qpos = result[ik.controlled].astype(F32) if success else start
        for i, joint in enumerate(self.joints):
            joint.drive_target = target_qpos[i : i + 1]
        c = self.c  # what the stock set_action leaves on the controller
        c._step = 0  # noqa: SLF001
        c._start_qpos = torch.from_numpy(start[None])  # noqa: SLF001
        c._target_pose = Pose(raw_pose=torch.from_numpy(target[None]))  # noqa: SLF001
        c._target_qpos = torch.from_numpy(np.array(target_qpos[None]))  # noqa: SLF001


class _Gripper:
    """The gripper's `PDJointPosMimicController.set_action` (absolute, normalised)."""

    def __init__(self, controller: Any, span: slice) -> None:
        self.c, self.span = controller, span
        self.index = controller.active_joint_indices.numpy()
        self.low, self.high = controller.action_space_low.numpy(), controller.action_space_high.numpy()
        self.control = controller.control_joint_indices.numpy()
        self.mimic = controller.mimic_joint_indices.numpy()
        self.mimic_control = controller.mimic_control_joint_indices.numpy()
        self.multiplier = controller._multiplier.numpy()  # noqa: SLF001
        self.offset = controller._offset.numpy()  # noqa: SLF001
        self.joints = [j._objs[0] for j in controller.joints]  # noqa: SLF001

    def __call__(self, values: np.ndarray, qpos: np.ndarray) -> None:
        c = self.c
        c._step = 0  # noqa: SLF001
        c._start_qpos = torch.from_numpy(qpos[self.index][None])  # noqa: SLF001
        target = c._target_qpos.numpy()[0]  # noqa: SLF001  (written in place, as the stock does)
        target[self.control] = _scaled(values[self.span], self.low, self.high)
        target[self.mimic] = target[self.mimic_control] * self.multiplier + self.offset
        for i, joint in enumerate(self.joints):
            joint.drive_target = target[i : i + 1]


class FastAction:
    """`agent.set_action` for the covered controllers: the stock float32 values with numpy's small-array speed."""

    def __init__(self, env: Any) -> None:
        self.agent = env.agent
        controller = self.agent.controller
        self.parts = [
            cls(controller.controllers[uid], slice(*controller.action_mapping[uid]))
            for cls, uid in ((_Arm, "arm"), (_Gripper, "gripper"))
        ]
        self.robot = controller.controllers["arm"].articulation._objs[0]  # noqa: SLF001  (the one env's)

    def __call__(self, action: torch.Tensor) -> None:
        if np.isnan(action).any():  # (BaseAgent.set_action's check, its message)
            raise ValueError("Action cannot be NaN. Environment received:", action)
        values, qpos = action.numpy()[0], self.robot.qpos
        for part in self.parts:  # (the stock order: the arm, then the gripper)
            part(values, qpos)


def fast_action_for(env: Any) -> tuple[Callable[[torch.Tensor], None] | None, str]:
    """The env's fast `agent.set_action` and "", or None and why the stock one runs."""
    from mani_skill.agents.base_agent import BaseAgent
    from mani_skill.agents.controllers.base_controller import CombinedController
    from mani_skill.agents.controllers.pd_ee_pose import PDEEPoseController
    from mani_skill.agents.controllers.pd_joint_pos import PDJointPosMimicController

    agent = getattr(env, "agent", None)
    controller = getattr(agent, "controller", None)
    if env.gpu_sim_enabled or env.num_envs != 1:
        return None, "GPU simulation or more than one env per process"
    if not isinstance(agent, BaseAgent) or type(agent).set_action is not BaseAgent.set_action:
        return None, f"agent {type(agent).__name__} sets actions its own way"
    if type(controller) is not CombinedController or set(controller.controllers) != {"arm", "gripper"}:
        return None, f"control mode {getattr(agent, 'control_mode', None)!r} (covered: pd_ee_delta_pose, arm + gripper)"
    arm, gripper = controller.controllers["arm"], controller.controllers["gripper"]
    a = arm.config
    if type(arm) is not PDEEPoseController or not (
        a.use_delta
        and not a.use_target
        and not a.interpolate
        and a.normalize_action
        and a.frame == "root_translation:root_aligned_body_rotation"
        and not arm.kinematics.use_gpu_ik
    ):
        return None, f"arm controller {type(arm).__name__} with this configuration"
    g = gripper.config
    if (
        type(gripper) is not PDJointPosMimicController
        or g.use_delta
        or g.use_target
        or g.interpolate
        or not g.normalize_action
    ):
        return None, f"gripper controller {type(gripper).__name__} with this configuration"
    return FastAction(env), ""
