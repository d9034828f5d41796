"""A robosuite-family control step without the Python around its physics, giving the same trajectories.

A stock control step runs 25 physics substeps (20 Hz control, 500 Hz physics), and at every substep robosuite's
controllers run in full: name lookups, property calls that build the action limits three times, the same base pose
read twice, a fresh Jacobian per quantity, every observable's timer, and in robosuite 1.4 (LIBERO) two `mj_forward`
calls besides `mj_step`. Only the first substep takes the policy's action (`policy_step`); the others recompute
torques from the same goal. `FastStep` runs the first substep with the stock sequence (robosuite 1.5's fixed-base
robots: the stock `set_goal` and proprioception arithmetic, the torques as below; else the stock code itself) and
the others with the stock arithmetic alone: the same MuJoCo functions, the same numpy operations in the same order on
arrays of the same memory layout, and robosuite's own numba kernels (`opspace_matrices`, `nullspace_torques`,
`orientation_error`), with site ids, index arrays, actuator bounds and the commands that are constant within a control
step looked up once;
`mj_step1` + `mj_step2` compute each physics stage once from the state the stock forwards recompute. The OSC
controller's arithmetic between policy steps runs as one compiled call (ebrl/envs/fast_kernels.py) where a
controller's first control step shows it gives the numpy calls' bits, and from then on the substeps between two
sensor samples run as one compiled loop (`osc_substeps`), the physics included. The observables' timers advance with
robosuite's own float operations and the sensors run at the substep where the stock code samples them, after the
controllers' state is written back as the stock code leaves it.

Covered: robosuite 1.5's fixed-base arms under the BASIC controller (OSC arm, simple gripper) and wheeled robots
under the hybrid mobile-base one (RoboCasa's PandaOmron: joint-velocity base, joint-position torso); robosuite 1.4's
single arm under OSC with its gripper, and LIBERO's step around it. A trajectory is bit for bit the stock one: qpos,
qvel, ctrl, observations, rewards and success at every control step, and on robosuite 1.5 every array the robot's
proprioception buffers and its controllers hold (tests/envs/test_fast_step.py runs both in one process, in each
benchmark's interpreter). An env it does not cover (another controller type, an interpolator, a
viewer, a task that overrides the step) gets `None` from `fast_step_for` with the reason, and runs the stock code.
`env.fast_step=false` runs the stock code everywhere.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mujoco
import numpy as np
from mujoco import mj_jacSite, mj_step1, mj_step2

from ebrl.envs.fast_kernels import Compiled, clock_address, mujoco_c, substeps_kernel

try:  # np.clip's own ufunc: what np.clip(a, low, high) computes, without the Python around it (about 1 us a call)
    from numpy._core.umath import clip as _clip  # numpy 2
except ImportError:
    from numpy.core.umath import clip as _clip

if hasattr(mujoco.MjData, "qM"):  # the dense mass matrix: MuJoCo < 3.4 reads qM, later ones the data

    def full_mass(m: Any, d: Any, out: np.ndarray) -> None:
        mujoco.mj_fullM(m, out, d.qM)
else:  # (as LIBERO-PRO's robosuite 1.4 bridge calls it under MuJoCo >= 3.4)

    def full_mass(m: Any, d: Any, out: np.ndarray) -> None:
        mujoco.mj_fullM(m, d, out)


@functools.cache
def _kernels() -> tuple[Callable, Callable, Callable]:
    """robosuite's own numba kernels: opspace_matrices, nullspace_torques, orientation_error."""
    from robosuite.utils.control_utils import nullspace_torques, opspace_matrices, orientation_error

    return opspace_matrices, nullspace_torques, orientation_error


def _osc_torques(
    c: Any,
    kernels: tuple,
    bias: np.ndarray,
    mass_matrix: np.ndarray,
    J_full: np.ndarray,
    J_pos: np.ndarray,
    J_ori: np.ndarray,
    desired_force: np.ndarray,
    desired_torque: np.ndarray,
    joint_pos: np.ndarray,
    joint_vel: np.ndarray,
) -> np.ndarray:
    """The end of an OSC controller's `run_controller` (robosuite 1.4 and 1.5 alike): the operational-space
    matrices, the (un)coupled wrench, J^T wrench plus gravity compensation (`bias`), plus the nullspace torques."""
    opspace, nullspace, _ = kernels
    lambda_full, lambda_pos, lambda_ori, nullspace_matrix = opspace(mass_matrix, J_full, J_pos, J_ori)
    if c.uncoupling:
        decoupled_wrench = np.concatenate([np.dot(lambda_pos, desired_force), np.dot(lambda_ori, desired_torque)])
    else:
        decoupled_wrench = np.dot(lambda_full, np.concatenate([desired_force, desired_torque]))
    torques = np.dot(J_full.T, decoupled_wrench) + bias
    torques += nullspace(mass_matrix, nullspace_matrix, c.initial_joint, joint_pos, joint_vel)
    return torques


def _method_owner(obj: Any, name: str) -> str:
    """`module.Class` that defines `name` for obj's class (to tell an override from the stock method)."""
    for cls in type(obj).__mro__:
        if name in vars(cls):
            return f"{cls.__module__}.{cls.__qualname__}"
    return ""


