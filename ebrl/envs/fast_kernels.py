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

Once it runs alone, `osc_substeps` runs whole stretches of substeps in one call: MuJoCo's own C functions (mj_step1,
mj_step2, mj_jacSite, mj_fullM, called through their addresses in the library the bindings loaded, on the same model
and data) around `osc_substep`, so that no Python runs between two physics substeps where no sensor samples.

This module imports numpy, numba, MuJoCo and robosuite only: it runs under each benchmark's interpreter.
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
try:
    from numba.extending import intrinsic, register_jitable
except ImportError:  # (no numba: the numpy arithmetic runs, `osc_kernel` is None)
    intrinsic = None

    def register_jitable(function: Callable) -> Callable:
        return function


@functools.cache
def osc_kernel() -> Callable | None:
    """`osc_substep` compiled, or None where robosuite's kernels are not numba's (macros.ENABLE_NUMBA off) or numba
    is missing. The machine code is cached on disk per interpreter and robosuite version (`cache_dir`): a cached
    function carries the robosuite kernels it was compiled with, and LIBERO's venv has robosuite 1.4, this one 1.5."""
    try:
        import numba
    except ImportError:
        return None
    kernels = (opspace_matrices, nullspace_torques, orientation_error)
    if not all(isinstance(k, numba.core.registry.CPUDispatcher) for k in kernels):
        return None
    return _compile(
        osc_substep,
        lambda kernel: kernel(*Compiled(kernel, [0, 1], [0, 1], jacobian_order()).inputs(*_warm_up_inputs())),
    )


_osc_substep: Callable | None = None  # osc_kernel(): what osc_substeps calls (bound before it compiles)


@functools.cache
def substeps_kernel() -> Callable | None:
    """`osc_substeps` compiled (cached as `osc_kernel`'s), or None where `osc_kernel` is or MuJoCo's C functions
    cannot be reached (`mujoco_c`)."""
    global _osc_substep
    kernel, c = osc_kernel(), mujoco_c()
    if kernel is None or c is None:
        return None
    _osc_substep = kernel
    return _compile(osc_substeps, lambda substeps: _warm_up_substeps(substeps, c))


def _compile(function: Callable, warm_up: Callable[[Callable], Any]) -> Callable | None:
    """`function` under numba, its machine code cached on disk (one process compiles, about 10 s, the others wait
    and load it; no cache folder to write: compiled in this process alone); None, with one warning, where numba
    cannot type or compile it here (the numpy arithmetic runs instead)."""
    import numba
    from numba.core import config

    before, folder = config.CACHE_DIR, cache_dir()
    config.CACHE_DIR = str(folder)  # (read when a function's cache is set up, i.e. at decoration)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        kernel = numba.njit(cache=True)(function)
        lock = open(folder / "compile.lock", "w")
    except (OSError, RuntimeError):
        kernel, lock = numba.njit(function), None
    finally:
        config.CACHE_DIR = before
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        warm_up(kernel)
    except Exception as e:  # noqa: BLE001
        why = (str(e).splitlines() or [""])[0]
        warnings.warn(
            f"the fast step's compiled controller is off ({type(e).__name__}: {why}); its numpy arithmetic "
            "runs, the same bits, slower",
            stacklevel=3,
        )
        return None
    finally:
        if lock is not None:
            lock.close()
    return kernel


@functools.cache
def mujoco_c() -> tuple | None:
    """The addresses of mj_step1, mj_step2, mj_jacSite and mj_fullM in the libmujoco the bindings loaded (the same
    file, so the same library and its callbacks), which `osc_substeps` calls; None where it is not found beside
    them."""
    import ctypes

    import mujoco

    found = sorted(Path(mujoco.__file__).parent.glob("libmujoco.so.*"))
    try:
        lib = ctypes.CDLL(str(found[-1]))
        return tuple(
            ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            for name in ("mj_step1", "mj_step2", "mj_jacSite", "mj_fullM")
        )
    except (IndexError, OSError, AttributeError):
        return None


