"""The trainer in its own process (DESIGN.md sections 2.1 and 4): it trains on one rollout while the
next one collects, and publishes each update's weights with a version number.

Weights travel through the `WeightChannel` (ebrl/runtime/channel.py): after each update the trainer writes
them, in policy.dtype, into the slot generation is not reading and bumps the version; generation copies them
in at a chunk boundary when the version it holds is older. Rollout batches go to the trainer as torch tensors
over a pipe (torch moves their storage to shared memory; only handles are pickled); results come back on
another pipe, which the scheduler waits on beside the simulator pipes.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ebrl.envs.base import EnvSpec, one_line
from ebrl.policies.build import build_policy
from ebrl.policies.training import load_state
from ebrl.runtime.channel import WeightChannel
from ebrl.runtime.checkpoint import detached_copy
from ebrl.runtime.resources import MEMORY_BUDGET_VAR, apply_memory_budget
from ebrl.runtime.distributed import (
    Ranks,
    close_group,
    full_state,
    join_trainers,
    shard,
    trainer_backend,
    weights_sum,
)
from ebrl.rl.ppo import RolloutBatch


class TrainerError(RuntimeError):
    """The trainer process failed or died; the message is its one-line reason."""


def trainer_main(conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel,
                 requests: multiprocessing.connection.Connection, results: multiprocessing.connection.Connection,
                 cpus: Sequence[int], threads: int, device: str, resume: str | None, successor: bool) -> None:
    """Body of the trainer process: build the policy and the trainer, then serve requests until "stop".

    The first weights: a resumed run's checkpoint (`resume`, the float32 masters and Adam state as they were), else
    policy.checkpoint's file, else the supervisor's (version 0 of the channel). A `successor` (a respawn under a new
    MPS share) holds nothing until its predecessor's state arrives: it allocates only once that one has gone.
    With the channel's slots on the GPU, the trainer attaches its own once it holds weights.

    ("train", iteration, batch, decoupled, is_clip, gather)
        -> ("trained", iteration, metrics, version, start, published, end): the update ran [start, published), the
           weights' publication [published, end); with gather (a checkpoint is due after this update) then also
           ("state", model, optimizer, iteration) (FSDP: gathered by every rank's trainer at the same update)
    ("state",)                                      -> ("state", model state_dict, optimizer state_dict, None)
    ("load", model state_dict, optimizer state_dict) -> nothing: continue from them (a respawn's handover)
    A failure answers ("error", one line) and ends the process.
    """
    from omegaconf import OmegaConf

    from ebrl.runtime.experiment import TRAINERS

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us
    try:
        start_worker(cpus, threads, int(conf["seed"]) + 1, device)
        ranks = Ranks.from_env()  # a child of the supervisor: torchrun's environment is ours too
        group = None
        if ranks.distributed:  # data-parallel with the other ranks' trainers
            if torch.device(device).type == "cuda":  # (a rank sees its own GPU as cuda:0, distributed.pin_gpu)
                torch.cuda.set_device(torch.device(device).index or 0)
            join_trainers(ranks, trainer_backend(device), float(conf["distributed"]["timeout_s"]))
            group = dist.group.WORLD

        def make_trainer(policy: torch.nn.Module) -> Any:
            if group is not None and conf["distributed"]["strategy"] == "fsdp":
                shard(policy)
            return TRAINERS[conf["algo"]["name"]](policy, OmegaConf.create(conf["algo"]), torch.device(device), group)

        policy = trainer = None
        if not successor:
            policy, checkpoint = trainer_policy(conf["policy"], spec, channel, device, resume)
            trainer = make_trainer(policy)
            if checkpoint is not None:
                trainer.load_optimizer_state(checkpoint["optimizer"])
            if channel.cuda:
                channel.attach(device, full_state(policy))
        results.send(("ready",))
        while True:
            try:
                message = requests.recv()
            except (EOFError, OSError):  # the supervisor is gone
                return
            if message[0] == "stop":
                close_group()
                return
            if message[0] == "train":
                _, iteration, batch, decoupled, is_clip, gather = message
                start = time.perf_counter()
                metrics = trainer.update(batch, decoupled=decoupled, is_clip=is_clip)
                published = time.perf_counter()
                state = full_state(policy)  # (sharded: gathered, on every rank; once per update)
                version = channel.publish(state)
                if group is not None:  # the supervisors check that every replica holds the same weights
                    metrics["dist/weights_sum"] = weights_sum(state)
                results.send(("trained", iteration, metrics, version, start, published, time.perf_counter()))
                if gather:
                    results.send(("state", detached_copy(state), detached_copy(trainer.optimizer_state()), iteration))
            elif message[0] == "load":  # a predecessor's state (one rank: see PipelineScheduler.respawn_trainer)
                if policy is None:  # a successor: allocated now that the predecessor has gone
                    policy = build_policy(conf["policy"], spec, device, train=True, weights="given")
                    trainer = make_trainer(policy)
                policy.load_state_dict(message[1])
                trainer.load_optimizer_state(message[2])
                if channel.cuda:
                    channel.attach(device, full_state(policy))
            elif message[0] == "state":  # (not sharded: the gathering would need every rank's trainer at once)
                results.send(("state", detached_copy(policy.state_dict()), detached_copy(trainer.optimizer_state()),
                              None))
            else:
                raise ValueError(f"unknown request {message[0]!r}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
        report_failure(results, e)


def start_worker(cpus: Sequence[int], threads: int, seed: int, device: str) -> None:
    """A spawned worker's start: its cores and threads, subnormals flushed as the supervisor does (experiment.py),
    its seed, and on a GPU without MPS its memory budget (ResourcePool.child_env)."""
    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(seed)
    budget = os.environ.get(MEMORY_BUDGET_VAR)
    if budget and torch.device(device).type == "cuda":
        apply_memory_budget(int(budget), torch.device(device).index or 0)


def trainer_policy(policy_conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, device: str,
                   resume: str | None) -> tuple[torch.nn.Module, dict | None]:
    """The trainer's policy with its first weights (see trainer_main), and the resumed checkpoint (or None)."""
    if resume is not None:  # the float32 masters as they were, not the channel's policy.dtype copy
        policy = build_policy(policy_conf, spec, device, train=True, weights="given")
        checkpoint = torch.load(resume, map_location="cpu", weights_only=False, mmap=True)
        load_state(policy, checkpoint["model"], checkpoint.get("lora"))
        return policy, checkpoint
    if policy_conf.get("checkpoint"):  # the published file, read in full precision
        return build_policy(policy_conf, spec, device, train=True), None
    policy = build_policy(policy_conf, spec, device, train=True, weights="given")
    channel.pull(policy, -1)
    return policy, None


def child_policy(policy_conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, cpus: Sequence[int],
                 threads: int, device: str, seed: int) -> tuple[torch.nn.Module, int]:
    """A generation process's start (`start_worker`) and its policy (eval mode, policy.dtype) with the latest
    published weights; and their version."""
    start_worker(cpus, threads, seed, device)
    policy = build_policy(policy_conf, spec, device, weights="given")
    return policy, channel.pull(policy, -1)


def report_failure(results: multiprocessing.connection.Connection, e: Exception) -> None:
    """Answer a worker's failure as ("error", one line); the supervisor stops the run."""
    try:
        results.send(("error", one_line(e)))
    except OSError:
        pass


class PipedProcess:
    """A spawned child that reads requests from one pipe and answers on another; `what` names it in errors."""

    what = "child process"

    def __init__(self, ctx: Any, target: Any, name: str, head: tuple, tail: tuple) -> None:
        """Start target(*head, requests, results, *tail) in a process of the `ctx` (spawn) context."""
        self._requests, their_requests = ctx.Pipe(duplex=False)[::-1]
        their_results, self.results = ctx.Pipe(duplex=False)[::-1]
        self.process = ctx.Process(target=target, name=name, daemon=True,
                                   args=(*head, their_requests, their_results, *tail))
        self.process.start()
        their_requests.close()
        their_results.close()

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
                self._requests.send(("stop",))
            except OSError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)

    def _died(self) -> str:
        self.process.join(1.0)
        return f"{self.what} (pid {self.process.pid}) stopped; exit code {self.process.exitcode}"


class TrainerProcess(PipedProcess):
    """Supervisor-side handle of the trainer process."""

    what = "trainer process"

    def __init__(self, conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, cpus: Sequence[int],
                 threads: int, device: str, resume: str | None = None, successor: bool = False,
                 start_timeout: float = 600.0, wait: bool = True) -> None:
        """Start the trainer publishing into `channel` (see trainer_main for `resume` and `successor`). Without
        `wait` the caller takes the ("ready",) message itself."""
        import torch.multiprocessing as tmp

        self.channel = channel
        super().__init__(tmp.get_context("spawn"), trainer_main, "ebrl-trainer", (conf, spec, channel),
                         (list(cpus), threads, device, resume, successor))
        if wait:
            self.expect("ready", start_timeout)

    @property
    def waitables(self) -> list[Any]:
        """What `multiprocessing.connection.wait` should watch: results arriving, or the process dying."""
        return [self.results, self.process.sentinel]

    def train(self, iteration: int, batch: RolloutBatch, decoupled: bool, is_clip: float, gather: bool = False) -> None:
        """Train on `batch`; with gather, then send the state too (see trainer_main)."""
        self._send(("train", iteration, batch, decoupled, is_clip, gather))

    def receive(self) -> tuple:
        """The next message (blocks); raises TrainerError if the trainer failed."""
        try:
            message = self.results.recv()
        except (EOFError, OSError) as e:
            raise TrainerError(self._died()) from e
        if message[0] == "error":
            raise TrainerError(f"trainer process failed: {message[1]}")
        return message

    def expect(self, kind: str, timeout: float) -> tuple:
        """The next message, which must be of `kind` and come within `timeout` seconds."""
        if not self.results.poll(timeout):
            raise TrainerError(f"trainer process (pid {self.process.pid}) sent no {kind!r} within {timeout:.0f} s")
        message = self.receive()
        if message[0] != kind:
            raise TrainerError(f"trainer process sent {message[0]!r}, expected {kind!r}")
        return message

    def load(self, model: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Continue from this model and optimizer state (a predecessor's, handed over)."""
        self._send(("load", model, optimizer))

    def request_state(self) -> None:
        """Ask for the model and optimizer state after every update sent so far; it comes back as
        ("state", model, optimizer) in the results."""
        self._send(("state",))

    def _send(self, message: tuple) -> None:
        try:
            self._requests.send(message)
        except OSError as e:
            raise TrainerError(self._died()) from e
