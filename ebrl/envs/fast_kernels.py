"""The OSC controller's arithmetic between policy steps, compiled into one numba call (ebrl/envs/fast_step.py).

`_Osc.torques` (robosuite 1.5) and `_Osc14.torques` (1.4, LIBERO) ran about 25 numpy calls per physics substep around
robosuite's own numba kernels; as numpy calls each costs a microsecond or more of Python, more than its arithmetic.
`osc_substep` runs the same operations in the same order in one compiled function: the same BLAS routines for the
products (numba's np.dot calls the BLAS numpy calls), IEEE arithmetic without contraction or reassociation (no
fastmath), robosuite's kernels (`opspace_matrices`, `nullspace_torques`, `orientation_error`) called on arrays of the
memory layouts the stock code gives them (numba compiles, and rounds, per layout). Whether that holds on a machine is
checked, not assumed: a controller's first substeps run both ways on one state (`Compiled.decide`), and a
disagreement keeps the numpy arithmetic; tests/envs/test_fast_step.py compares whole trajectories with the stock step.
(The layouts matter: robosuite 1.4's Jacobians are in F order, 1.5's in C, and a C-order J_full in 1.4 moved a torque
by one ulp in some states while the first substep agreed.)

This module imports numpy, numba and robosuite only: it runs under each benchmark's interpreter.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

try:  # (robosuite's own kernels, which the compiled substep calls; absent outside the robosuite family)
    from robosuite.utils.control_utils import nullspace_torques, opspace_matrices, orientation_error
except ImportError:
    nullspace_torques = opspace_matrices = orientation_error = None


@functools.cache
def osc_kernel() -> Callable | None:
    """`osc_substep` compiled, or None where robosuite's kernels are not numba's (macros.ENABLE_NUMBA off) or numba
    is missing. The machine code is cached on disk per interpreter and robosuite version (`cache_dir`): a cached
    function carries the robosuite kernels it was compiled with, and LIBERO's venv has robosuite 1.4, this one 1.5."""
    try:
        import numba
        from numba.core import config
    except ImportError:
        return None
    kernels = (opspace_matrices, nullspace_torques, orientation_error)
    if not all(isinstance(k, numba.core.registry.CPUDispatcher) for k in kernels):
        return None
    before, folder = config.CACHE_DIR, cache_dir()
    config.CACHE_DIR = str(folder)  # (read when a function's cache is set up, i.e. at decoration)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        kernel = numba.njit(cache=True)(osc_substep)
        lock = open(folder / "compile.lock", "w")
    except (OSError, RuntimeError):  # no cache folder to write: compiled in this process alone
        kernel, lock = numba.njit(osc_substep), None
    finally:
        config.CACHE_DIR = before
    try:  # one process compiles (about 10 s), the others wait and load what it cached
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        Compiled(kernel, [0, 1], [0, 1], jacobian_order()).run(*_warm_up_inputs())
    except Exception as e:  # noqa: BLE001  (numba could not type or compile it here: the numpy arithmetic runs)
        why = (str(e).splitlines() or [""])[0]
        warnings.warn(f"the fast step's compiled controller is off ({type(e).__name__}: {why}); its numpy arithmetic "
                      "runs, the same bits, slower", stacklevel=2)
        return None
    finally:
        if lock is not None:
            lock.close()
    return kernel


def jacobian_order() -> str:
    """The layout this robosuite's OSC controller holds its Jacobians in: 1.5 takes them ("C"), 1.4 copies a fancy
    index of them ("F")."""
    import robosuite

    return "C" if tuple(int(x) for x in robosuite.__version__.split(".")[:2]) >= (1, 5) else "F"