@functools.cache
def clock_address() -> int:
    """clock_gettime's address (the C library's), for `osc_substeps`'s timed runs."""
    import ctypes

    return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value


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
    return (
        jac,
        jac,
        jac,
        jac,
        Data,
        np.eye(2),
        0,
        1,
        True,
        (np.zeros(3), np.eye(3)),
        (np.array(gains[0:3]), np.array(gains[3:6]), gains[0:3], gains[3:6]),
        np.zeros(2),
        True,
    )


def _warm_up_substeps(kernel: Callable, c: tuple) -> None:
    """`osc_substeps` on no substeps, with arguments of the types a run gives it (it compiles for them)."""
    out = Compiled(osc_kernel(), [0, 1], [0, 1], jacobian_order()).inputs(*_warm_up_inputs())
    index, bounds = np.zeros(2, np.int64), np.zeros(2)
    kernel(
        0,
        c,
        0,
        0,
        (0, 0),
        *out,
        np.zeros(2),
        index,
        bounds,
        bounds,
        index,
        np.zeros((0, 2)),
        np.zeros(2),
        np.zeros(2),
        0,
        np.zeros(1),
    )


def cache_dir() -> Path:
    """Where this interpreter keeps the compiled substep: ~/.cache/ebrl/numba/<interpreter and robosuite version>."""
    import robosuite

    tag = hashlib.sha256(f"{sys.prefix}|{robosuite.__version__}".encode()).hexdigest()[:12]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ebrl" / "numba" / tag


def osc_substep(
    jacp: np.ndarray,
    jacr: np.ndarray,
    base_jacp: np.ndarray,
    base_jacr: np.ndarray,
    qpos: np.ndarray,
    qvel: np.ndarray,
    site_xpos: np.ndarray,
    site_xmat: np.ndarray,
    full: np.ndarray,
    qfrc_bias: np.ndarray,
    qpos_index: np.ndarray,
    qvel_index: np.ndarray,
    ref_id: int,
    base_id: int,
    base_frame: bool,
    goal_pos: np.ndarray,
    goal_ori: np.ndarray,
    kp_pos: np.ndarray,
    kp_ori: np.ndarray,
    kd_pos: np.ndarray,
    kd_ori: np.ndarray,
    initial_joint: np.ndarray,
    uncoupling: bool,
    out: tuple,
) -> None:
    """`_Osc.torques`'s arithmetic (see there), written into `out`: (ref_pos, ref_ori_mat, ref_pos_vel,
    ref_ori_vel, J_pos, J_ori, J_full, joint_pos, joint_vel, mass_matrix, origin_pos, origin_ori, torques), in
    the stock code's layouts (`Compiled`). A base_id < 0: no base frame (robosuite 1.4: the goal is in the world
    frame, the velocity error has no base term)."""
    (
        ref_pos,
        ref_ori_mat,
        ref_pos_vel,
        ref_ori_vel,
        J_pos,
        J_ori,
        J_full,
        joint_pos,
        joint_vel,
        mass_matrix,
        origin_pos,
        origin_ori,
        torques,
    ) = out
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