class _Osc:
    """A robosuite 1.5 OperationalSpaceController's `run_controller` between policy steps, ids looked up once; its
    arithmetic in one compiled call where that gives the numpy calls' bits (ebrl/envs/fast_kernels.py)."""

    def __init__(self, ctrl: Any, sim: Any) -> None:
        self.c = ctrl
        model = sim.model._model
        self.model, self.data = model, sim.data._data
        self.sites = (
            int(model.site(ctrl.ref_name).id),
            int(model.site(f"{ctrl.naming_prefix}{ctrl.part_name}_center").id),
        )  # reference, base
        nv = int(model.nv)
        self.full_mass = np.ndarray(shape=(nv, nv), dtype=np.float64, order="C")
        self.jac = [np.zeros((3, nv)) for _ in range(4)]  # (mj_jacSite zeroes what it fills)
        self.kernels = _kernels()
        self.compiled = Compiled.of(ctrl)

    def begin(self, action: np.ndarray) -> None:
        """The goal's constants for this control step (set_goal ran in the policy substep): kp, kd (pos, ori), and
        the compiled arithmetic's arguments."""
        c = self.c
        self.gains = (np.array(c.kp[0:3]), np.array(c.kp[3:6]), c.kd[0:3], c.kd[3:6])
        if self.compiled.on is not False:
            self.inputs = self.compiled.inputs(
                *self.jac,
                self.data,
                self.full_mass,
                *self.sites,
                c.input_ref_frame == "base",
                (c.goal_pos, c.goal_ori),
                self.gains,
                c.initial_joint,
                c.uncoupling,
            )

    def torques(self, keep: bool) -> np.ndarray:
        """`update_state()`, the stock `update()` (lite physics) and `run_controller()`'s arithmetic; with `keep`, the
        state the controller would hold afterwards, for `sync`."""
        m, d = self.model, self.data
        jacp, jacr, base_jacp, base_jacr = self.jac
        ref_id, base_id = self.sites
        mj_jacSite(m, d, jacp, jacr, ref_id)
        mj_jacSite(m, d, base_jacp, base_jacr, base_id)
        full_mass(m, d, self.full_mass)
        compiled = self.compiled
        if compiled.on is False:
            return self._numpy(keep)
        compiled.kernel(*self.inputs)
        if compiled.on is None:  # (the first substeps: both ways on the same state, the numpy results used)
            self._numpy(True)
            compiled.decide(self.state)
            return self.state[-1]
        if keep:
            self.state = compiled.state()
        return compiled.torques

    def _numpy(self, keep: bool) -> np.ndarray:
        """`torques`'s arithmetic in the stock numpy calls on arrays of the stock memory layout (numba compiles, and
        rounds, per layout), from the Jacobians and mass matrix `torques` computed."""
        c, d, qi = self.c, self.data, self.c.qvel_index
        qvel = d.qvel
        jacp, jacr, base_jacp, base_jacr = self.jac
        (ref_id, base_id), orientation_error = self.sites, self.kernels[2]
        kp_pos, kp_ori, kd_pos, kd_ori = self.gains
        origin_pos, origin_ori = d.site_xpos[base_id], d.site_xmat[base_id].reshape([3, 3])
        ref_pos, ref_ori_mat = d.site_xpos[ref_id], d.site_xmat[ref_id].reshape([3, 3])
        ref_pos_vel, ref_ori_vel = np.dot(jacp, qvel), np.dot(jacr, qvel)
        J_pos, J_ori = jacp.take(qi, axis=1), jacr.take(qi, axis=1)  # (C order, as the stock J_pos)
        J_full = np.concatenate((J_pos, J_ori))
        joint_pos, joint_vel = d.qpos[c.qpos_index], qvel[qi]
        mass_matrix = self.full_mass[qi, :][:, qi]  # (F order, as the stock one)
        if c.input_ref_frame == "base":
            desired_world_pos = origin_pos + np.dot(origin_ori, c.goal_pos)
            desired_world_ori = np.dot(origin_ori, c.goal_ori)
        else:
            desired_world_pos, desired_world_ori = c.goal_pos, c.goal_ori
        ori_error = orientation_error(desired_world_ori, ref_ori_mat)
        desired_force = (desired_world_pos - ref_pos) * kp_pos + (-(ref_pos_vel - np.dot(base_jacp, qvel))) * kd_pos
        desired_torque = ori_error * kp_ori + (-(ref_ori_vel - np.dot(base_jacr, qvel))) * kd_ori
        torques = _osc_torques(
            c,
            self.kernels,
            d.qfrc_bias[qi],
            mass_matrix,
            J_full,
            J_pos,
            J_ori,
            desired_force,
            desired_torque,
            joint_pos,
            joint_vel,
        )
        if keep:
            self.state = (
                np.array(ref_pos),
                np.array(ref_ori_mat),
                ref_pos_vel,
                ref_ori_vel,
                J_pos,
                J_ori,
                J_full,
                joint_pos,
                joint_vel,
                mass_matrix,
                np.array(origin_pos),
                np.array(origin_ori),
                torques,
            )
        return torques

    def kept(self, qpos: np.ndarray, qvel: np.ndarray) -> None:
        """The state after `osc_substeps`' last substep (qpos and qvel as that substep's `torques` read them)."""
        self.state = self.compiled.state()

    def sync(self) -> None:
        """Leave the controller as the stock code leaves it (arrays it updates in place stay the same objects)."""
        c = self.c
        (
            ref_pos,
            ref_ori_mat,
            ref_pos_vel,
            ref_ori_vel,
            J_pos,
            J_ori,
            J_full,
            c.joint_pos,
            c.joint_vel,
            c.mass_matrix,
            c.origin_pos,
            c.origin_ori,
            c.torques,
        ) = self.state
        c.ref_pos[:] = ref_pos
        c.ref_ori_mat[:, :] = ref_ori_mat
        c.ref_pos_vel[:] = ref_pos_vel
        c.ref_ori_vel[:] = ref_ori_vel
        c.J_pos[:, :] = J_pos
        c.J_ori[:, :] = J_ori
        c.J_full[:, :] = J_full
        c.new_update = True


