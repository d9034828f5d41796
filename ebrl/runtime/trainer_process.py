"""The trainer in its own process (docs/design.md, "Processes and what
crosses between them"): it trains on one rollout while the
next one collects, and publishes each update's weights with a version number.

Weights travel through the `WeightChannel` (ebrl/runtime/channel.py): after each update the trainer writes
them, in policy.dtype, into the slot generation is not reading and bumps the version; generation copies them
in at a chunk boundary when the version it holds is older. Rollout batches go to the trainer as torch tensors
over a pipe (torch moves their storage to shared memory; only handles are pickled); results come back on
another pipe, which the scheduler waits on beside the simulator pipes.
"""
from __future__ import annotations

import multiprocessing.connection
import signal
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ebrl.envs.base import EnvSpec
from ebrl.errors import StageFailed
from ebrl.policies.build import build_policy
from ebrl.policies.training import load_state
from ebrl.runtime.channel import WeightChannel
from ebrl.runtime.checkpoint import detached_copy
from ebrl.node import Ranks
from ebrl.runtime.distributed import (
    close_group,
    full_state,
    join_trainers,
    shard,
    trainer_backend,
    weights_sum,
)
from ebrl.runtime.messages import Load, Ready, State, StateRequest, Stop, Train, Trained
from ebrl.runtime.piped import PipedProcess, report_failure, start_worker
from ebrl.rl.rollout import RolloutBatch
from ebrl.rl.trainers import make_trainer


class TrainerError(StageFailed):
    """The trainer process failed or died; the message is its one-line reason."""