def osc_substeps(
    n: int,
    c: tuple,
    m: int,
    d: int,
    full_from: tuple,
    jacp: np.ndarray,
    jacr: np.ndarray,
    base_jacp: np.ndarray,
    base_jacr: np.ndarray,
    qpos: np.ndarray,
    qvel: np.ndarray,
    site_xpos: np.ndarray,
    site_xmat: np.ndarray,
    full: np.ndarray,
    qfrc_bias: np.ndarray,
    qpos_index: np.ndarray,
    qvel_index: np.ndarray,
    ref_id: int,
    base_id: int,
    base_frame: bool,
    goal_pos: np.ndarray,
    goal_ori: np.ndarray,
    kp_pos: np.ndarray,
    kp_ori: np.ndarray,
    kd_pos: np.ndarray,
    kd_ori: np.ndarray,
    initial_joint: np.ndarray,
    uncoupling: bool,
    out: tuple,
    ctrl: np.ndarray,
    arm: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    others: np.ndarray,
    commands: np.ndarray,
    qpos_kept: np.ndarray,
    qvel_kept: np.ndarray,
    clock: int,
    physics_s: np.ndarray,
) -> None:
    """`n` physics substeps between policy steps (the fast step's, up to where a sensor samples next: it reads the
    controllers' state after the last one). Each is `mj_step1`, the controller's Jacobians and mass matrix
    (`mj_jacSite`, `mj_fullM`: `c`, `mujoco_c`'s addresses, called on MjModel `m` and MjData `d`, addresses too),
    `osc_substep` (from `jacp` to `out`: its arguments), the arm's torques clipped into [low, high] as np.clip does
    and written to ctrl[arm], the other parts' `commands` row (constant within a control step, or the stock code's
    own per substep) to ctrl[others], and `mj_step2`. The last substep's qpos and qvel before its mj_step2 (what a
    controller's state reads) are copied to the `kept` arrays. `full_from`: mj_fullM's arguments after the model
    (MuJoCo < 3.4: the buffer and qM; later: d and the buffer). `clock`: 0, or the address of clock_gettime, and then
    the seconds inside mj_step1 and mj_step2 are added to physics_s[0] (the benchmark's parts,
    ebrl/bench/sim_parts.py)."""
    torques = out[-1]
    step1, step2, jac_site, full_m = c
    stamp = np.zeros(2, np.int64)  # a timespec: seconds, nanoseconds
    for k in range(n):
        if clock:
            physics_s[0] -= _now(clock, stamp)
        _void_call(step1, (m, d))
        if clock:
            physics_s[0] += _now(clock, stamp)
        _void_call(jac_site, (m, d, jacp.ctypes.data, jacr.ctypes.data, np.int32(ref_id)))
        if base_id >= 0:
            _void_call(jac_site, (m, d, base_jacp.ctypes.data, base_jacr.ctypes.data, np.int32(base_id)))
        _void_call(full_m, (m, full_from[0], full_from[1]))
        _osc_substep(
            jacp,
            jacr,
            base_jacp,
            base_jacr,
            qpos,
            qvel,
            site_xpos,
            site_xmat,
            full,
            qfrc_bias,
            qpos_index,
            qvel_index,
            ref_id,
            base_id,
            base_frame,
            goal_pos,
            goal_ori,
            kp_pos,
            kp_ori,
            kd_pos,
            kd_ori,
            initial_joint,
            uncoupling,
            out,
        )
        for j in range(arm.shape[0]):  # numpy's clip: max then min, a NaN kept
            x = torques[j]
            if not np.isnan(x):
                x = x if x > low[j] else low[j]
                x = x if x < high[j] else high[j]
            ctrl[arm[j]] = x
        for j in range(others.shape[0]):
            ctrl[others[j]] = commands[k, j]
        if k == n - 1:
            qpos_kept[:] = qpos
            qvel_kept[:] = qvel
        if clock:
            physics_s[0] -= _now(clock, stamp)
        _void_call(step2, (m, d))
        if clock:
            physics_s[0] += _now(clock, stamp)


if intrinsic is not None:

    @intrinsic
    def _void_call(typingctx: Any, address: Any, args: Any) -> Any:
        """In compiled code: call the C function at `address` with `args` (pointers as integers, ints as int32), no
        result."""
        from llvmlite import ir
        from numba.core import cgutils, types

        def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
            address, packed = values
            args = cgutils.unpack_tuple(builder, packed)
            function = builder.inttoptr(address, ir.FunctionType(ir.VoidType(), [a.type for a in args]).as_pointer())
            builder.call(function, args)
            return context.get_dummy_value()

        return types.void(address, args), codegen