def _warm_up_inputs() -> tuple:
    """`Compiled.run`'s arguments for a 2-joint arm of typical types (MjData's arrays are C-ordered float64)."""
    class Data:
        qpos, qvel, qfrc_bias = np.zeros(2), np.zeros(2), np.zeros(2)
        site_xpos, site_xmat = np.zeros((2, 3)), np.tile(np.eye(3).reshape(1, 9), (2, 1))

    jac = np.zeros((3, 2))
    gains = np.ones(6)
    return (jac, jac, jac, jac, Data, np.eye(2), 0, 1, True, (np.zeros(3), np.eye(3)),
            (np.array(gains[0:3]), np.array(gains[3:6]), gains[0:3], gains[3:6]), np.zeros(2), True)


def cache_dir() -> Path:
    """Where this interpreter keeps the compiled substep: ~/.cache/ebrl/numba/<interpreter and robosuite version>."""
    import robosuite

    tag = hashlib.sha256(f"{sys.prefix}|{robosuite.__version__}".encode()).hexdigest()[:12]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ebrl" / "numba" / tag


def osc_substep(jacp: np.ndarray, jacr: np.ndarray, base_jacp: np.ndarray, base_jacr: np.ndarray,
                qpos: np.ndarray, qvel: np.ndarray, site_xpos: np.ndarray, site_xmat: np.ndarray,
                full: np.ndarray, qfrc_bias: np.ndarray, qpos_index: np.ndarray, qvel_index: np.ndarray,
                ref_id: int, base_id: int, base_frame: bool, goal_pos: np.ndarray, goal_ori: np.ndarray,
                kp_pos: np.ndarray, kp_ori: np.ndarray, kd_pos: np.ndarray, kd_ori: np.ndarray,
                initial_joint: np.ndarray, uncoupling: bool, out: tuple) -> None:
    """`_Osc.torques`'s arithmetic (see there), written into `out`: (ref_pos, ref_ori_mat, ref_pos_vel,
    ref_ori_vel, J_pos, J_ori, J_full, joint_pos, joint_vel, mass_matrix, origin_pos, origin_ori, torques), in
    the stock code's layouts (`Compiled`). A base_id < 0: no base frame (robosuite 1.4: the goal is in the world
    frame, the velocity error has no base term)."""
    (ref_pos, ref_ori_mat, ref_pos_vel, ref_ori_vel, J_pos, J_ori, J_full, joint_pos, joint_vel, mass_matrix,
     origin_pos, origin_ori, torques) = out
    n = qvel_index.shape[0]
    ref_pos[:] = site_xpos[ref_id]
    ref_ori_mat[:, :] = site_xmat[ref_id].reshape((3, 3))
    ref_pos_vel[:] = np.dot(jacp, qvel)
    ref_ori_vel[:] = np.dot(jacr, qvel)
    for j in range(n):
        J_pos[:, j] = jacp[:, qvel_index[j]]
        J_ori[:, j] = jacr[:, qvel_index[j]]
        joint_pos[j] = qpos[qpos_index[j]]
        joint_vel[j] = qvel[qvel_index[j]]
        for i in range(n):
            mass_matrix[i, j] = full[qvel_index[i], qvel_index[j]]
    J_full[:3] = J_pos
    J_full[3:] = J_ori
    if base_id >= 0:
        origin_pos[:] = site_xpos[base_id]
        origin_ori[:, :] = site_xmat[base_id].reshape((3, 3))
    if base_frame:
        desired_world_pos = origin_pos + np.dot(origin_ori, goal_pos)
        desired_world_ori = np.dot(origin_ori, goal_ori)
    else:
        desired_world_pos, desired_world_ori = goal_pos, goal_ori
    ori_error = orientation_error(desired_world_ori, ref_ori_mat)
    if base_id >= 0:
        desired_force = (desired_world_pos - ref_pos) * kp_pos + (-(ref_pos_vel - np.dot(base_jacp, qvel))) * kd_pos
        desired_torque = ori_error * kp_ori + (-(ref_ori_vel - np.dot(base_jacr, qvel))) * kd_ori
    else:
        desired_force = (desired_world_pos - ref_pos) * kp_pos + (-ref_pos_vel) * kd_pos
        desired_torque = ori_error * kp_ori + (-ref_ori_vel) * kd_ori
    lambda_full, lambda_pos, lambda_ori, nullspace_matrix = opspace_matrices(mass_matrix, J_full, J_pos, J_ori)
    if uncoupling:
        decoupled_wrench = np.concatenate((np.dot(lambda_pos, desired_force), np.dot(lambda_ori, desired_torque)))
    else:
        decoupled_wrench = np.dot(lambda_full, np.concatenate((desired_force, desired_torque)))
    bias = np.empty(n)
    for j in range(n):
        bias[j] = qfrc_bias[qvel_index[j]]
    torques[:] = np.dot(J_full.T, decoupled_wrench) + bias
    torques += nullspace_torques(mass_matrix, nullspace_matrix, initial_joint, joint_pos, joint_vel)



