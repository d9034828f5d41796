"""Placement (docs/internals/design.md, "Placement"): which stage runs where, with how much. One object per run owns the
map stage -> cores / GPU / SM share / memory budget and everything that changes it; the rest of the runtime asks it.

- A schedule's split: every stage on every core (colocated, hybrid), or `scheduler.train_share` of the cores (and,
  on a node with two GPUs, the second GPU) for training alone (disaggregated). The overlapping schedules (async, ebrl)
  are split by the allocator's plan instead (ebrl/alloc), leased through a `ResourcePool` (ebrl/runtime/resources.py):
  cores, on a GPU SM shares (MPS) and memory budgets.
- `take(runtime)` places the runtime's processes: the supervisor (generation, when it is there) beside the
  simulators, every simulator thread on the simulation cores at `scheduler.sim_nice`, generation's and the trainer's
  processes on their leases.
- Work-conserving (`scheduler.work_conserving`): a plan's shares are priorities, not fences. The simulators may
  also run on the cores leased to generation and training (`spare`), niced below them, so a core those stages leave
  idle simulates; with core rebinding such a core is lent to an env only when every simulation core is taken. The
  other way, while the rollout has nothing to run, a trainer process on CPU trains on every core (`lend_to_trainer`).
- `apply()` carries out a new plan in one call: the leases (attached processes move at once), the simulators' cores,
  the generation batch (a regroup), and a respawn of a stage whose SM share or memory budget changed (an MPS share is
  fixed for a process's life); `switched` moves a stage's lease and CPU accounting to a respawned process.
- `measured(...)`: an iteration's figures as the allocator reads them, per stage (`Measured`).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, ContextManager, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.alloc.allocator import Allocator, Measured, describe, held_cores
from ebrl.alloc.memory import GiB, MemoryModel, check_shared_memory, fitting_strategy, render_contexts
from ebrl.alloc.profile import STAGES
from ebrl.checks import generation_place, sm_partition, train_core_count
from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.node import Ranks, cuda_device_count, set_process_affinity
from ebrl.runtime.resources import Lease, MpsDaemons, ResourceError, ResourcePool, apply_memory_budget, visible_gpu
from ebrl.shape import RolloutShape
from ebrl.telemetry.monitor import gpu_free_bytes
from ebrl.telemetry.report import console
from ebrl.telemetry.timers import ProcessCpu, busy_cores

# the processes whose CPU time is each stage's (ProcessCpu groups; the supervisor also orchestrates, and with a
# trainer of its own trains too)
CPU_GROUP = {"simulate": "simulate", "generate": "main", "train": "trainer"}
LOOK_S = 0.2  # the look at the cores' load before a run starts (`supervisor_threads`)


def _share(lease: Lease) -> str:
    return "the whole GPU" if lease.sm_share is None else f"SM share {lease.sm_share:.2f}"


class Placement:
    """See the module docstring. `cores`: this rank's; `device`: where the policy runs; `out_dir`: where MPS daemons
    keep their pipes."""

    def __init__(self, cfg: DictConfig, cores: Sequence[int], device: torch.device, out_dir: Any, ranks: Ranks) -> None:
        self.cfg, self.cores, self.device, self.ranks = cfg, list(cores), device, ranks
        s = cfg.scheduler
        self.generation = "supervisor" if self.local else generation_place(cfg)
        k = train_core_count(s.train_share, len(self.cores)) if s.train_share else 0
        rollout = self.cores[: len(self.cores) - k]
        self.split = {
            "simulate": rollout,
            "generate": rollout,
            "train": self.cores[len(self.cores) - k :] if k else self.cores,
        }
        self.own_gpu = bool(k) and device.type == "cuda" and cuda_device_count() > 1  # (NVML: starts no CUDA)
        self.budgets: dict[str, int] = {}  # GPU bytes per stage (a GPU run's pool: `check_memory`)
        # how the ranks' trainers hold the training state (distributed.strategy; auto: ddp, unless `check_memory`
        # finds that a replica does not fit one GPU)
        self.strategy = "fsdp" if ranks.distributed and cfg.distributed.strategy == "fsdp" else "ddp"
        self.runtime: Any = None  # the Scheduler whose processes this places (`take`)
        self.cpu: ProcessCpu | None = None  # the CPU accounting (`account`)
        self._affinity = os.sched_getaffinity(0)  # given back at close
        self.allocator: Allocator | None = None
        self.pool: ResourcePool | None = None
        self.mps: MpsDaemons | None = None
        # the allocator splits the node between stages that run side by side; disaggregated keeps the split that
        # defines it, and a schedule without overlap runs rollout and training one after the other, each on every
        # core and the whole GPU, as RLinf's do
        if s.train_share is None and s.overlap and not self.local:
            self.allocator = Allocator(cfg, self.cores)  # before any process starts: a bad profile is one line
            console.print(f"allocator={cfg.allocator.name}: {self.allocator.source}", soft_wrap=True)
            self._start_pool(out_dir)

    def _start_pool(self, out_dir: Any) -> None:
        cfg = self.cfg
        try:
            gpus = self.ranks.gpus(cfg.hw.gpus)
            self.pool = ResourcePool(
                self.cores,
                gpus=gpus,
                sm_count=cfg.hw.sm_count,
                gpu_memory_bytes=int(cfg.hw.gpu_memory_gb * 2**30),
                partition=self.partition(),
                run_dir=out_dir,
            )
            self._lease()
            if self.pool.partition == "mps":  # before any CUDA starts: a client's share is fixed then
                self.mps = MpsDaemons(range(gpus), out_dir)
                self.mps.start()
        except ResourceError as e:  # (a missing MPS binary, a pool the hw cannot have: one line)
            raise ConfigError(str(e)) from None

    def partition(self) -> str:
        """How the GPU's SMs are shared out (hw): MPS, green contexts, or shares only recorded ("none")."""
        return sm_partition(self.cfg.hw)

    # --- what the stages get ---------------------------------------------------------------------
    def cpus(self, stage: str) -> list[int]:
        """The stage's cores now: its lease, or the schedule's split. Generation in the supervisor runs beside the
        simulators; training shares every core unless the schedule gives it cores alone."""
        if self.pool is not None and stage in self.pool.leases:
            return list(self.pool.leases[stage].cpus)
        return list(self.split[stage])

    def spare(self) -> list[int]:
        """The cores the simulators may borrow from the policy's stages (work-conserving): every core of this rank
        outside the simulation lease, under an allocator's plan; none while calibrating (every stage on every core),
        for a schedule's own split (disaggregated's is its definition) or with scheduler.work_conserving=false."""
        if self.pool is None or not self.cfg.scheduler.work_conserving:
            return []
        own = set(self.cpus("simulate"))
        return [c for c in self.cores if c not in own]

    @property
    def train_device(self) -> str:
        """Where training runs: the run's device, or the second GPU where the schedule trains on its own."""
        return "cuda:1" if self.own_gpu else str(self.device)

    def threads(self, stage: str) -> int:
        """Torch threads of a stage's process. The supervisor (generation; a local trainer's training too): every
        core where it runs alone (a local trainer takes turns with the rollout) or on a GPU; beside the simulators on
        CPU one, since OpenMP threads of a stage that shares its cores wait for each other (spinning) whenever one is
        preempted (docs/internals/schedules.md, "Measured choices"). A trainer process: its cores where it trains alone
        (its own share, on a GPU, or without overlap, when the rollout waits for it), else one. scheduler.torch_threads
        and train_threads say otherwise."""
        s, cuda = self.cfg.scheduler, self.device.type == "cuda"
        if stage == "train" and not self.local:
            alone = self.split["train"] != self.cores or cuda or not s.overlap
            return s.train_threads or (len(self.split["train"]) if alone else 1)
        return s.torch_threads or (len(self.cores) if self.local or cuda else 1)

    def supervisor_threads(self, foreign: float | None = None) -> int:
        """The supervisor's torch threads now: `threads("generate")`, less the cores other processes hold on CPU
        (`foreign`, their load in cores; None: a short look at the cores, before the run starts anything). Two
        threads beside one busy core ran a step 25x slower than alone, one thread as fast (docs/internals/schedules.md,
        "Measured choices"). scheduler.torch_threads fixes the count."""
        n = self.threads("generate")
        if n == 1 or self.cfg.scheduler.torch_threads or self.device.type != "cpu":
            return n
        if foreign is None:
            foreign = busy_cores(self.cores, LOOK_S)
        return max(1, n - held_cores(foreign))

    def sim_slots(self, foreign: float) -> int:
        """The envs a core the simulators may use runs at once (core rebinding's `CorePool.slots`): one on a quiet
        machine; where other processes hold cores (`held_cores` of `foreign`, their load in cores), every env at
        once, spread over the simulation and spare cores, as without core rebinding. A simulator at
        scheduler.sim_nice gets about a tenth of a core that a nice-0 process holds: one env per core left ebrl 9% of
        its quiet throughput beside two busy processes on two cores (docs/internals/schedules.md, "Measured
        choices")."""
        if not held_cores(foreign):
            return 1
        return math.ceil(self.cfg.env.num_envs / len(self.cpus("simulate") + self.spare()))

    def follow_load(self, foreign: float | None) -> None:
        """The next iteration beside the last one's foreign load (`foreign`, in cores; None: a short look at the
        cores, the first iteration's, while the run's processes wait): the supervisor's threads
        (`supervisor_threads`) and the simulators' slots per core (`sim_slots`)."""
        if foreign is None:
            foreign = busy_cores(self.cores, LOOK_S)
        threads = self.supervisor_threads(foreign)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        cores = self.runtime.dispatcher.cores
        if cores is not None and cores.slots != (slots := self.sim_slots(foreign)):
            self.runtime.simulate_on(self.cpus("simulate"), self.spare(), slots)

    def idle_trainer_threads(self) -> int | None:
        """Work-conserving the other way: the threads a trainer process on CPU trains with while the rollout has
        nothing to run, on every core of this rank (`lend_to_trainer`); None where it keeps its share. Under an
        allocator's plan with scheduler.work_conserving, unless scheduler.train_threads fixes the count (a GPU trains
        on the GPU; a local trainer has every core already)."""
        s = self.cfg.scheduler
        if self.pool is None or not s.work_conserving or s.train_threads or self.local or self.device.type != "cpu":
            return None
        return len(self.cores) if len(self.cores) > self.threads("train") else None

    def lend_to_trainer(self, trainer: Any, idle: bool) -> None:
        """While the rollout has nothing to run (`idle`: every group waits for an update, or the run's rollout is
        done) the trainer process trains on every core with its `idle_trainer_threads`; back on its lease and count
        once a group goes on. Every core first, then the threads to fill them; back, the fewer threads first, and its
        lease's cores once it runs no more threads than they are (at its next optimizer step, or between updates):
        never more threads than cores. Called at every step of the loop: plain attributes only until something
        changes."""
        threads = trainer.shared_threads
        if threads is None or threads.lent is None:
            return
        # (other processes keeping cores busy: no more threads than the cores they leave, since a thread that shares
        # a core with them holds up every barrier of the others)
        foreign = self.cpu.foreign if self.cpu is not None else 0.0
        want = max(1, threads.lent - held_cores(foreign)) if idle else trainer.threads
        try:
            if threads.count != want:
                if idle:
                    self.pin(trainer.pid, self.cores)
                threads.leaving = not idle
                threads.set(want)
            if threads.leaving and threads.running.value <= len(self.cpus("train")):
                self.pin(trainer.pid, self.cpus("train"))
                threads.leaving = False
        except ProcessLookupError:  # it stopped: its pipe tells the run why
            return

    def pin(self, pid: int, cpus: Sequence[int]) -> None:
        """Move a stage's process onto these cores (every thread; the at-scale benchmark's placement moves none)."""
        set_process_affinity(pid, cpus)

    def _keep_lent(self) -> None:
        """A lease just pinned the trainer to its cores (a new plan, a successor): while it is lent every core (or
        still runs the threads it was lent), it keeps them."""
        trainer = self.runtime.trainer
        threads = trainer.shared_threads
        if threads is not None and threads.lent is not None and (threads.count == threads.lent or threads.leaving):
            self.pin(trainer.pid, self.cores)

    def spawn_env(self, stage: str) -> ContextManager:
        """The environment a stage's child starts in (its MPS share, GPU and memory budget), around its start."""
        return self.pool.spawn_env(stage) if self.pool is not None else contextlib.nullcontext()

    def train_group(self) -> Any:
        """The process group a local trainer is data-parallel over: the supervisors' (gloo) on CPU, an NCCL group of
        the same ranks on GPUs; None for one rank."""
        if not self.ranks.distributed:
            return None
        import torch.distributed as dist

        return dist.new_group(backend="nccl") if self.device.type == "cuda" else dist.group.WORLD

    @property
    def local(self) -> bool:
        """The trainer is in the supervisor, on generation's policy (scheduler.trainer=local)."""
        return self.cfg.scheduler.trainer == "local"

    # --- memory ----------------------------------------------------------------------------------
    def check_memory(self, spec: EnvSpec, stage_shares: Callable[..., tuple[dict, str] | None] | None = None) -> None:
        """Before a trainer process and generation start (and any CUDA in this process): stop, with one line, when
        /dev/shm or the GPU cannot hold what the memory model says the run needs; on a GPU lease generation and the
        trainer their budgets (MPS: a pinned-memory limit; otherwise torch's per-process cap, set in the child), and
        settle how several ranks' trainers hold the training state (`strategy`). A local trainer shares nothing but
        the simulators' slots, which are held already: on a GPU its one process is checked against the GPU alone.
        The sizes are the rollout's shape (ebrl/shape.py), the trainer's micro-batch among them.
        `stage_shares(cfg, spec, shape, sharded, device_type)`: of each GPU stage's time, the share its kernels keep
        the SMs busy, and where that comes from (or None), by which a calibrating allocator sizes the stages' SM
        shares before it has measured any (a run cannot measure them per process under MPS: NVML counts every
        client as the daemon's); the run passes the roofline's (ebrl/forecast/gpu_cost.py)."""
        cfg = self.cfg
        gpu = self.device.type == "cuda"
        if self.local and not gpu:
            return
        model = MemoryModel.of(
            OmegaConf.to_container(cfg.policy, resolve=True),
            spec,
            cfg.algo.optimizer_dtype,
            self.device.type,
            trace=gpu,
            cache_prefix=cfg.algo.cache_prefix,
        )
        shape = RolloutShape.of(cfg, self.ranks.world, spec.max_episode_steps, model.execute)
        one_gpu = gpu and cfg.scheduler.train_share is None  # (disaggregated trains on a GPU of its own)
        if (
            not self.local
        ):  # (the simulators' slots are held already; rank 0's trainer alone sends a checkpoint's state)
            check_shared_memory(
                model.shared_memory(0, shape.rows, channel_on_device=one_gpu, checkpoint=self.ranks.leader)
            )
        memory = self.pool.gpu_memory_bytes if self.pool is not None else int(cfg.hw.gpu_memory_gb * GiB)
        if gpu and memory:
            strategy, budgets = fitting_strategy(
                model,
                memory,
                shape.envs,
                shape.micro_rows,
                shape.chunks,
                render_contexts(cfg.env),
                f"hw={cfg.hw.name}",
                self.ranks.world if self.ranks.distributed else 1,
                cfg.distributed.strategy,
                trainer_process=not self.local,
            )
            if strategy != self.strategy and self.ranks.leader:
                console.print(
                    f"distributed.strategy=auto: a replica of the training state does not fit one GPU of "
                    f"hw={cfg.hw.name}: the trainers shard it over the {self.ranks.world} ranks (FSDP)",
                    soft_wrap=True,
                )
            self.strategy = strategy
            if self.local:  # (one process on one copy of the weights: nothing to lease apart)
                return
            self.budgets = budgets
            if stage_shares is not None and self.allocator is not None and self.allocator.current is None:
                found = stage_shares(cfg, spec, shape, self.strategy == "fsdp", self.device.type)
                if found is not None:
                    self.allocator.size_by_kernels(*found)
            if self.pool is not None:
                try:
                    self._lease()
                except ResourceError as e:
                    raise ConfigError(str(e)) from None
        if self.pool is not None and self.pool.partition == "mps":
            if self.generation == "supervisor":  # generation in this process: its share is this one's
                os.environ.update(self.pool.child_env("generate"))
            self.pool.on_requota("generate", self._requota_generation)
            self.pool.on_requota("train", self._requota_trainer)
        elif gpu and self.generation == "supervisor" and "generate" in self.budgets:
            apply_memory_budget(self.budgets["generate"], 0)

    # --- the runtime's processes -----------------------------------------------------------------
    def take(self, runtime: Any) -> None:
        """Place the runtime's processes (see the module docstring) and, with a plan, its generation batch; under MPS,
        say in one line if generation or the trainer is not its daemon's client (its share would not be enforced)."""
        self.runtime = runtime
        # the supervisor generates (unless generation has a process of its own) beside the simulators
        set_process_affinity(
            os.getpid(), self.cpus("generate") if self.generation == "supervisor" else self.split["simulate"]
        )
        for worker in runtime.pool.workers:
            worker.bind(self.cpus("simulate") + self.spare())
            # generation and training are on the critical path of every env: when they want a shared core they get
            # it first, and the simulators fill what is left (docs/internals/schedules.md, "Measured choices")
            worker.renice(self.cfg.scheduler.sim_nice)
        if self.pool is not None:
            for stage, pid in (("generate", runtime.generation.pid), ("train", runtime.trainer.pid)):
                self.pool.attach(stage, pid)
        if self.mps is not None:  # (generation and the trainer are up: each holds its CUDA context, a client's)
            line = self.mps.unenforced(
                {
                    "generation": (runtime.generation.pid, self.pool.leases["generate"].gpu),
                    "the trainer": (runtime.trainer.pid, self.pool.leases["train"].gpu),
                }
            )
            if line is not None:
                console.print(line, soft_wrap=True)
        if self.allocator is not None and self.allocator.current is not None:
            runtime.regroup(self.allocator.current.groups)
            console.print(f"allocator: plan {describe(self.allocator.current)}", soft_wrap=True)

    def process_groups(self) -> dict[str, list[int]]:
        """Which processes do which stage's work: the simulators; this one (orchestration, generation unless it has a
        process of its own, a local trainer's training) with a generation process; the trainer process."""
        runtime = self.runtime
        # (serial: the simulators run in this process, whose CPU time is "main")
        out = {"simulate": [w.pid for w in runtime.pool.workers if w.pid is not None], "main": [os.getpid()]}
        if self.generation == "process":
            out["main"].append(runtime.generation.pid)
        if not self.local:
            out["trainer"] = [runtime.trainer.pid]
        return out

    def account(self) -> ProcessCpu:
        """The CPU accounting of the stages' processes from now on (a respawned process joins its group)."""
        self.cpu = ProcessCpu(self.process_groups(), len(self.cores))
        return self.cpu

    def switched(self, stage: str, old_pid: int, new_pid: int) -> None:
        """A respawned stage's successor took over: the lease moves to it, and its CPU time counts for the stage."""
        if self.pool is not None:
            self.pool.detach(stage, old_pid)
            self.pool.attach(stage, new_pid)
            if stage == "train":
                self._keep_lent()
        if self.cpu is not None:
            self.cpu.add(CPU_GROUP[stage], new_pid)

    def measured(
        self, steps_per_s: float, cpu_shares: dict[str, float], busy: dict[str, float], cpu_busy: float = 0.0
    ) -> Measured:
        """One iteration's figures per stage: `cpu_shares` of the process groups (`account`), `busy` from the
        trace; `cpu_busy`, the rank's cores' busy fraction, less the groups' shares is what other processes kept busy
        (`foreign`, in cores; the thread teams of the supervisor and a lent trainer leave them their cores)."""
        foreign = max(0.0, cpu_busy - sum(cpu_shares.values())) * len(self.cores)
        if self.cpu is not None:
            self.cpu.foreign = foreign
        return Measured(
            steps_per_s, {stage: cpu_shares.get(group, 0.0) for stage, group in CPU_GROUP.items()}, dict(busy), foreign
        )

    # --- plans -----------------------------------------------------------------------------------
    def observe(self, measured: Measured) -> tuple[str | None, dict[str, float]]:
        """The allocator reads an iteration's measurements; a new plan is applied at once. Returns the decision's
        line (None: the plan stands) and the `alloc/` metrics."""
        line, metrics = self.allocator.observe(measured)
        if line is not None:
            self.apply()
        return line, metrics

    def apply(self) -> None:
        """Carry out the allocator's current plan: lease it (the pool moves generation, this process or its own, and
        the trainer, every thread; a changed SM share or budget respawns the stage), move the simulators onto their
        cores, and serve generation in the plan's batches (a regroup at the next common segment boundary; nothing when
        the batch did not change)."""
        self._lease()
        self._keep_lent()
        self.runtime.simulate_on(self.cpus("simulate"), self.spare())
        self.runtime.regroup(self.allocator.current.groups)

    def _lease(self) -> None:
        """Lease each stage its cores of the allocator's plan, and on a GPU generation and training their SM shares
        and memory budgets; before there is a plan (calibrating), every core and no SM share."""
        plan = self.allocator.current
        cpus = self.allocator.leases or {stage: self.cores for stage in STAGES}
        gpu = 0 if self.cfg.hw.gpus else None
        for stage in ("generate", "train"):
            share = None if gpu is None or plan is None else plan.x[stage]
            self.pool.lease(
                stage,
                cpus[stage],
                gpu=gpu,
                sm_share=share,
                mem_bytes=self.budgets.get(stage) if gpu is not None else None,
            )
        self.pool.lease("simulate", cpus["simulate"])

    # An MPS share (and memory cap) is read when a process's CUDA starts: a new one is a new process, started under
    # it while the old one works on (make before break).
    def _requota_generation(self, lease: Lease) -> None:
        if self.generation != "process":  # (scheduler.generation=supervisor: this process's share is fixed)
            return self._requota_recorded(lease, "generation runs in this process (scheduler.generation=supervisor)")
        free = gpu_free_bytes(visible_gpu(0)) if self.cfg.hw.gpus else None
        need = self.budgets.get("generate", 0)
        overlap = free is None or free >= need  # (room for a second copy of generation's weights while it starts)
        with self.spawn_env("generate"):
            self.runtime.generation.respawn(cpus=lease.cpus, overlap=overlap)
        how = (
            "the running one serves until it is ready"
            if overlap
            else f"the GPU has {free / 2**30:.1f} GiB free and a second generation needs {need / 2**30:.1f}: the "
            "running one stopped first, and generation waited for the new one"
        )
        self._requota_started(lease, "generation", how)

    def _requota_trainer(self, lease: Lease) -> None:
        if self.ranks.distributed:  # a successor would have to join the other ranks' process group
            return self._requota_recorded(lease, "the trainer is one of several ranks' data-parallel group")
        with self.spawn_env("train"):
            self.runtime.trainer.respawn(cpus=lease.cpus)
        self._requota_started(
            lease,
            "the trainer",
            "it takes over between two updates, with the model and Adam state; "
            "the old one frees the GPU before the new one allocates",
        )

    @staticmethod
    def _requota_started(lease: Lease, what: str, how: str) -> None:
        console.print(
            f"allocator: {what} restarts with {_share(lease)} (an MPS share is fixed for a process's life); {how}",
            soft_wrap=True,
        )

    @staticmethod
    def _requota_recorded(lease: Lease, why: str) -> None:
        console.print(
            f"allocator: {lease.stage}'s {_share(lease)} is recorded, not applied: {why}, and an MPS share "
            "is fixed for a process's life",
            soft_wrap=True,
        )

    def close(self) -> None:
        """Give this process its cores back and stop the MPS daemons (after every client is gone)."""
        set_process_affinity(os.getpid(), self._affinity)
        if self.mps is not None:
            self.mps.stop()
            self.mps = None
