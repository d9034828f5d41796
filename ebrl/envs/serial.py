"""scheduler.serial: the simulators in the supervisor itself, for debugging (a `breakpoint()` in an adapter stops
there, in this terminal).

A `SimWorker` then talks to an `InProcess` connection instead of a process's socket. Its `send` hands the notice to
one thread of this process, "ebrl-simulators", which answers it with the code a simulator process runs
(`Simulator.serve`); the answer waits in the connection, which is readable (`fileno`) until it is received, so the
dispatcher waits on it as on a process's pipe. Every env is built, reset and stepped in that one thread, one notice
at a time: a renderer's GL context stays current where it was made.
"""

from __future__ import annotations

import os
import select
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ebrl.envs.base import one_line, use_headless_gl

_lock = threading.Lock()
_thread: ThreadPoolExecutor | None = None


def simulators_thread() -> ThreadPoolExecutor:
    """The one thread that runs every in-process simulator (started with the first)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = ThreadPoolExecutor(1, thread_name_prefix="ebrl-simulators")
        return _thread


class InProcess:
    """The connection of one in-process simulator (see the module docstring): `build(env_cfg, seed)` makes it (a
    `Simulator`) in the simulators' thread, what a SimWorker sends is served there, and its answers are received in
    order. `close` closes the env."""

    def __init__(self, build: Callable[[dict[str, Any], int], Any], env_cfg: dict[str, Any], seed: int) -> None:
        self._readable, self._signal = os.pipe()  # a byte per answer waiting
        self._answers: deque[tuple[str, Any]] = deque()
        self._make, self._simulator = build, None
        self._closing: Future | None = None  # the env's close, once asked for
        self._pipe_lock, self._pipe_open = threading.Lock(), True  # no notice is written once the pipe is closed
        self._run(self._build, dict(env_cfg), int(seed))

    # --- the simulators' thread
    def _build(self, env_cfg: dict[str, Any], seed: int) -> tuple[str, Any]:
        if env_cfg.get("cameras"):
            use_headless_gl()
        try:
            self._simulator = self._make(env_cfg, seed)
        except BaseException as e:  # noqa: BLE001  (what a process sends when its build fails)
            return "error", one_line(e)
        return "spec", self._simulator.adapter.spec

    def _serve(self, message: tuple) -> tuple[str, Any]:
        if self._simulator is None:
            return "error", "the simulator was not built"
        return self._simulator.serve(message)  # (attaching leaves the block its SimWorker created registered)

    def _close(self) -> None:
        if self._simulator is not None:
            self._simulator.close()
            self._simulator = None

    def _run(self, work: Any, *args: Any) -> Future:
        closing = work == self._close  # (a bound method is a new object at each access: `is` never holds)
        try:
            future = simulators_thread().submit(work, *args)
        except RuntimeError:  # the interpreter is exiting and its thread has stopped: a close runs here, at once
            if not closing:
                raise OSError("the interpreter is exiting: the in-process simulator serves no more") from None
            future = Future()
            future.set_result(work())
            return future
        if not closing:  # (a close sends no answer)
            future.add_done_callback(self._answered)
        return future

    def _answered(self, future: Future) -> None:
        error = future.exception()
        self._answers.append(("error", one_line(error)) if error is not None else future.result())
        # `close` waits for every notice sent before it, except where the interpreter's exit ran it at once, ahead of
        # the thread's queue: an answer that comes after it has nobody to read it (and its descriptor may be reused)
        with self._pipe_lock:
            if self._pipe_open:
                os.write(self._signal, b"!")

    # --- the SimWorker's side: a multiprocessing Connection's methods
    def send(self, message: tuple) -> None:
        if self._closing is not None:
            raise OSError("the in-process simulator is closed")
        if message[0] == "close":
            self._closing = self._run(self._close)
        elif message[0] != "init":  # (what a process is built from: this one was, at construction)
            self._run(self._serve, message)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(select.select([self._readable], [], [], timeout)[0])

    def recv(self) -> tuple[str, Any]:
        if self._closing is not None and not self._answers:
            raise EOFError("the in-process simulator is closed")
        os.read(self._readable, 1)  # (blocks until an answer came)
        return self._answers.popleft()

    def fileno(self) -> int:
        return self._readable

    def close(self) -> None:
        """Close the env (in the simulators' thread, after what was sent before) and then the pipe."""
        if self._closing is None:
            self._closing = self._run(self._close)
        self._closing.result()
        with self._pipe_lock:
            self._pipe_open = False
        for fd in (self._readable, self._signal):
            try:
                os.close(fd)
            except OSError:
                pass
