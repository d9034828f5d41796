"""A simulator process (docs/internals/design.md, "Processes and what crosses between them"): one env, served over a
socket.

`python -m ebrl.envs.process FD` builds the env its parent sends, then answers tuple notices; observations, actions
and per-step results live in the env's shared-memory slot (ebrl/envs/slots.py). This side imports numpy, the
standard library and the adapter's module only, never torch: it may run under a benchmark's own interpreter.

Protocol, parent -> child after the child sent ("spec", EnvSpec):
    ("attach", shm_name, execute)   -> ("ok", None)
    ("reset", seed | None)          -> obs written to shm; ("ok", None)
    ("chunk", n_steps)              -> actions[:n] read from shm, results written; ("ok", {"episode": ...})
    ("close",)                      -> the child closes its env and exits
A chunk of 0 steps (an env left as it is) never reaches the child: its handle reports 0 executed.
Any failure answers ("error", one line); a failure to build the env also ends the child. The parent's side, and
what happens when a simulator dies or hangs, is ebrl/envs/worker.py; scheduler.serial runs `Simulator.serve` in the
supervisor itself (ebrl/envs/serial.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing.connection
import os
import signal
import sys
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Sequence

import numpy as np

from ebrl.classes import ContractError, constructor_kwargs, load_class, missing_methods, parameters
from ebrl.envs.base import (
    ADAPTER_CONTRACT,
    AdapterContractError,
    EnvAdapter,
    EnvSetupError,
    EnvSpec,
    one_line,
    use_headless_gl,
)
from ebrl.envs.slots import SlotLayout, attach_shared_memory, split_views

# Config keys that are not adapter arguments (the rest go to the adapter's constructor).
NOT_ADAPTER_ARGS = (
    "_target_",
    "name",
    "num_envs",
    "python",
    "fault",
    "render_every_step",
    "tasks",
    "task_weights",
    "episode_seeds",
)
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMBA_NUM_THREADS",
)


def worker_environment() -> dict[str, str]:
    """Environment variables a simulator process needs before numpy or a simulator loads."""
    return {name: "1" for name in THREAD_VARS}  # one core per simulator: no thread pools inside


def _prepare_process(env_cfg: dict[str, Any], cpus: Sequence[int] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops workers; Ctrl-C prints nothing here
    for name, value in worker_environment().items():
        os.environ.setdefault(name, value)
    if env_cfg.get("cameras"):
        use_headless_gl()
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def load_adapter_class(target: str) -> type[EnvAdapter]:
    """The adapter class named by a config's `_target_` ("package.module.Class"), ours or a user's: one line if it
    cannot be imported, is no EnvAdapter, or leaves a method of the contract unimplemented."""
    try:
        cls = load_class(target, "env._target_")
    except ContractError as e:
        raise EnvSetupError(str(e)) from None
    if not issubclass(cls, EnvAdapter):
        raise EnvSetupError(f"env._target_={target!r} is not an ebrl.envs.base.EnvAdapter subclass")
    for method in missing_methods(cls, EnvAdapter, ("reset", "step")):
        raise EnvSetupError(
            f"env._target_={target!r} does not implement {method}: an adapter implements {ADAPTER_CONTRACT}"
        )
    params, var_kw = parameters(cls)
    if "seed" not in params and not var_kw:
        raise EnvSetupError(
            f"env._target_={target!r}: its constructor takes no seed: an adapter implements {ADAPTER_CONTRACT}"
        )
    return cls


def build_adapter(env_cfg: dict[str, Any], seed: int) -> EnvAdapter:
    """Construct the adapter from a plain config dict: every key but NOT_ADAPTER_ARGS that the constructor takes,
    plus seed; env.render_every_step is the adapter's `render_every_step`, a pool's episode_seeds its
    `episode_seeds`."""
    cls = load_adapter_class(env_cfg["_target_"])
    adapter = cls(**constructor_kwargs(cls, env_cfg, NOT_ADAPTER_ARGS), seed=seed)
    if not hasattr(adapter, "_episodes"):
        raise EnvSetupError(
            f"env._target_={env_cfg['_target_']!r}: its constructor did not call "
            f"EnvAdapter.__init__(self, seed): an adapter implements {ADAPTER_CONTRACT}"
        )
    if not isinstance(getattr(adapter, "spec", None), EnvSpec):
        raise EnvSetupError(
            f"env._target_={env_cfg['_target_']!r} set no self.spec (an ebrl.envs.base.EnvSpec) in "
            f"its constructor: an adapter implements {ADAPTER_CONTRACT}"
        )
    # (both its process and scheduler.serial build here: where the cameras render travels with the spec)
    adapter.spec = dataclasses.replace(adapter.spec, software_render=adapter.software_renderer())
    adapter.render_every_step = bool(env_cfg.get("render_every_step", False))
    if env_cfg.get("episode_seeds") is not None:
        adapter.episode_seeds = tuple(env_cfg["episode_seeds"])
    release_build_memory(keep_compile_cache=adapter.recompiles_on_reset)
    return adapter


KEEP_BUILD_MEMORY = "EBRL_KEEP_BUILD_MEMORY"  # the benchmark's control: set, a build's leftovers are kept


def release_build_memory(keep_compile_cache: bool = False) -> None:
    """Give back what building a simulator left behind: MuJoCo's compile cache (decoded meshes and textures, kept for
    a later compile of the same files) unless the adapter recompiles at each reset, and the heap pages glibc's malloc
    holds free. About 200-260 MiB per process (docs/use/environments.md, `python -m ebrl.bench.sim_memory`, whose
    control sets KEEP_BUILD_MEMORY to keep them)."""
    if os.environ.get(KEEP_BUILD_MEMORY):
        return
    mujoco = sys.modules.get("mujoco")
    if mujoco is not None and not keep_compile_cache and hasattr(mujoco, "mj_clearCache"):
        mujoco.mj_clearCache(mujoco.mj_getCache())
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def worker_main(
    conn: multiprocessing.connection.Connection, env_cfg: dict[str, Any], seed: int, cpus: Sequence[int] | None = None
) -> None:
    """Body of a simulator process: build the env, send its spec, then serve notices until "close"."""
    _prepare_process(env_cfg, cpus)
    try:
        simulator = Simulator(env_cfg, seed)
        conn.send(("spec", simulator.adapter.spec))
    except BaseException as e:  # noqa: BLE001  (a failed import can raise SystemExit, too)
        send_quietly(conn, ("error", one_line(e)))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if message[0] == "close":
                break
            send_quietly(conn, simulator.serve(message))
    finally:
        simulator.close()


class Simulator:
    """One env and its shared slot, answering the parent's notices (the protocol above): what a simulator process
    runs, and what scheduler.serial runs in the supervisor itself (ebrl/envs/serial.py)."""

    def __init__(self, env_cfg: dict[str, Any], seed: int) -> None:
        self.adapter = build_adapter(env_cfg, seed)
        self.shm: SharedMemory | None = None
        self.views: dict[str, np.ndarray] = {}
        self.fault, self.chunks = env_cfg.get("fault") or {}, 0

    def serve(self, message: tuple) -> tuple[str, Any]:
        """The answer to one notice: ("ok", reply), ("broken", why) for a broken adapter contract (no replacement
        would do better: the parent stops the run), or ("error", why) (the parent decides)."""
        command = message[0]
        try:
            if command == "attach":  # (a multi-task run's slot is laid out by the pool's joint spec)
                _, shm_name, execute, slot_spec = message
                self.shm = attach_shared_memory(shm_name)
                self.views = SlotLayout.build(slot_spec or self.adapter.spec, execute).views(self.shm.buf)
                return "ok", None
            if command == "reset":
                _write_obs(split_views(self.views, "obs/"), self.adapter.begin_episode(message[1]))
                self.views["header"][:] = 0
                return "ok", None
            if command == "chunk":
                self.chunks += 1
                if self.fault.get("kind") and self.chunks == self.fault["chunk"]:
                    _inject(self.fault)
                return "ok", _run_chunk(self.adapter, self.views, int(message[1]))
            raise ValueError(f"unknown command {command!r}")
        except AdapterContractError as e:
            return "broken", one_line(e)
        except Exception as e:  # noqa: BLE001
            return "error", one_line(e)

    def close(self) -> None:
        self.views.clear()
        try:
            self.adapter.close()
        except Exception:  # noqa: BLE001  (closing at exit: nothing left to tell)
            pass
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:  # a view still referenced: the mapping goes with the process
                pass
            self.shm = None


def _inject(fault: dict[str, Any]) -> None:
    """env.fault, for tests: this process hangs (sleeps far past any chunk timeout), fails inside its chunk, dies
    without a word, or is slow (spends `seconds` of CPU time, then runs its chunk)."""
    if fault["kind"] == "hang":
        time.sleep(3600)
    elif fault["kind"] == "slow":
        until = time.process_time() + float(fault.get("seconds", 1.0))
        while time.process_time() < until:
            pass
    elif fault["kind"] == "error":
        raise RuntimeError(f"injected fault at chunk {fault['chunk']}")
    elif fault["kind"] == "exit":
        os._exit(9)


def _run_chunk(adapter: EnvAdapter, views: dict[str, np.ndarray], n_steps: int) -> dict[str, Any]:
    execute = len(views["actions"])
    if not 1 <= n_steps <= execute:
        raise ValueError(f"chunk of {n_steps} steps; this slot holds 1..{execute}")
    started, cpu = time.perf_counter(), time.thread_time()
    obs, result = adapter.run_chunk(views["actions"][:n_steps, : adapter.spec.action_dim].copy())  # its own dims
    views["clock"][:] = (started, time.perf_counter())
    cpu = time.thread_time() - cpu
    k = result.executed
    views["rewards"][:k] = result.rewards
    views["step_times"][:k] = result.step_times
    views["successes"][:k] = result.successes
    if result.final_obs is not None:
        _write_obs(split_views(views, "final/"), result.final_obs)
    _write_obs(split_views(views, "obs/"), obs)
    views["header"][:] = (k, result.terminated, result.truncated, result.final_obs is not None)
    return {"episode": result.episode, "cpus": sorted(os.sched_getaffinity(0)), "cpu_s": cpu}


def _write_obs(slots: dict[str, np.ndarray], obs: dict[str, np.ndarray]) -> None:
    """The obs into the slot; a state narrower than the slot's (a task of a multi-task run) padded with zeros."""
    for key, slot in slots.items():
        value = obs[key]
        if slot.shape == np.shape(value):
            slot[...] = value
        else:
            n = np.shape(value)[0]
            slot[:n], slot[n:] = value, 0


def send_quietly(conn: multiprocessing.connection.Connection, message: Any) -> None:
    try:
        conn.send(message)
    except (OSError, EOFError):
        pass


def main(argv: list[str]) -> None:
    """`python -m ebrl.envs.process FD`: serve the env the parent sends on the socket FD."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: python -m ebrl.envs.process FD\n\n{__doc__.strip()}")
        return
    conn = multiprocessing.connection.Connection(int(argv[0]))
    try:
        command, env_cfg, seed, cpus = conn.recv()
    except (EOFError, OSError):  # the parent went away before it said what to build
        return
    if command != "init":
        raise SystemExit(f"sim worker: expected 'init', got {command!r}")
    worker_main(conn, env_cfg, seed, cpus)


if __name__ == "__main__":
    main(sys.argv[1:])