CHECKED = 25  # substeps a controller runs both ways before it runs compiled alone: one control step


class Compiled:
    """One OSC controller's compiled arithmetic: the buffers `osc_substep` writes, and whether it is on (None: not
    decided yet: its first CHECKED substeps run both ways (`decide`), the numpy arithmetic's results used)."""

    def __init__(self, kernel: Callable | None, qpos_index: Any, qvel_index: Any, jacobians: str = "C") -> None:
        self.kernel, self.on, self.checked = kernel, (None if kernel is not None else False), 0
        self.qpos_index, self.qvel_index = _index_array(qpos_index), _index_array(qvel_index)
        n = len(self.qvel_index)
        J = (lambda rows: np.zeros((rows, n))) if jacobians == "C" else (lambda rows: np.zeros((n, rows)).T)
        self.out = (np.zeros(3), np.zeros((3, 3)), np.zeros(3), np.zeros(3), J(3), J(3), J(6), np.zeros(n),
                    np.zeros(n), np.zeros((n, n)).T, np.zeros(3), np.zeros((3, 3)), np.zeros(n))

    @classmethod
    def of(cls, ctrl: Any, jacobians: str = "C") -> "Compiled":
        """For controller `ctrl`, whose stock code holds its Jacobians in `jacobians` order ("C" or "F"); the mass
        matrix is in F order in every version."""
        return cls(osc_kernel(), ctrl.qpos_index, ctrl.qvel_index, jacobians)

    def run(self, jacp: np.ndarray, jacr: np.ndarray, base_jacp: np.ndarray, base_jacr: np.ndarray, d: Any,
            full: np.ndarray, ref_id: int, base_id: int, base_frame: bool, goal: tuple, gains: tuple,
            initial_joint: np.ndarray, uncoupling: bool) -> None:
        """`osc_substep` on MjData `d`'s current arrays."""
        self.kernel(jacp, jacr, base_jacp, base_jacr, d.qpos, d.qvel, d.site_xpos, d.site_xmat, full, d.qfrc_bias,
                    self.qpos_index, self.qvel_index, ref_id, base_id, base_frame, *goal, *gains,
                    np.asarray(initial_joint, np.float64), bool(uncoupling), self.out)

    @property
    def torques(self) -> np.ndarray:
        """This substep's torques (the buffer: the next substep overwrites it)."""
        return self.out[-1]

    def state(self) -> tuple:
        """Copies of every result: what the controller keeps after a substep (`sync`)."""
        return tuple(np.array(x) for x in self.out)

    def decide(self, plain: tuple) -> bool:
        """Whether this substep's results are `plain`'s (the numpy arithmetic's) bit for bit. The first CHECKED
        substeps are compared; one that differs turns the compiled arithmetic off for good, CHECKED that agree on."""
        same = len(plain) == len(self.out) and all(
            np.shape(a) == np.shape(b) and np.array_equal(a, b) for a, b in zip(self.out, plain))
        self.checked += 1
        self.on = False if not same else (True if self.checked >= CHECKED else None)
        return same


def _index_array(index: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(index, dtype=np.int64).reshape(-1))


if __name__ == "__main__":  # `python -m ebrl.envs.fast_kernels`: compile (or load) it for this interpreter
    sys.exit(0 if osc_kernel() is not None else "robosuite's kernels are not numba's here: the numpy arithmetic runs")
