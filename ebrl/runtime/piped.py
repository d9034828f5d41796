"""A spawned child process that serves requests from one pipe and answers on another: the trainer process and the
generation process are both one (their messages: ebrl/runtime/messages.py)."""

from __future__ import annotations

import multiprocessing.connection
import os
from typing import Any, Sequence, TypeVar

import torch

from ebrl.envs.base import one_line
from ebrl.errors import StageFailed
from ebrl.node import order_gpus_by_bus
from ebrl.runtime.errors import kept_traceback
from ebrl.runtime.messages import Failed, Stop
from ebrl.runtime.resources import MEMORY_BUDGET_VAR, apply_memory_budget

M = TypeVar("M")


def start_worker(cpus: Sequence[int], threads: int, seed: int, device: str) -> None:
    """A spawned worker's start: its cores and threads, subnormals flushed as the supervisor does (experiment.py),
    its seed, its GPUs numbered by bus, and on a GPU without MPS its memory budget (ResourcePool.child_env)."""
    order_gpus_by_bus()  # (inherited from a supervisor; a child a benchmark starts gets it here)
    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(seed)
    budget = os.environ.get(MEMORY_BUDGET_VAR)
    if budget and torch.device(device).type == "cuda":
        apply_memory_budget(int(budget), torch.device(device).index or 0)


def report_failure(results: multiprocessing.connection.Connection, e: Exception) -> None:
    """Answer a worker's failure as `Failed` (one line, and where its traceback is kept); the supervisor stops the
    run."""
    try:
        results.send(Failed(f"{one_line(e)} (traceback in {kept_traceback(e)})"))
    except OSError:
        pass


class PipedProcess:
    """A spawned child that reads requests from one pipe and answers on another; `what` names it in errors, which are
    raised as `error`."""

    what = "child process"
    error: type[StageFailed] = StageFailed

    def __init__(self, ctx: Any, target: Any, name: str, head: tuple, tail: tuple) -> None:
        """Start target(*head, requests, results, *tail) in a process of the `ctx` (spawn) context."""
        self._requests, their_requests = ctx.Pipe(duplex=False)[::-1]
        their_results, self.results = ctx.Pipe(duplex=False)[::-1]
        self.process = ctx.Process(
            target=target, name=name, daemon=True, args=(*head, their_requests, their_results, *tail)
        )
        self.process.start()
        their_requests.close()
        their_results.close()

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def send(self, message: Any) -> None:
        try:
            self._requests.send(message)
        except OSError as e:
            raise self.error(self._died()) from e

    def receive(self) -> Any:
        """The next message (blocks); a child that failed or died raises `error`."""
        try:
            message = self.results.recv()
        except (EOFError, OSError) as e:
            raise self.error(self._died()) from e
        if isinstance(message, Failed):
            raise self.error(f"{self.what} (pid {self.pid}) failed: {message.reason}")
        return message

    def expect(self, kind: type[M], timeout: float | None = None) -> M:
        """The next message, which must be a `kind` and come within `timeout` seconds (None: no limit)."""
        if timeout is not None and not self.results.poll(timeout):
            raise self.error(f"{self.what} (pid {self.pid}) sent no {kind.__name__} within {timeout:.0f} s")
        message = self.receive()
        if not isinstance(message, kind):
            raise self.error(f"{self.what} sent {type(message).__name__}, expected {kind.__name__}")
        return message

    def call(self, message: Any, answer: type[M]) -> M:
        """Send a request and wait for its answer."""
        self.send(message)
        return self.expect(answer)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, kill it if it does not within `timeout`, and close the pipes."""
        self.stop(timeout)
        self._requests.close()
        self.results.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to stop and kill it if it does not within `timeout`; the pipes stay open (another thread
        may still be waiting on them)."""
        if self.process.is_alive():
            try:
                self._requests.send(Stop())
            except OSError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)

    def _died(self) -> str:
        self.process.join(1.0)
        return f"{self.what} (pid {self.process.pid}) stopped; exit code {self.process.exitcode}"