class _Velocity:
    """A SimpleGripController or a mobile base's JointVelocityController between policy steps: the command they
    compute from the goal is constant within a control step; their joint state is read as their `update()` does."""

    def __init__(self, ctrl: Any, sim: Any) -> None:
        self.c, self.data = ctrl, sim.data._data
        self.scaled = getattr(ctrl, "use_action_scaling", True)  # (the mobile base always scales)

    def begin(self, action: np.ndarray) -> None:
        """`run_controller()`'s output for the goal the policy step set (the same arithmetic, once per step)."""
        c = self.c
        vels = np.array(c.goal_qvel)
        if self.scaled:
            ctrl_range = np.stack([c.actuator_min, c.actuator_max], axis=-1)
            bias = 0.5 * (ctrl_range[:, 1] + ctrl_range[:, 0])
            weight = 0.5 * (ctrl_range[:, 1] - ctrl_range[:, 0])
            vels = bias + weight * vels
        self.vels = vels

    def torques(self, keep: bool) -> np.ndarray:
        if keep:
            d, c = self.data, self.c
            self.state = (d.qpos[c.qpos_index], d.qvel[c.qvel_index])
        return self.vels

    def commands(self, n: int) -> np.ndarray:
        """Its command at each of the next `n` substeps (`osc_substeps`)."""
        return np.tile(self.vels, (n, 1))

    def kept(self, qpos: np.ndarray, qvel: np.ndarray) -> None:
        self.state = (qpos[self.c.qpos_index], qvel[self.c.qvel_index])

    def sync(self) -> None:
        c = self.c
        c.joint_pos, c.joint_vel = self.state
        c.vels = self.vels
        c.new_update = True


class _JointPosition:
    """A JointPositionController (RoboCasa's torso) between policy steps: its `update()` (no reference site) and
    `run_controller()`'s arithmetic."""

    def __init__(self, ctrl: Any, sim: Any) -> None:
        self.c = ctrl
        self.model, self.data = sim.model._model, sim.data._data
        nv = int(self.model.nv)
        self.full_mass = np.ndarray(shape=(nv, nv), dtype=np.float64, order="C")

    def begin(self, action: np.ndarray) -> None:
        c = self.c
        self.desired_qpos, self.kp = np.array(c.goal_qpos), np.array(c.kp)

    def torques(self, keep: bool) -> np.ndarray:
        c, d, qi = self.c, self.data, self.c.qvel_index
        joint_pos, joint_vel = d.qpos[c.qpos_index], d.qvel[qi]
        full_mass(self.model, d, self.full_mass)
        mass_matrix = self.full_mass[qi, :][:, qi]
        desired_torque = (self.desired_qpos - joint_pos) * self.kp + (-joint_vel) * c.kd
        if c.use_torque_compensation:
            torques = np.dot(mass_matrix, desired_torque) + d.qfrc_bias[qi]
        else:
            torques = desired_torque
        if keep:
            self.state = (joint_pos, joint_vel, mass_matrix, torques)
        return torques

    def sync(self) -> None:
        c = self.c
        c.joint_pos, c.joint_vel, c.mass_matrix, c.torques = self.state
        c.new_update = True


