"""The trainer stage of every schedule (docs/internals/design.md, "Processes and what crosses between them"), in one of
two places behind one interface (`Trainer`):

- `LocalTrainer`: in the supervisor, on the very policy generation samples with (colocated: the stages take turns,
  so one copy of the weights serves both, an update is the next version at once, and training uses every core);
- `ProcessTrainer`: in a process of its own, which trains on one rollout while the next one collects and publishes
  each update's weights with a version number through the `WeightChannel` (ebrl/runtime/channel.py): after each
  update it writes them, in policy.dtype, into the slot generation is not reading and bumps the version; generation
  copies them in at a chunk boundary when the version it holds is older. Rollout batches go to the trainer as torch
  tensors over a pipe (torch moves their storage to shared memory; only handles are pickled); results come back on
  another pipe, which the dispatcher waits on beside the simulator pipes. A new MPS share is a successor process
  that takes over between two updates (`Succession`).

Either way updates go in with `train`, and results come back as messages (`Trained`, then `State` when a checkpoint
is due) on the runtime's event queue.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.connection
import os
import signal
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ebrl.envs.base import EnvSpec, one_line
from ebrl.errors import StageFailed
from ebrl.node import Ranks
from ebrl.policies.build import build_policy
from ebrl.policies.training import load_state, lora_scaling
from ebrl.rl.rollout import RolloutBatch
from ebrl.rl.trainers import make_trainer
from ebrl.runtime.channel import SharedWeights, WeightChannel
from ebrl.runtime.checkpoint import detached_copy, restore_weights
from ebrl.runtime.distributed import (
    DistributedError,
    Gathered,
    close_group,
    join_trainers,
    shard,
    trainer_backend,
    weights_sum,
)
from ebrl.runtime.errors import stop_asked, update_then_stop
from ebrl.runtime.messages import Load, Ready, State, StateRequest, Stop, Train, Trained
from ebrl.runtime.piped import PipedProcess, report_failure, start_worker
from ebrl.runtime.placement import Placement
from ebrl.runtime.succession import Succession


class TrainerError(StageFailed):
    """The trainer process failed or died; the message is its one-line reason."""


class TrainerThreads:
    """A trainer process's torch threads, which the supervisor may change while it trains: its share's count, or
    `lent` (every core of the rank; None: never) while the rollout has nothing to run (Placement.lend_to_trainer).
    The supervisor `set`s the count in shared memory; the trainer process takes it up before each optimizer step
    (`follow`), since a thread count is the calling thread's own, and `most` is the largest an update trained with.
    The process says how many it runs on (`running`; 0 between updates, `rest`): the supervisor moves it back onto
    fewer cores only once it runs no more threads than they are (`leaving` until then), since OpenMP threads stacked
    on one core wait for each other at every barrier (docs/internals/schedules.md, "Measured choices"). And `stopping`,
    which the supervisor sets as the run stops: the update in progress ends at its next optimizer step (one rank
    alone)."""

    def __init__(self, ctx: Any, n: int, lent: int | None = None) -> None:
        self.shared = ctx.RawValue("i", n)
        self.running = ctx.RawValue("i", 0)
        self.stopping = ctx.RawValue("b", 0)
        self.most = n
        self.lent = lent
        self.leaving = False  # (the supervisor's: lent cores to give back once `running` allows)

    @property
    def count(self) -> int:
        return int(self.shared.value)

    def set(self, n: int) -> None:
        self.shared.value = n

    def follow(self) -> None:
        n = self.count
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.running.value = n
        self.most = max(self.most, n)

    def rest(self) -> None:
        self.running.value = 0


def trainer_main(
    conf: dict[str, Any],
    spec: EnvSpec,
    channel: WeightChannel,
    requests: multiprocessing.connection.Connection,
    results: multiprocessing.connection.Connection,
    cpus: Sequence[int],
    threads: TrainerThreads,
    device: str,
    resume: str | None,
    successor: bool,
    init: str | None = None,
) -> None:
    """Body of the trainer process: build the policy and the trainer, then serve requests until "stop".

    The first weights: a resumed run's checkpoint (`resume`, the float32 masters and Adam state as they were), else
    `init`'s checkpoint file (its weights in full precision), else policy.checkpoint's file, else the supervisor's
    (version 0 of the channel). A `successor` (a respawn under a new
    MPS share) holds nothing until its predecessor's state arrives: it allocates only once that one has gone.
    With the channel's slots on the GPU, the trainer attaches its own once it holds weights.

    Train        -> Trained; with `gather` (a checkpoint is due after this update) rank 0's then also State(...,
                    iteration) (`checkpoint_state`; FSDP: gathered by every rank's trainer at the same update)
    StateRequest -> State(model, optimizer, None)
    Load         -> nothing: continue from that state (a respawn's handover)
    Stop         -> the process ends
    A failure answers Failed(one line) and ends the process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us
    try:
        start_worker(cpus, threads.count, int(conf["seed"]) + 1, device)
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
            made = make_trainer(policy, OmegaConf.create(conf["algo"]), device, group)
            made.pace = threads.follow
            if group is None:  # (ranks would leave an update at different steps, and their collectives unmatched)
                made.stop_asked = lambda: bool(threads.stopping.value)
            return made

        policy = trainer = None
        if not successor:
            policy, checkpoint = trainer_policy(conf["policy"], spec, channel, device, resume, init)
            trainer = new_trainer(policy)
            if checkpoint is not None:
                trainer.load_optimizer_state(checkpoint["optimizer"])
            if channel.cuda:
                gathered = Gathered(policy)
                channel.attach(device, gathered.state, gathered.whole)
        results.send(Ready())
        while True:
            threads.rest()  # (between updates: its cores may shrink at once)
            try:
                message = requests.recv()
            except (EOFError, OSError):  # the supervisor is gone
                return
            if isinstance(message, Stop):
                close_group()
                return
            if isinstance(message, Train):
                start = time.perf_counter()
                threads.most = 0
                threads.follow()  # (before the update's first passes: the proximal policy's, the advantages)
                metrics = trainer.update(
                    message.batch,
                    decoupled=message.decoupled,
                    is_clip=message.is_clip,
                    critic_only=message.critic_only,
                    version=message.version,
                )
                metrics["sched/train_threads"] = float(threads.most)
                published = time.perf_counter()
                version, fingerprint = publish(policy, channel, fingerprint=group is not None)
                if fingerprint is not None:  # the supervisors check that every replica holds the same weights
                    metrics["dist/weights_sum"] = fingerprint
                results.send(Trained(message.iteration, metrics, version, start, published, time.perf_counter()))
                state = checkpoint_state(policy, trainer, ranks.leader) if message.gather else None
                if state is not None:
                    results.send(State(*state, message.iteration))
            elif isinstance(message, Load):  # a predecessor's state (one rank: see ProcessTrainer.switch)
                if policy is None:  # a successor: allocated now that the predecessor has gone
                    policy = build_policy(conf["policy"], spec, device, train=True, weights="given")
                    trainer = new_trainer(policy)
                policy.load_state_dict(message.model)
                trainer.load_optimizer_state(message.optimizer)
                if channel.cuda:
                    gathered = Gathered(policy)
                    channel.attach(device, gathered.state, gathered.whole)
            elif isinstance(message, StateRequest):  # (not sharded: the gathering would need every rank at once)
                results.send(State(*checkpoint_state(policy, trainer, leader=True)))
            else:
                raise ValueError(f"unknown request {type(message).__name__}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
        report_failure(results, e)


def publish(policy: torch.nn.Module, channel: WeightChannel, fingerprint: bool = False) -> tuple[int, float | None]:
    """Publish the trainer's weights as the next version; returns it and, with `fingerprint`, their `weights_sum`. A
    sharded (FSDP) policy's tensors are gathered one at a time as they are written, on every rank (a collective):
    no rank holds the whole state dict beside its shards."""
    gathered = Gathered(policy, fingerprint=fingerprint)
    version = channel.publish(gathered.state, gathered.whole)
    return version, gathered.weights_sum() if fingerprint else None


def checkpoint_state(policy: torch.nn.Module, trainer: Any, leader: bool) -> tuple[dict, dict] | None:
    """The model and Adam state for a checkpoint, each tensor copied once, into shared memory (the pipe to the
    supervisor then passes handles), on rank 0 (`leader`) alone: None elsewhere. The replicas of DDP hold the same
    state, so the others do nothing; a sharded (FSDP) trainer's is gathered by every rank, a tensor at a time, and
    only rank 0 keeps it (its optimizer state too: gathered to rank 0's host)."""
    gathered = Gathered(policy)
    if not (leader or gathered.sharded):
        return None
    model = {}
    for key, value in gathered.state.items():
        whole = gathered.whole(value)  # (a collective where sharded)
        if leader:
            model[key] = detached_copy(whole, shared=True)
    optimizer = trainer.optimizer_state()  # (sharded: a collective too)
    return (model, detached_copy(optimizer, shared=True)) if leader else None


def trainer_policy(
    policy_conf: dict[str, Any],
    spec: EnvSpec,
    channel: WeightChannel,
    device: str,
    resume: str | None,
    init: str | None = None,
) -> tuple[torch.nn.Module, dict | None]:
    """The trainer's policy with its first weights (see trainer_main), and the resumed checkpoint (or None)."""
    if resume is not None:  # the float32 masters as they were, not the channel's policy.dtype copy
        policy = build_policy(policy_conf, spec, device, train=True, weights="given")
        checkpoint = torch.load(resume, map_location="cpu", weights_only=False, mmap=True)
        load_state(policy, checkpoint["model"], checkpoint.get("lora"))
        return policy, checkpoint
    if init is not None:  # (the supervisor checked that it fits)
        policy = build_policy(policy_conf, spec, device, train=True, weights="given")
        restore_weights(policy, torch.load(init, map_location="cpu", weights_only=False, mmap=True), f"init={init}")
        return policy, None
    if policy_conf.get("checkpoint"):  # the published file, read in full precision
        return build_policy(policy_conf, spec, device, train=True), None
    policy = build_policy(policy_conf, spec, device, train=True, weights="given")
    channel.pull(policy, -1)
    return policy, None


class TrainerProcess(PipedProcess):
    """Supervisor-side handle of one trainer process."""

    what = "trainer process"
    error = TrainerError

    def __init__(
        self,
        conf: dict[str, Any],
        spec: EnvSpec,
        channel: WeightChannel,
        cpus: Sequence[int],
        threads: TrainerThreads,
        device: str,
        resume: str | None = None,
        successor: bool = False,
        init: str | None = None,
    ) -> None:
        """Start the trainer publishing into `channel` (see trainer_main for `resume`, `successor` and `init`); it
        says `Ready` once it serves."""
        import torch.multiprocessing as tmp

        super().__init__(
            tmp.get_context("spawn"),
            trainer_main,
            "ebrl-trainer",
            (conf, spec, channel),
            (list(cpus), threads, device, resume, successor, init),
        )

    @property
    def waitables(self) -> list[Any]:
        """What `multiprocessing.connection.wait` should watch: results arriving, or the process dying."""
        return [self.results, self.process.sentinel]


Post = Callable[[Trained | State], None]


class Trainer:
    """A schedule's trainer stage, wherever it trains (see the module docstring). What both places share: the states
    the trainer sends back, a checkpoint's right after the update it is due at (`gathered`) and one asked for
    (`state`)."""

    weights: Any  # what generation pulls the trainer's weights from: a WeightChannel, or SharedWeights
    threads: int  # torch threads it trains with (its share's)
    shared_threads: TrainerThreads | None = None  # a trainer process's count of the moment (it may be lent cores)

    def __init__(self) -> None:
        self.state: tuple[dict, dict] | None = None  # the answer to a state request
        self.gathered: dict[int, tuple[dict, dict]] = {}  # this run's update index -> the state right after it

    @property
    def pid(self) -> int:
        raise NotImplementedError

    @property
    def process(self) -> TrainerProcess | None:
        """The trainer process whose pipes the dispatcher waits on (None: the trainer posts its messages itself)."""
        return None

    @property
    def torn(self) -> bool:
        """An update was interrupted half-way: the weights here are not a checkpoint's."""
        return False

    def train(
        self,
        iteration: int,
        batch: RolloutBatch,
        decoupled: bool,
        is_clip: float,
        gather: bool = False,
        critic_only: bool = False,
        version: int | None = None,
    ) -> None:
        """Train on `batch` (critic_only: the value head alone) from the weights of `version` (in the count of
        `batch.version`); `Trained` comes back, and with gather then rank 0's `State` too (a checkpoint is due)."""
        raise NotImplementedError

    def request_state(self) -> None:
        """Ask for the model and optimizer state after every update sent so far (a `State` without gathered_after)."""
        raise NotImplementedError

    def hurry(self) -> None:
        """The run is stopping: the update in progress ends at its next optimizer step (a shorter update, whole), so
        that the state asked for next comes soon. In the supervisor a stop does that itself (`update_then_stop`)."""

    def respawn(self, cpus: Sequence[int] | None = None) -> None:
        """Start a successor under the environment of the moment (a new MPS share)."""
        raise NotImplementedError(f"{type(self).__name__} has no process to respawn")

    def successor_ready(self, timeout: float = 0.0) -> bool:
        return False

    def take(self, message: Trained | State) -> Trained | None:
        """A message of the trainer: a state is kept (None is returned), an update's result returned."""
        if isinstance(message, State):
            if message.gathered_after is None:
                self.state = (message.model, message.optimizer)
            else:
                self.gathered[message.gathered_after] = (message.model, message.optimizer)
            return None
        if not isinstance(message, Trained):
            raise TrainerError(f"unexpected message {type(message).__name__} from the trainer")
        return message

    def take_gathered(self, k: int) -> tuple[dict, dict] | None:
        """The state gathered after update `k`, once it came (older ones, gathered while updates had NaN and no
        checkpoint was written, are dropped)."""
        if k not in self.gathered:
            return None
        for old in [i for i in self.gathered if i < k]:
            del self.gathered[old]
        return self.gathered.pop(k)

    def close(self) -> None:
        pass


class LocalTrainer(Trainer):
    """Training in the supervisor on `policy` itself, with this process's threads (colocated's: every core), data-
    parallel over `group` with several ranks; `post` puts its messages on the runtime's event queue. A resumed run's
    weights are already in `policy`; its Adam state is read from `resume`."""

    def __init__(
        self,
        policy: torch.nn.Module,
        algo: Any,
        device: torch.device,
        post: Post,
        resume: str | None = None,
        group: dist.ProcessGroup | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.policy, self.post, self.group, self.rank = policy, post, group, rank
        self.trainer = make_trainer(policy, algo, device, group)
        if group is None:
            self.trainer.stop_asked = stop_asked  # (`update_then_stop` around each update)
        if resume is not None:
            self.trainer.load_optimizer_state(
                torch.load(resume, map_location="cpu", weights_only=False, mmap=True)["optimizer"]
            )
        self.weights = SharedWeights()
        self.threads = torch.get_num_threads()
        self._torn = False

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def torn(self) -> bool:
        return self._torn

    def train(
        self,
        iteration: int,
        batch: RolloutBatch,
        decoupled: bool,
        is_clip: float,
        gather: bool = False,
        critic_only: bool = False,
        version: int | None = None,
    ) -> None:
        start = time.perf_counter()
        self._torn = True  # (stays so when the update is interrupted: its weights are half-stepped)
        # one rank: a Ctrl-C or SIGTERM ends the update at its next step, then stops the run (with several, a rank
        # leaving the update early would leave the others' collectives unmatched: the update is interrupted)
        with update_then_stop() if self.group is None else contextlib.nullcontext():
            try:
                metrics = self.trainer.update(
                    batch, decoupled=decoupled, is_clip=is_clip, critic_only=critic_only, version=version
                )
                if self.group is not None:  # rank 0 checks that every replica holds the same weights
                    metrics["dist/weights_sum"] = weights_sum(self.policy.state_dict())
            except RuntimeError as e:
                if self.group is None:
                    raise
                raise DistributedError(
                    f"rank {self.rank}'s update failed ({one_line(e)}); another rank may have stopped"
                ) from None
            self._torn = False
            published = time.perf_counter()
            self.post(Trained(iteration, metrics, self.weights.publish(), start, published, published))
            if gather and self.rank == 0:  # (the next update changes these in place; the replicas hold the same)
                self.post(State(*self._copy(), iteration))

    def request_state(self) -> None:
        self.post(State(*self._copy()))

    def _copy(self) -> tuple[dict, dict]:
        return detached_copy((self.policy.state_dict(), self.trainer.optimizer_state()))


class ProcessTrainer(Trainer):
    """The trainer in its own process (`process`), and a successor started under a new share that takes over between
    two updates with the model and Adam state (`Succession`). `on_switch(old_pid, new_pid)` after a hand-over."""

    def __init__(
        self,
        conf: dict[str, Any],
        spec: EnvSpec,
        channel: WeightChannel,
        cpus: Sequence[int],
        threads: int,
        device: str,
        resume: str | None = None,
        on_switch: Callable[[int, int], None] | None = None,
        init: str | None = None,
        idle_threads: int | None = None,
    ) -> None:
        super().__init__()
        self.weights, self.threads, self.cpus = channel, threads, list(cpus)
        # the count it trains with now, shared with the process (and a successor): Placement.lend_to_trainer sets it
        self.shared_threads = TrainerThreads(torch.multiprocessing.get_context("spawn"), threads, idle_threads)
        self.succession: Succession[TrainerProcess] = Succession(
            lambda successor: TrainerProcess(
                conf,
                spec,
                channel,
                self.cpus,
                self.shared_threads,
                device,
                None if successor else resume,
                successor,
                None if successor else init,
            ),
            on_switch=on_switch,
        )

    @property
    def process(self) -> TrainerProcess:
        return self.succession.current

    @property
    def pid(self) -> int:
        return self.process.pid

    def train(
        self,
        iteration: int,
        batch: RolloutBatch,
        decoupled: bool,
        is_clip: float,
        gather: bool = False,
        critic_only: bool = False,
        version: int | None = None,
    ) -> None:
        self.process.send(Train(iteration, batch, decoupled, is_clip, gather, critic_only, version))

    def request_state(self) -> None:
        self.process.send(StateRequest())

    def hurry(self) -> None:
        self.shared_threads.stopping.value = 1

    def respawn(self, cpus: Sequence[int] | None = None) -> None:
        """Start a successor in this process's environment of the moment (a new MPS share: set it around this call),
        on `cpus` if given; a successor still starting is replaced."""
        if cpus is not None:
            self.cpus = list(cpus)
        self.succession.respawn()

    def successor_ready(self, timeout: float = 0.0) -> bool:
        return self.succession.successor_ready(timeout)

    def switch(
        self,
        model: dict[str, torch.Tensor],
        optimizer: dict,
        release: Callable[[], None],
        swap: Callable[[TrainerProcess], None],
    ) -> None:
        """The ready successor trains from now on, from this state (the trainer's after every update sent to it).
        The old one stops first, so its GPU memory is free before the successor allocates (it built nothing yet);
        with the weights' slots on the GPU, generation lets go of the old trainer's slots first (`release`).
        `swap` points the dispatcher at the successor's pipes."""
        if self.weights.cuda:
            self.weights.withdraw()
            release()
        swap(self.succession.successor)
        old = self.succession.switch()
        old.stop()
        self.process.send(Load(model, optimizer))
        self.succession.retired.append(old)

    def close(self) -> None:
        self.succession.close()


def make_trainer_stage(
    conf: dict[str, Any],
    spec: EnvSpec,
    policy: torch.nn.Module,
    placement: Placement,
    post: Post,
    resume: str | None = None,
    init: str | None = None,
) -> Trainer:
    """The schedule's trainer (`scheduler.trainer`): in the supervisor on `policy`, or in a process of its own
    started in its stage's environment (placement.spawn_env), on its cores and device, publishing into a new
    `WeightChannel` that holds `policy`'s weights as version 0. `resume`: a run's checkpoint to continue from;
    `init`: the checkpoint `policy`'s first weights came from (a trainer process reads them in full precision)."""
    if placement.local:
        return LocalTrainer(
            policy,
            OmegaConf.create(conf["algo"]),
            placement.device,
            post,
            resume,
            placement.train_group(),
            placement.ranks.rank,
        )
    device = placement.device
    # on one GPU generation reads the trainer's published weights on the device (CUDA IPC), else from host memory
    channel = WeightChannel(
        policy.state_dict(),
        torch.multiprocessing.get_context("spawn"),
        policy.compute_dtype,
        cuda=device.type == "cuda" and placement.train_device == str(device),
        lora_scaling=lora_scaling(conf["policy"]),
    )
    conf = {**conf, "distributed": {**conf["distributed"], "strategy": placement.strategy}}  # (auto: settled)
    with placement.spawn_env("train"):
        return ProcessTrainer(
            conf,
            spec,
            channel,
            placement.cpus("train"),
            placement.threads("train"),
            placement.train_device,
            resume,
            on_switch=functools.partial(placement.switched, "train"),
            init=init,
            idle_threads=placement.idle_trainer_threads(),
        )
