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
    A failure answers ("error", one line) and ends the process.
    """
    from omegaconf import OmegaConf

    from ebrl.runtime.experiment import TRAINERS, build_policy

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us
    try:
        os.sched_setaffinity(0, set(cpus))
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)  # as the supervisor does (experiment.py)
        torch.manual_seed(int(conf["seed"]) + 1)
        policy = build_policy({**conf["policy"], "checkpoint": None}, spec).to(device)
        channel.pull(policy, -1)  # the supervisor's weights (a loaded checkpoint included)
        policy.eval()
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
            elif message[0] == "state":  # (not sharded: the gathering would need every rank's trainer at once)
                results.send(("state", _copied(policy.state_dict()), _copied(trainer.optimizer_state()), None))
            else:
                raise ValueError(f"unknown request {message[0]!r}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
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


class TrainerProcess:
    """Supervisor-side handle of the trainer process."""

    def __init__(self, conf: dict[str, Any], spec: EnvSpec, policy: torch.nn.Module, cpus: Sequence[int],
                 threads: int, device: str, optimizer_state: dict | None = None, start_timeout: float = 600.0) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.channel = WeightChannel(policy, ctx)
        self._requests, their_requests = ctx.Pipe(duplex=False)[::-1]
        their_results, self.results = ctx.Pipe(duplex=False)[::-1]
        self.process = ctx.Process(
            target=trainer_main, name="ebrl-trainer", daemon=True,
            args=(conf, spec, self.channel, their_requests, their_results, list(cpus), threads, device,
                  optimizer_state),
        )
        self.process.start()
        their_requests.close()
        their_results.close()
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

    def request_state(self) -> None:
        """Ask for the model and optimizer state after every update sent so far; it comes back as
        ("state", model, optimizer) in the results."""
        self._send(("state",))

    def close(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self._requests.send(("stop",))
            except OSError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)
        self._requests.close()
        self.results.close()

    def _send(self, message: tuple) -> None:
        try:
            self._requests.send(message)
        except OSError as e:
            raise TrainerError(self._died()) from e

    def _died(self) -> str:
        self.process.join(1.0)
        return f"trainer process (pid {self.process.pid}) stopped; exit code {self.process.exitcode}"