class _Osc14:
    """robosuite 1.4's (LIBERO's) OSC controller between policy steps, with the robot's torque clip. Its `update()`
    runs `sim.forward()` again on the state the env's forward just computed: the substep's `mj_step1` computes the
    same positions, velocities, Jacobians and mass matrix once (what the forwards add, actuation and the constraint
    forces of the old ctrl, `mj_step2` recomputes with the new one). Its arithmetic in one compiled call where that
    gives the numpy calls' bits (ebrl/envs/fast_kernels.py)."""

    def __init__(self, robot: Any, sim: Any) -> None:
        self.robot, self.c = robot, robot.controller
        model = sim.model._model
        self.model, self.data = model, sim.data._data
        self.eef_id = int(model.site(self.c.eef_name).id)
        self.jac = [np.zeros((3, int(model.nv))) for _ in range(2)]
        self.full_mass = np.ndarray(shape=(int(model.nv),) * 2, dtype=np.float64, order="C")
        self.kernels = _kernels()
        self.compiled = Compiled.of(self.c, jacobians="F")  # (the stock J_pos = np.array(jacp[:, qi]): F order)

    def begin(self, action: np.ndarray) -> None:
        """The goal's constants for this control step: the goal pose, kp, kd (pos, ori), and the compiled
        arithmetic's arguments."""
        c = self.c
        self.goal = (np.array(c.goal_pos), np.array(c.goal_ori))
        self.gains = (np.array(c.kp[0:3]), np.array(c.kp[3:6]), c.kd[0:3], c.kd[3:6])
        if self.compiled.on is not False:
            jacp, jacr = self.jac
            self.inputs = self.compiled.inputs(
                jacp,
                jacr,
                jacp,
                jacr,
                self.data,
                self.full_mass,
                self.eef_id,
                -1,
                False,
                self.goal,
                self.gains,
                c.initial_joint,
                c.uncoupling,
            )

    def torques(self, keep: bool) -> np.ndarray:
        """The stock `update()` after the forward and `run_controller()`."""
        m, d = self.model, self.data
        jacp, jacr = self.jac
        mj_jacSite(m, d, jacp, jacr, self.eef_id)
        full_mass(m, d, self.full_mass)
        compiled = self.compiled
        if compiled.on is False:
            return self._numpy(keep)
        compiled.kernel(*self.inputs)
        if compiled.on is None:  # (the first substeps: both ways on the same state, the numpy results used)
            self._numpy(True)
            compiled.decide(self._as_compiled(self.state))
            return self.state[-1]
        if keep:
            self.state = self._as_numpy(compiled.state())
        return compiled.torques

    def kept(self, qpos: np.ndarray, qvel: np.ndarray) -> None:
        self.state = self._as_numpy(self.compiled.state())

    @staticmethod
    def _as_compiled(state: tuple) -> tuple:
        """This controller's state in `osc_substep`'s order (the base frame's two left as they are)."""
        ee_pos, ee_ori_mat, ee_pos_vel, ee_ori_vel, joint_pos, joint_vel, J_pos, J_ori, J_full, mass, torques = state
        return (
            ee_pos,
            ee_ori_mat,
            ee_pos_vel,
            ee_ori_vel,
            J_pos,
            J_ori,
            J_full,
            joint_pos,
            joint_vel,
            mass,
            np.zeros(3),
            np.zeros((3, 3)),
            torques,
        )

    @staticmethod
    def _as_numpy(state: tuple) -> tuple:
        ee_pos, ee_ori_mat, ee_pos_vel, ee_ori_vel, J_pos, J_ori, J_full, joint_pos, joint_vel, mass, *_, tau = state
        return ee_pos, ee_ori_mat, ee_pos_vel, ee_ori_vel, joint_pos, joint_vel, J_pos, J_ori, J_full, mass, tau

    def _numpy(self, keep: bool) -> np.ndarray:
        """`torques`'s arithmetic in the stock numpy calls on arrays of the stock memory layout, from the Jacobian and
        mass matrix `torques` computed."""
        c, d, qi = self.c, self.data, self.c.qvel_index
        qvel = d.qvel
        jacp, jacr = self.jac
        (desired_pos, desired_ori), orientation_error = self.goal, self.kernels[2]
        kp_pos, kp_ori, kd_pos, kd_ori = self.gains
        ee_pos, ee_ori_mat = d.site_xpos[self.eef_id], d.site_xmat[self.eef_id].reshape([3, 3])
        ee_pos_vel, ee_ori_vel = np.dot(jacp, qvel), np.dot(jacr, qvel)
        joint_pos, joint_vel = d.qpos[c.qpos_index], qvel[qi]
        J_pos, J_ori = np.array(jacp[:, qi]), np.array(jacr[:, qi])
        J_full = np.array(np.vstack([J_pos, J_ori]))
        mass_matrix = self.full_mass[qi, :][:, qi]
        ori_error = orientation_error(desired_ori, ee_ori_mat)
        desired_force = (desired_pos - ee_pos) * kp_pos + (-ee_pos_vel) * kd_pos
        desired_torque = ori_error * kp_ori + (-ee_ori_vel) * kd_ori
        torques = _osc_torques(
            c,
            self.kernels,
            d.qfrc_bias[qi],
            mass_matrix,
            J_full,
            J_pos,
            J_ori,
            desired_force,
            desired_torque,
            joint_pos,
            joint_vel,
        )
        if keep:
            self.state = (
                np.array(ee_pos),
                np.array(ee_ori_mat),
                ee_pos_vel,
                ee_ori_vel,
                joint_pos,
                joint_vel,
                J_pos,
                J_ori,
                J_full,
                mass_matrix,
                torques,
            )
        return torques

    def sync(self) -> None:
        c = self.c
        (
            c.ee_pos,
            c.ee_ori_mat,
            c.ee_pos_vel,
            c.ee_ori_vel,
            c.joint_pos,
            c.joint_vel,
            c.J_pos,
            c.J_ori,
            c.J_full,
            c.mass_matrix,
            c.torques,
        ) = self.state
        self.robot.torques = self.applied
        c.new_update = True


class _Grip14:
    """robosuite 1.4's `grip_action`: the gripper's own `format_action` at each substep (Panda's ramps its command
    by a speed per call), scaled into the actuators' range."""

    def __init__(self, robot: Any, sim: Any) -> None:
        self.robot, self.gripper = robot, robot.gripper
        ids = [sim.model.actuator_name2id(actuator) for actuator in self.gripper.actuators]
        ctrl_range = sim.model.actuator_ctrlrange[ids]
        self.bias = 0.5 * (ctrl_range[:, 1] + ctrl_range[:, 0])
        self.weight = 0.5 * (ctrl_range[:, 1] - ctrl_range[:, 0])
        self.index = ids

    def begin(self, action: np.ndarray) -> None:
        self.action = action[self.robot.controller.control_dim :]

    def torques(self, keep: bool) -> np.ndarray:
        return self.bias + self.weight * self.gripper.format_action(self.action)

    def commands(self, n: int) -> np.ndarray:
        """Its command at each of the next `n` substeps (`osc_substeps`): the stock calls, which read no physics."""
        return np.array([self.torques(False) for _ in range(n)])

    def kept(self, qpos: np.ndarray, qvel: np.ndarray) -> None:
        pass

    def sync(self) -> None:
        pass


