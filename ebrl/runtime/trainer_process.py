"""The trainer in its own process (DESIGN.md sections 2.1 and 4): it trains on one rollout while the
next one collects, and publishes each update's weights with a version number.

Weights travel through shared memory (`WeightChannel`): the trainer copies its parameters into one
shared set and bumps the version; generation copies them out at a chunk boundary when the version it
holds is older. Rollout batches go to the trainer as torch tensors over a pipe (torch moves their
storage to shared memory; only handles are pickled); results come back on another pipe, which the
scheduler waits on beside the simulator pipes.
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


class WeightChannel:
    """The latest published weights in shared memory, with their version; a lock keeps a reader from
    copying a half-written set."""

    def __init__(self, module: torch.nn.Module, ctx: Any) -> None:
        self.tensors = {k: v.detach().to("cpu").clone().share_memory_() for k, v in module.state_dict().items()}
        self._version = ctx.Value("q", 0, lock=False)
        self._lock = ctx.Lock()

    @property
    def version(self) -> int:
        return int(self._version.value)

    def publish(self, state: dict[str, torch.Tensor]) -> int:
        """Copy these weights (a module's whole state dict) in and return the new version (trainer side)."""
        with self._lock, torch.no_grad():
            for key, value in state.items():
                self.tensors[key].copy_(value)
            self._version.value += 1
            return int(self._version.value)

    def pull(self, module: torch.nn.Module, have: int) -> int:
        """Load the published weights into `module` if they are newer than version `have`; the version it now holds."""
        if self.version == have:
            return have
        with self._lock:
            module.load_state_dict(self.tensors)
            return int(self._version.value)


def trainer_main(conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel,
                 requests: multiprocessing.connection.Connection, results: multiprocessing.connection.Connection,
                 cpus: Sequence[int], threads: int, device: str, optimizer_state: dict | None) -> None:
    """Body of the trainer process: build the policy and the trainer, then serve requests until "stop".

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
        # the supervisor's weights (a loaded checkpoint included)
        policy, _ = child_policy(conf["policy"], spec, channel, cpus, threads, device, int(conf["seed"]) + 1)
        ranks = Ranks.from_env()  # a child of the supervisor: torchrun's environment is ours too
        group = None
        if ranks.distributed:  # data-parallel with the other ranks' trainers
            if torch.device(device).type == "cuda":  # (a rank sees its own GPU as cuda:0, distributed.pin_gpu)
                torch.cuda.set_device(torch.device(device).index or 0)
            join_trainers(ranks, trainer_backend(device), float(conf["distributed"]["timeout_s"]))
            group = dist.group.WORLD
            if conf["distributed"]["strategy"] == "fsdp":
                shard(policy)
        trainer = TRAINERS[conf["algo"]["name"]](policy, OmegaConf.create(conf["algo"]), torch.device(device), group)
        if optimizer_state is not None:
            trainer.load_optimizer_state(optimizer_state)
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
                    results.send(("state", _copied(state), _copied(trainer.optimizer_state()), iteration))
            elif message[0] == "load":  # a predecessor's state (one rank: see PipelineScheduler.respawn_trainer)
                policy.load_state_dict(message[1])
                trainer.load_optimizer_state(message[2])
            elif message[0] == "state":  # (not sharded: the gathering would need every rank's trainer at once)
                results.send(("state", _copied(policy.state_dict()), _copied(trainer.optimizer_state()), None))
            else:
                raise ValueError(f"unknown request {message[0]!r}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
        report_failure(results, e)


def child_policy(policy_conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, cpus: Sequence[int],
                 threads: int, device: str, seed: int) -> tuple[torch.nn.Module, int]:
    """A spawned worker's start: its cores and threads, subnormals flushed as the supervisor does (experiment.py),
    its seed, and the policy (eval mode) with the latest published weights; and their version."""
    from ebrl.runtime.experiment import build_policy

    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(seed)
    policy = build_policy({**policy_conf, "checkpoint": None}, spec).to(device)
    version = channel.pull(policy, -1)
    policy.eval()
    return policy, version


def report_failure(results: multiprocessing.connection.Connection, e: Exception) -> None:
    """Answer a worker's failure as ("error", one line); the supervisor stops the run."""
    try:
        results.send(("error", one_line(e)))
    except OSError:
        pass


def _copied(obj: Any) -> Any:
    """A copy of a state dict's tensors, nested ones too (Adam's moments). A tensor sent over the pipe shares its
    storage with ours, and the next update changes the weights and moments in place while the supervisor saves."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


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

    def __init__(self, conf: dict[str, Any], spec: EnvSpec, policy: torch.nn.Module, cpus: Sequence[int],
                 threads: int, device: str, optimizer_state: dict | None = None, start_timeout: float = 600.0,
                 channel: WeightChannel | None = None, wait: bool = True) -> None:
        """`channel`: publish into this one (a successor's: its predecessor's), else a new one from `policy`'s
        weights. Without `wait` the caller takes the ("ready",) message itself."""
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.channel = channel or WeightChannel(policy, ctx)
        super().__init__(ctx, trainer_main, "ebrl-trainer", (conf, spec, self.channel),
                         (list(cpus), threads, device, optimizer_state))
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