@register_jitable
def _now(clock: int, stamp: np.ndarray) -> float:
    """In compiled code: CLOCK_MONOTONIC (the clock of Python's perf_counter) through clock_gettime at `clock`."""
    _void_call(clock, (np.int32(1), stamp.ctypes.data))  # (its int result, left in a register, is not read)
    return stamp[0] + stamp[1] * 1e-9


CHECKED = 25  # substeps a controller runs both ways before it runs compiled alone: one control step
# What the check decided in this process, per layout (Jacobian order, joints): a controller robosuite rebuilds at a
# reset runs the same compiled code on arrays of the same layout, and starts where the last one ended
DECIDED: dict[tuple[str, int], bool] = {}


class Compiled:
    """One OSC controller's compiled arithmetic: the buffers `osc_substep` writes, and whether it is on (None: not
    decided yet: its first CHECKED substeps run both ways (`decide`), the numpy arithmetic's results used; a layout
    this process decided already (`DECIDED`) starts decided)."""

    def __init__(self, kernel: Callable | None, qpos_index: Any, qvel_index: Any, jacobians: str = "C") -> None:
        self.qpos_index, self.qvel_index = _index_array(qpos_index), _index_array(qvel_index)
        n = len(self.qvel_index)
        self.layout = (jacobians, n)
        self.kernel, self.on, self.checked = kernel, (DECIDED.get(self.layout) if kernel is not None else False), 0
        J = (lambda rows: np.zeros((rows, n))) if jacobians == "C" else (lambda rows: np.zeros((n, rows)).T)
        self.out = (
            np.zeros(3),
            np.zeros((3, 3)),
            np.zeros(3),
            np.zeros(3),
            J(3),
            J(3),
            J(6),
            np.zeros(n),
            np.zeros(n),
            np.zeros((n, n)).T,
            np.zeros(3),
            np.zeros((3, 3)),
            np.zeros(n),
        )

    @classmethod
    def of(cls, ctrl: Any, jacobians: str = "C") -> "Compiled":
        """For controller `ctrl`, whose stock code holds its Jacobians in `jacobians` order ("C" or "F"); the mass
        matrix is in F order in every version."""
        return cls(osc_kernel(), ctrl.qpos_index, ctrl.qvel_index, jacobians)

    def inputs(
        self,
        jacp: np.ndarray,
        jacr: np.ndarray,
        base_jacp: np.ndarray,
        base_jacr: np.ndarray,
        d: Any,
        full: np.ndarray,
        ref_id: int,
        base_id: int,
        base_frame: bool,
        goal: tuple,
        gains: tuple,
        initial_joint: np.ndarray,
        uncoupling: bool,
    ) -> tuple:
        """`osc_substep`'s arguments on MjData `d`'s arrays (views of its memory: they hold each substep's values)."""
        return (
            jacp,
            jacr,
            base_jacp,
            base_jacr,
            d.qpos,
            d.qvel,
            d.site_xpos,
            d.site_xmat,
            full,
            d.qfrc_bias,
            self.qpos_index,
            self.qvel_index,
            ref_id,
            base_id,
            base_frame,
            *goal,
            *gains,
            np.asarray(initial_joint, np.float64),
            bool(uncoupling),
            self.out,
        )

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
            np.shape(a) == np.shape(b) and np.array_equal(a, b) for a, b in zip(self.out, plain)
        )
        self.checked += 1
        self.on = False if not same else (True if self.checked >= CHECKED else None)
        if self.on is not None:
            DECIDED[self.layout] = self.on
        return same


def _index_array(index: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(index, dtype=np.int64).reshape(-1))


if __name__ == "__main__":  # `python -m ebrl.envs.fast_kernels`: compile (or load) them for this interpreter
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            "usage: python -m ebrl.envs.fast_kernels  (compiles the fast step's kernels for this interpreter, "
            "or loads them from the disk cache)"
        )
        sys.exit(0)
    sys.exit(
        0
        if osc_kernel() is not None and substeps_kernel() is not None
        else "robosuite's kernels are not numba's here, or MuJoCo's library was not found: the numpy arithmetic runs"
    )