class _PolicySubstep:
    """`env._pre_action(action, policy_step=True)` for robosuite 1.5's fixed-base robot under the BASIC composite
    controller: RobotEnv's and FixedBaseRobot.control's stock sequence with the goal set by the stock `set_goal`, each
    part's `run_controller` as the other substeps run it (the workers, then `sync`), and the robot's proprioception
    buffers pushed with the stock arithmetic. What the stock code works out at every policy step (the action's
    dimension, from the action limits, twice; the force and torque sensors' slices) is looked up once, and the arm's
    `update()` before `set_goal` runs as the other substeps' compiled arithmetic. A controller whose state is
    not due an update (`new_update` false: the first policy step after a reset) runs its goal and torques from the
    state its last update left, so that step runs the stock code."""

    def __init__(self, env: Any, parts: list) -> None:
        from robosuite.utils.transform_utils import mat2quat

        robot, model = env.robots[0], env.sim.model
        self.env, self.mat2quat = env, mat2quat
        self.robot, self.parts, self.action_dim = robot, parts, env.action_dim
        self.data = env.sim.data._data

        def sensor(name: str) -> slice:  # (RobotEnv.get_sensor_measurement's slice of sensordata)
            i = model.sensor_name2id(name)
            start = np.sum(model.sensor_dim[:i])
            return slice(start, start + model.sensor_dim[i])

        self.arms = [
            (
                arm,
                robot.part_controllers[arm],
                *(sensor(robot.gripper[arm].important_sensors[name]) for name in ("force_ee", "torque_ee")),
            )
            for arm in robot.arms
        ]
        self.average = np.ones(10) / 10.0  # (the acceleration's moving average)

    def __call__(self, action: np.ndarray) -> None:
        if len(action) != self.action_dim:
            raise AssertionError(
                f"environment got invalid action dimension -- expected {self.action_dim}, got {len(action)}"
            )
        if not all(worker.c.new_update for worker, *_ in self.parts):
            self.env._pre_action(action, policy_step=True)
            for worker, *_ in self.parts:
                worker.begin(action)
            return
        robot, d, clip, mat2quat = self.robot, self.data, _clip, self.mat2quat
        composite = robot.composite_controller
        composite.update_state()
        for worker, *_ in self.parts:  # set_goal's own `update()` for the arm: its state as the other substeps get it
            if isinstance(worker, _Osc) and hasattr(worker, "inputs"):
                worker.torques(True)  # (and torques towards the last goal, which run_controller replaces below)
                worker.sync()
                worker.c.new_update = False
        composite.set_goal(action)
        composite.update_state()  # (run_controller's own: the same origin again)
        for worker, *_ in self.parts:
            worker.begin(action)
        for worker, index, low, high in self.parts:
            applied = worker.torques(True)
            if low is not None:
                applied = clip(applied, low, high)
            d.ctrl[index] = worker.applied = applied
            worker.sync()
        robot.recent_qpos.push(robot._joint_positions)
        robot.recent_actions.push(action)
        robot.recent_torques.push(robot.torques)
        for arm, c, force, torque in self.arms:
            robot.recent_ee_forcetorques[arm].push(
                np.concatenate((np.array(d.sensordata[force]), np.array(d.sensordata[torque])))
            )
            robot.recent_ee_pose[arm].push(np.concatenate((c.ref_pos, mat2quat(c.ref_ori_mat))))
            robot.recent_ee_vel[arm].push(np.concatenate((c.ref_pos_vel, c.ref_ori_vel)))
            robot.recent_ee_vel_buffer[arm].push(np.concatenate((c.ref_pos_vel, c.ref_ori_vel)))
            diffs = np.vstack(
                [
                    robot.recent_ee_acc[arm].current,
                    robot.control_freq * np.diff(robot.recent_ee_vel_buffer[arm].buf, axis=0),
                ]
            )
            robot.recent_ee_acc[arm].push(
                np.array([np.convolve(col, self.average, mode="valid")[0] for col in diffs.transpose()])
            )


class _Timers:
    """The env's observables' timers advanced as `Observable.update` does; the sensors run where it samples.

    Observables in the same timer state with no delay draw stay in lockstep, so one timer (robosuite's own float
    operations) stands for each group. Where a group samples or wraps, its members' own `update` runs, in the env's
    order (a sensor may read an earlier one's value). Whether a substep is one of those does not depend on the
    physics, so `due` tells it before the substep runs."""

    def __init__(self, env: Any) -> None:
        from robosuite.utils.observables import NO_DELAY

        self.env, self.no_delay = env, NO_DELAY

    def begin(self) -> None:
        groups: dict[tuple, list] = {}
        for i, obs in enumerate(self.env._observables.values()):
            if not obs._enabled:
                continue
            key = (obs._time_since_last_sample, obs._sampled, obs._sampling_timestep, obs._current_delay)
            if obs._delayer is not self.no_delay:
                key = key + (id(obs),)  # a delay drawn at each sample: its own timer
            groups.setdefault(key, []).append((i, obs))
        self.groups = [[*key[:4], members] for key, members in groups.items()]

    def due(self, dt: float) -> list:
        """The groups that sample or wrap at the next substep."""
        return [group for group in self.groups if self._samples(group, group[0] + dt)]

    @staticmethod
    def _samples(group: list, t: float) -> bool:
        _, sampled, period, delay, _ = group
        return (not sampled and period - delay >= t) or t >= period

    def quiet(self, dt: float, limit: int) -> int:
        """How many of the next substeps (at most `limit`) no group samples or wraps at; `skip` advances the timers
        over them."""
        times, n = [group[0] for group in self.groups], 0
        while n < limit:
            ahead = [t + dt for t in times]
            if any(self._samples(group, t) for group, t in zip(self.groups, ahead)):
                break
            times, n = ahead, n + 1
        self.ahead = times
        return n

    def skip(self) -> None:
        for group, t in zip(self.groups, self.ahead):
            group[0] = t

    def advance(self, dt: float, due: list) -> None:
        """One substep: the others' timers advance; the due groups' members update (the stock code)."""
        if not due:
            for group in self.groups:
                group[0] = group[0] + dt
            return
        for group in self.groups:
            if not any(group is g for g in due):
                group[0] = group[0] + dt
        members = sorted((i, obs, group) for group in due for i, obs in group[4])
        cache = self.env._obs_cache
        for _, obs, group in members:
            obs._time_since_last_sample, obs._sampled, obs._current_delay = group[0], group[1], group[3]
            obs.update(timestep=dt, obs_cache=cache)
        for group in due:
            obs = group[4][0][1]
            group[0], group[1], group[3] = obs._time_since_last_sample, obs._sampled, obs._current_delay

    def end(self) -> None:
        for t, sampled, _, delay, members in self.groups:
            for _, obs in members:
                obs._time_since_last_sample, obs._sampled, obs._current_delay = t, sampled, delay