def trainer_main(conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel,
                 requests: multiprocessing.connection.Connection, results: multiprocessing.connection.Connection,
                 cpus: Sequence[int], threads: int, device: str, resume: str | None, successor: bool) -> None:
    """Body of the trainer process: build the policy and the trainer, then serve requests until "stop".

    The first weights: a resumed run's checkpoint (`resume`, the float32 masters and Adam state as they were), else
    policy.checkpoint's file, else the supervisor's (version 0 of the channel). A `successor` (a respawn under a new
    MPS share) holds nothing until its predecessor's state arrives: it allocates only once that one has gone.
    With the channel's slots on the GPU, the trainer attaches its own once it holds weights.

    Train        -> Trained; with `gather` (a checkpoint is due after this update) then also State(..., iteration)
                    (FSDP: gathered by every rank's trainer at the same update)
    StateRequest -> State(model, optimizer, None)
    Load         -> nothing: continue from that state (a respawn's handover)
    Stop         -> the process ends
    A failure answers Failed(one line) and ends the process.
    """
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

        def new_trainer(policy: torch.nn.Module) -> Any:
            if group is not None and conf["distributed"]["strategy"] == "fsdp":
                shard(policy)
            return make_trainer(policy, OmegaConf.create(conf["algo"]), device, group)

        policy = trainer = None
        if not successor:
            policy, checkpoint = trainer_policy(conf["policy"], spec, channel, device, resume)
            trainer = new_trainer(policy)
            if checkpoint is not None:
                trainer.load_optimizer_state(checkpoint["optimizer"])
            if channel.cuda:
                channel.attach(device, full_state(policy))
        results.send(Ready())
        while True:
            try:
                message = requests.recv()
            except (EOFError, OSError):  # the supervisor is gone
                return
            if isinstance(message, Stop):
                close_group()
                return
            if isinstance(message, Train):
                start = time.perf_counter()
                metrics = trainer.update(message.batch, decoupled=message.decoupled, is_clip=message.is_clip)
                published = time.perf_counter()
                state = full_state(policy)  # (sharded: gathered, on every rank; once per update)
                version = channel.publish(state)
                if group is not None:  # the supervisors check that every replica holds the same weights
                    metrics["dist/weights_sum"] = weights_sum(state)
                results.send(Trained(message.iteration, metrics, version, start, published, time.perf_counter()))
                if message.gather:
                    results.send(State(detached_copy(state), detached_copy(trainer.optimizer_state()),
                                       message.iteration))
            elif isinstance(message, Load):  # a predecessor's state (one rank: see PipelineScheduler.respawn_trainer)
                if policy is None:  # a successor: allocated now that the predecessor has gone
                    policy = build_policy(conf["policy"], spec, device, train=True, weights="given")
                    trainer = new_trainer(policy)
                policy.load_state_dict(message.model)
                trainer.load_optimizer_state(message.optimizer)
                if channel.cuda:
                    channel.attach(device, full_state(policy))
            elif isinstance(message, StateRequest):  # (not sharded: the gathering would need every rank at once)
                results.send(State(detached_copy(policy.state_dict()), detached_copy(trainer.optimizer_state())))
            else:
                raise ValueError(f"unknown request {type(message).__name__}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
        report_failure(results, e)


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


class TrainerProcess(PipedProcess):
    """Supervisor-side handle of the trainer process."""

    what = "trainer process"
    error = TrainerError

    def __init__(self, conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, cpus: Sequence[int],
                 threads: int, device: str, resume: str | None = None, successor: bool = False,
                 start_timeout: float = 600.0, wait: bool = True) -> None:
        """Start the trainer publishing into `channel` (see trainer_main for `resume` and `successor`). Without
        `wait` the caller takes the `Ready` message itself."""
        import torch.multiprocessing as tmp

        self.channel = channel
        super().__init__(tmp.get_context("spawn"), trainer_main, "ebrl-trainer", (conf, spec, channel),
                         (list(cpus), threads, device, resume, successor))
        if wait:
            self.expect(Ready, start_timeout)

    @property
    def waitables(self) -> list[Any]:
        """What `multiprocessing.connection.wait` should watch: results arriving, or the process dying."""
        return [self.results, self.process.sentinel]

    def train(self, iteration: int, batch: RolloutBatch, decoupled: bool, is_clip: float, gather: bool = False) -> None:
        """Train on `batch`; with gather, then send the state too (see trainer_main)."""
        self.send(Train(iteration, batch, decoupled, is_clip, gather))

    def load(self, model: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Continue from this model and optimizer state (a predecessor's, handed over)."""
        self.send(Load(model, optimizer))

    def request_state(self) -> None:
        """Ask for the model and optimizer state after every update sent so far; it comes back as a `State` (with
        gathered_after None) in the results."""
        self.send(StateRequest())


class TrainerStage:
    """The trainer of a pipelined run: its process (`process`), a successor started under a new share (an MPS share
    is fixed for a process's life) that takes over between two updates, and the states the trainer sends back: a
    checkpoint's, right after the update it is due at (`gathered`), and one asked for (`state`)."""

    def __init__(self, conf: dict[str, Any], spec: EnvSpec, channel: WeightChannel, cpus: Sequence[int],
                 threads: int, device: str, resume: str | None = None) -> None:
        self.conf, self.spec, self.threads, self.device, self.cpus = conf, spec, threads, device, list(cpus)
        self.process = TrainerProcess(conf, spec, channel, self.cpus, threads, device, resume)
        self.successor: TrainerProcess | None = None  # started to take over (`respawn`)
        self.retired: list[TrainerProcess] = []  # stopped predecessors, their pipes closed at `close`
        self.on_switch: Callable[[int, int], None] | None = None  # (old pid, new pid), after a handover
        self.state: tuple[dict, dict] | None = None  # the answer to a state request
        self.gathered: dict[int, tuple[dict, dict]] = {}  # this run's update index -> the state right after it

    @property
    def channel(self) -> WeightChannel:
        return self.process.channel

    def take(self, message: Trained | State) -> Trained | None:
        """A message of the trainer: a state is kept (None is returned), an update's result returned."""
        if isinstance(message, State):
            if message.gathered_after is None:
                self.state = (message.model, message.optimizer)
            else:
                self.gathered[message.gathered_after] = (message.model, message.optimizer)
            return None
        if not isinstance(message, Trained):
            raise TrainerError(f"unexpected message {type(message).__name__} from the trainer process")
        return message

    def take_gathered(self, k: int) -> tuple[dict, dict] | None:
        """The state gathered after update `k`, once it came (older ones, gathered while updates had NaN and no
        checkpoint was written, are dropped)."""
        if k not in self.gathered:
            return None
        for old in [i for i in self.gathered if i < k]:
            del self.gathered[old]
        return self.gathered.pop(k)

    def respawn(self, cpus: Sequence[int] | None = None) -> None:
        """Start a successor in this process's environment of the moment (a new MPS share: set it around this call),
        on `cpus` if given; a successor still starting is replaced."""
        if self.successor is not None:
            self.successor.close()
        if cpus is not None:
            self.cpus = list(cpus)
        self.successor = TrainerProcess(self.conf, self.spec, self.channel, self.cpus, self.threads, self.device,
                                        successor=True, wait=False)

    def successor_ready(self, timeout: float = 0.0) -> bool:
        """A started successor said it is ready (waiting up to `timeout`)."""
        if self.successor is None or (timeout == 0 and not self.successor.results.poll(0)):
            return False
        self.successor.expect(Ready, timeout)
        return True

    def switch(self, model: dict[str, torch.Tensor], optimizer: dict, release: Callable[[], None],
               swap: Callable[[TrainerProcess], None]) -> None:
        """The ready successor trains from now on, from this state (the trainer's after every update sent to it).
        The old one stops first, so its GPU memory is free before the successor allocates (it built nothing yet);
        with the weights' slots on the GPU, generation lets go of the old trainer's slots first (`release`).
        `swap` points the caller's waiting at the successor's pipes."""
        successor, self.successor = self.successor, None
        if self.channel.cuda:
            self.channel.withdraw()
            release()
        old, self.process = self.process, successor
        swap(successor)
        old.stop()
        successor.load(model, optimizer)
        self.retired.append(old)
        if self.on_switch is not None:
            self.on_switch(old.pid, successor.pid)

    def close(self) -> None:
        for trainer in (self.successor, *self.retired, self.process):
            if trainer is not None:
                trainer.close()