class _Stretch:
    """What `osc_substeps` runs on for one sim and its controllers: one OSC arm, and the other parts, whose commands
    read no physics (`commands`)."""

    def __init__(self, kernel: Callable, model: Any, data: Any, arm: tuple, others: list) -> None:
        every = np.arange(model.nu, dtype=np.int64)
        (self.arm, index, low, high), self.others = arm, others
        self.kernel, self.ctrl = kernel, data.ctrl
        self.fixed = (
            model._address,
            data._address,  # (and mj_fullM's arguments after the model)
            (self.arm.full_mass.ctypes.data, data.qM.ctypes.data)
            if hasattr(data, "qM")
            else (data._address, self.arm.full_mass.ctypes.data),
        )
        self.outputs = (
            data.ctrl,
            every[index],
            np.ascontiguousarray(low, np.float64),
            np.ascontiguousarray(high, np.float64),
            np.concatenate([every[i] for _, i, *_ in others]) if others else every[:0],
        )
        self.kept = (np.zeros(model.nq), np.zeros(model.nv))  # qpos and qvel before the last substep's mj_step2
        self.no_time = np.zeros(1)

    @classmethod
    def of(cls, model: Any, data: Any, parts: list) -> "_Stretch | None":
        """For the fast step's `parts`, or None where `osc_substeps` does not cover them (or is not compiled)."""
        arms = [part for part in parts if isinstance(part[0], (_Osc, _Osc14))]
        others = [part for part in parts if not isinstance(part[0], (_Osc, _Osc14))]
        kernel = substeps_kernel() if len(arms) == 1 and all(hasattr(w, "commands") for w, *_ in others) else None
        return None if kernel is None else cls(kernel, model, data, arms[0], others)

    def run(self, n: int, workers: list) -> None:
        """`n` substeps; then each worker keeps the last one's state."""
        commands = [worker.commands(n) for worker, *_ in self.others]
        commands = [c if low is None else _clip(c, low, high) for c, (_, _, low, high) in zip(commands, self.others)]
        timed, kept = FastStep.physics_s, self.kept
        self.kernel(
            n,
            mujoco_c(),
            *self.fixed,
            *self.arm.inputs,
            *self.outputs,
            np.concatenate(commands, axis=1) if commands else np.zeros((n, 0)),
            *kept,
            0 if timed is None else clock_address(),
            self.no_time if timed is None else timed,
        )
        for worker in workers:
            worker.kept(*kept)
        self.arm.applied = self.ctrl[self.outputs[1]]


def _once_per_step(env: Any, staged_rewards: Callable[[], tuple]) -> Callable[[], tuple]:
    """A task's `staged_rewards` (robosuite's Stack, PickPlace, NutAssembly), which its reward and its success check
    both compute from the sim's state: once per state of the clocks (the control step, the physics' time: every
    substep moves it, a reset sets both back), its result returned again to the next caller."""
    last: list[Any] = [None, None]

    def once() -> tuple:
        key = (id(env.sim), env.timestep, float(env.sim.data.time))
        if last[0] != key:
            last[:] = [key, staged_rewards()]
        return last[1]

    return once


class FastStep:
    """robosuite's `MujocoEnv.step` for one robot (1.5: a fixed-base or wheeled robot under the BASIC or the hybrid
    mobile-base composite controller with OSC arms, simple grippers, a joint-velocity mobile base and a joint-position
    torso, as RoboCasa's PandaOmron; 1.4: a SingleArm's OSC controller and its gripper): substep 0 is the policy's
    (`_PolicySubstep`, or the stock code), the others the stock arithmetic (see the module docstring); the reward and
    the success check share one `staged_rewards` per state. `libero` adds LIBERO's own step around it."""

    # The benchmark's parts (ebrl/bench/sim_parts.py) set it: the compiled substeps add their physics' seconds to it
    physics_s: np.ndarray | None = None

    def __init__(self, env: Any, version: tuple[int, int], libero: bool = False) -> None:
        self.env, self.version, self.libero = env, version, libero
        self.built_for: tuple = ()
        self.timers = _Timers(env)
        if callable(getattr(env, "staged_rewards", None)):
            env.staged_rewards = _once_per_step(env, env.staged_rewards)

    def _identity(self) -> tuple:
        """What a reset may rebuild: the sim (a hard reset), the robot's controllers (each reset in robosuite 1.5)."""
        env, robot = self.env, self.env.robots[0]
        if self.version >= (1, 5):
            return (
                id(env.sim),
                id(robot),
                id(robot.composite_controller),
                *map(id, robot.composite_controller.part_controllers.values()),
            )
        return id(env.sim), id(robot), id(robot.controller), id(robot.gripper)

    def _build(self) -> None:
        """Look up the ids, indices and bounds of the env's current sim and controllers."""
        env = self.env
        sim, robot = env.sim, env.robots[0]
        self.model, self.data = sim.model._model, sim.data._data
        self.parts: list[tuple[Any, Any, Any, Any]] = []
        if self.version >= (1, 5):
            workers = _workers_15()
            for part, ctrl in robot.composite_controller.part_controllers.items():
                if not robot._enabled_parts.get(part, False):
                    continue
                index = robot._ref_actuators_indexes_dict[part]
                worker = workers[type(ctrl)](ctrl, sim)
                self.parts.append(
                    (worker, index, sim.model.actuator_ctrlrange[index, 0], sim.model.actuator_ctrlrange[index, 1])
                )
        else:  # the arm's torques clipped to the robot's torque limits; the gripper's command as it is
            low, high = robot.torque_limits
            grip = _Grip14(robot, sim)
            self.parts += [
                (_Osc14(robot, sim), robot._ref_joint_actuator_indexes, low, high),
                (grip, grip.index, None, None),
            ]
        self.parts = [(worker, _as_slice(index), low, high) for worker, index, low, high in self.parts]
        self.workers = [worker for worker, *_ in self.parts]
        self.substeps = int(env.control_timestep / env.model_timestep)
        self.policy = _PolicySubstep(env, self.parts) if self.version >= (1, 5) and _fixed_base(robot) else None
        self.stretch = _Stretch.of(self.model, self.data, self.parts)
        self.built_for = self._identity()

    def _compiled_substeps(self, k: int, dt: float) -> int:
        """Once the arm's compiled arithmetic is on, run the substeps from `k` in one `osc_substeps` call: up to and
        including the next one where a sensor samples, or to the last; the workers keep the last one's state, and
        where a sensor samples they `sync` before it runs, as the Python loop does. How many substeps ran."""
        stretch, timers = self.stretch, self.timers
        if stretch is None or stretch.arm.compiled.on is not True:
            return 0
        quiet = timers.quiet(dt, self.substeps - k)
        n = min(quiet + 1, self.substeps - k)  # (the sampling substep after the quiet ones, if one is left)
        stretch.run(n, self.workers)
        timers.skip()
        if n > quiet:
            due = timers.due(dt)
            for worker in self.workers:
                worker.sync()
            timers.advance(dt, due)
        return n

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, dict]:
        """`env.step(action)`, the stock contract and results."""
        if self._identity() != self.built_for:
            self._build()
        env, sim, m, d, timers, clip = self.env, self.env.sim, self.model, self.data, self.timers, _clip
        if self.libero and env.action_dim == 4 and len(action) > 4:  # LIBERO's step: an OSC_POSITION action
            action = np.array(action)
            action = np.concatenate((action[:3], action[-1:]), axis=-1)
        if env.done:
            raise ValueError("executing action in terminated episode")
        env.timestep += 1
        timers.begin()
        dt, lite, last = env.model_timestep, getattr(env, "lite_physics", False), self.substeps - 1
        # substep 0: the policy step (set_goal, the controllers, the robot's proprio buffers)
        sim.step1() if lite else sim.forward()
        if self.policy is not None:
            self.policy(action)
        else:  # (the stock code)
            env._pre_action(action, policy_step=True)
            for worker in self.workers:
                worker.begin(action)
        sim.step2() if lite else sim.step()
        timers.advance(dt, timers.due(dt))
        k = 1
        while k < self.substeps:
            n = self._compiled_substeps(k, dt)  # (from one sensor sample to the next, in one compiled call)
            if n:
                k += n
                continue
            # mj_step1 + mj_step2 is the stock forward (or forwards) + mj_step: each stage once, from the same state
            mj_step1(m, d)
            due = timers.due(dt)
            keep = bool(due) or k == last  # (the controllers' state is read where a sensor runs, and at the end)
            # robot.control(policy_step=False): each enabled part's run_controller, clipped into its range
            for worker, index, low, high in self.parts:
                applied = worker.torques(keep)
                if low is not None:
                    applied = clip(applied, low, high)
                d.ctrl[index] = worker.applied = applied
            mj_step2(m, d)
            if due:
                for worker in self.workers:
                    worker.sync()
            timers.advance(dt, due)
            k += 1
        if self.substeps > 1:  # (one substep: the stock code left the controllers as they are)
            for worker in self.workers:
                worker.sync()
        timers.end()
        env.cur_time += env.control_timestep
        reward, done, info = env._post_action(action)
        obs = env._get_observations()
        if self.libero:
            done = env._check_success()
        return obs, reward, done, info


def _fixed_base(robot: Any) -> bool:
    """Whether `_PolicySubstep` covers robosuite 1.5's robot: a fixed base under the plain composite controller
    (a wheeled robot's control and the hybrid mobile base's set_goal run the stock code)."""
    from robosuite.controllers.composite.composite_controller import CompositeController

    return (
        _method_owner(robot, "control") == ROBOTS_15[0]
        and type(robot.composite_controller) is CompositeController
        and _method_owner(robot.composite_controller, "set_goal") == COMPOSITE
    )


def _as_slice(index: Any) -> Any:
    """A contiguous index array as a slice: the same elements without a fancy index."""
    index = np.asarray(index)
    if index.ndim == 1 and len(index) and np.array_equal(index, np.arange(index[0], index[-1] + 1)):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


STOCK_STEP = {
    "robosuite.environments.base.MujocoEnv": False,
    "libero.libero.envs.bddl_base_domain.BDDLBaseDomain": True,
}  # the step's owner: LIBERO's around it
STOCK_PRE_ACTION = ("robosuite.environments.robot_env.RobotEnv", "libero.libero.envs.bddl_base_domain.BDDLBaseDomain")


def fast_step_for(env: Any) -> tuple[Callable[[np.ndarray], tuple] | None, str]:
    """The env's fast control step and "", or None and why the stock step runs instead."""
    try:
        import robosuite
    except ImportError:
        return None, "robosuite is not importable"
    version = tuple(int(p) for p in robosuite.__version__.split(".")[:2])
    if version not in ((1, 4), (1, 5)):
        return None, f"robosuite {robosuite.__version__} (the fast step covers 1.4 and 1.5)"
    checks = [
        (_method_owner(env, "step") in STOCK_STEP, "the task overrides step()"),
        (_method_owner(env, "_pre_action") in STOCK_PRE_ACTION, "the task overrides _pre_action()"),
        (
            _method_owner(env, "_update_observables") == "robosuite.environments.base.MujocoEnv",
            "the task overrides _update_observables()",
        ),
        (env.viewer is None and not env.has_renderer, "an on-screen viewer"),
        (len(env.robots) == 1, f"{len(env.robots)} robots"),
    ]
    for ok, why in checks:
        if not ok:
            return None, why
    why = _controllers_15(env.robots[0]) if version >= (1, 5) else _controllers_14(env.robots[0])
    if why:
        return None, why
    return FastStep(env, version, libero=STOCK_STEP[_method_owner(env, "step")]).step, ""


def _workers_15() -> dict[type, type]:
    """robosuite 1.5's part controllers the fast step covers, and what runs each."""
    from robosuite.controllers.parts.arm.osc import OperationalSpaceController
    from robosuite.controllers.parts.generic.joint_pos import JointPositionController
    from robosuite.controllers.parts.gripper.simple_grip import SimpleGripController
    from robosuite.controllers.parts.mobile_base.joint_vel import MobileBaseJointVelocityController

    return {
        OperationalSpaceController: _Osc,
        SimpleGripController: _Velocity,
        MobileBaseJointVelocityController: _Velocity,
        JointPositionController: _JointPosition,
    }


ROBOTS_15 = ("robosuite.robots.fixed_base_robot.FixedBaseRobot", "robosuite.robots.wheeled_robot.WheeledRobot")
COMPOSITE = "robosuite.controllers.composite.composite_controller.CompositeController"


def _controllers_15(robot: Any) -> str:
    """Why robosuite 1.5's robot is not covered ("" if it is)."""
    from robosuite.controllers.composite.composite_controller import CompositeController, HybridMobileBase

    composite = robot.composite_controller
    if _method_owner(robot, "control") not in ROBOTS_15:
        return f"robot {type(robot).__name__}'s control()"
    if type(composite) not in (CompositeController, HybridMobileBase) or any(
        _method_owner(composite, name) != COMPOSITE
        for name in ("run_controller", "update_state", "get_controller_base_pose")
    ):
        return f"composite controller {type(composite).__name__}"
    workers = _workers_15()
    for part, ctrl in composite.part_controllers.items():
        if not robot._enabled_parts.get(part, False):
            continue
        if type(ctrl) not in workers:
            return f"{part}: controller {type(ctrl).__name__}"
        if any(
            getattr(ctrl, name, None) is not None for name in ("interpolator", "interpolator_pos", "interpolator_ori")
        ):
            return f"{part}: an interpolator"
        if workers[type(ctrl)] is _Osc and (
            ctrl.num_ref_sites != 1 or not ctrl.lite_physics or ctrl.input_ref_frame not in ("base", "world")
        ):
            return f"{part}: OSC with {ctrl.num_ref_sites} reference sites / frame {ctrl.input_ref_frame}"
        if workers[type(ctrl)] is _JointPosition and (ctrl.ref_name is not None or not ctrl.lite_physics):
            return f"{part}: joint positions with a reference site"
    if any(arm not in composite.part_controllers or not robot._enabled_parts.get(arm, False) for arm in composite.arms):
        return "an arm without its controller enabled"
    return ""


def _controllers_14(robot: Any) -> str:
    """Why robosuite 1.4's robot is not covered ("" if it is)."""
    from robosuite.controllers.osc import OperationalSpaceController

    if _method_owner(robot, "control") != "robosuite.robots.single_arm.SingleArm":
        return f"robot {type(robot).__name__} is not a single arm"
    if type(robot.controller) is not OperationalSpaceController:
        return f"controller {type(robot.controller).__name__}"
    if robot.controller.interpolator_pos is not None or robot.controller.interpolator_ori is not None:
        return "an OSC interpolator"
    if not robot.has_gripper or _method_owner(robot, "grip_action") != "robosuite.robots.manipulator.Manipulator":
        return "no gripper, or its own grip_action()"
    return ""


def fast_or_stock(env: Any, enabled: bool) -> tuple[Callable[[np.ndarray], tuple], str]:
    """The step an adapter calls: the fast one when `enabled` (env.fast_step) and it covers the env; and why not."""
    if not enabled:
        return env.step, "env.fast_step=false"
    fast, why = fast_step_for(env)
    return (fast, "") if fast is not None else (env.step, why)
