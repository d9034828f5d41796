"""The supervisor: validates the config, builds the parts, runs iterations, logs and checkpoints."""
from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.alloc.allocator import Allocator, describe
from ebrl.alloc.memory import MemoryModel, budgets, check_shared_memory
from ebrl.config import ConfigError, generation_place, rank_cores, sm_partition, validate
from ebrl.envs.base import one_line
from ebrl.envs.worker import SimulatorsFailing, SimWorkerPool, simulator_gpu_environment
from ebrl.node import Ranks
from ebrl.policies.build import build_policy, tokenizer_warning
from ebrl.recipes import recipe_line
from ebrl.rl.grpo import group_seeds
from ebrl.rl.rollout import RolloutBatch, RolloutStats
from ebrl.rl.trainers import make_trainer
from ebrl.runtime.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointWriter,
    detached_copy,
    load_policy_checkpoint,
    model_entries,
    policy_identity,
    restore_weights,
)
from ebrl.runtime.colocated import ColocatedScheduler
from ebrl.runtime.distributed import (
    DistributedError,
    broadcast_module,
    broadcast_object,
    close_group,
    init_supervisors,
    pin_gpu,
    weights_sum,
)
from ebrl.runtime.errors import remove_if_only_hydra_files
from ebrl.runtime.hooks import Checkpoints, Finished, Measure, NanGuard, Progress, RankMetrics, Replan
from ebrl.runtime.pipeline import PipelineScheduler
from ebrl.runtime.resources import (
    Lease,
    MpsDaemons,
    ResourceError,
    ResourcePool,
    apply_memory_budget,
    visible_gpu,
)
from ebrl.runtime.trainer_process import TrainerError
from ebrl.telemetry.metrics import MetricsLog
from ebrl.telemetry.monitor import CpuSampler, GpuMonitor, gpu_free_bytes
from ebrl.telemetry.plots import write_plots
from ebrl.telemetry.report import ProgressBar, console, print_summary
from ebrl.telemetry.timers import CpuMonitor, ProcessCpu, StageTimers

STAGES = ("simulate", "generate", "train")


@dataclass
class RunSummary:
    """What a run achieved; `rollout_steps_per_s` is the value a sweep optimises."""

    env_steps: int = 0
    wall_s: float = 0.0
    rollout_steps_per_s: float = 0.0  # end to end (rollout + training), iterations after the first
    success_rate: float = float("nan")  # over the episodes of the last iteration that finished any
    mean_return: float = float("nan")
    stage_s: dict[str, float] = field(default_factory=dict)
    cpu_busy: float = float("nan")
    # after warm-up: busy_<stage> (trace: share of the wall time a stage was running; simulate: per sim core)
    # and cpu_share_<processes> (their CPU seconds / (cores x wall))
    busy: dict[str, float] = field(default_factory=dict)


def generation_threads(cfg: DictConfig, cores: int, device: torch.device) -> int:
    """Torch threads of this process (generation; colocated: training too), unless scheduler.torch_threads says.

    Colocated runs each stage alone, so it may use every core. A pipelined schedule on CPU runs generation
    beside the simulators and the trainer: OpenMP threads of a stage that shares its cores wait for each
    other (spinning) whenever one is preempted, so it takes one (README, "Measured choices").
    """
    if cfg.scheduler.torch_threads:
        return cfg.scheduler.torch_threads
    return cores if cfg.scheduler.name == "colocated" or device.type == "cuda" else 1


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators from `seed` (the simulators seed themselves from it too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_device(cfg: DictConfig) -> torch.device:
    """Where the policy runs: cuda for device=cuda, or device=auto on hw with GPUs; cpu otherwise. (A rank of
    several sees only its own GPU: `pin_gpu`.)"""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and cfg.hw.gpus > 0)
    return torch.device("cuda" if use_cuda else "cpu")


def _share(lease: Lease) -> str:
    return "the whole GPU" if lease.sm_share is None else f"SM share {lease.sm_share:.2f}"


class Experiment:
    """One training run: simulator workers, policy, trainer (PPO or GRPO) and the colocated schedule."""

    def __init__(self, cfg: DictConfig, run_dir: Path, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        self.conf: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # plain dict across processes
        self.run_dir = run_dir
        self.ranks = ranks or Ranks()
        # rank 0 writes the run's metrics, summary, checkpoints and W&B run; rank r its own metrics and trace in rank<r>
        self.out_dir = run_dir if self.ranks.leader else run_dir / f"rank{self.ranks.rank}"
        self.seed = self.ranks.seed(cfg.seed)  # this rank's simulators and sampling
        self._updating = False  # colocated: inside trainer.update (no checkpoint from there)
        # FSDP: gathering the training state needs every rank's trainer (no checkpoint on the way out)
        self.sharded = self.ranks.distributed and cfg.distributed.strategy == "fsdp"
        self.iteration = 0
        self.env_steps = 0
        self.timers = StageTimers()
        self.pool: SimWorkerPool | None = None
        self.log: MetricsLog | None = None
        self._resume_ckpt: dict[str, Any] | None = None
        self.allocator: Allocator | None = None  # pipelined schedules: plans the stages' cores (ebrl/alloc)
        self.resources: ResourcePool | None = None  # and the leases that apply the plan
        self.mps: MpsDaemons | None = None  # hw.mps: one control daemon per GPU, for this run
        self.generation = "supervisor"  # or "process" (pipelined: config.generation_place)
        self.cpu_shares: ProcessCpu | None = None  # where the CPU went, per group of processes (while training)
        self.writer = CheckpointWriter()  # checkpoints reach the disk in the background
        self.memory_budgets: dict[str, int] = {}  # GPU bytes per stage (pipelined runs on a GPU: _plan_memory)

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: DictConfig, run_dir: str | Path | None = None) -> "Experiment":
        """Validate, then build every part; bad input raises ConfigError/EnvSetupError/CheckpointError (one line)."""
        validate(cfg)
        ranks = Ranks.from_env()
        if run_device(cfg).type == "cuda":
            pin_gpu(ranks)  # before anything touches CUDA
        init_supervisors(ranks, cfg.distributed.timeout_s)
        if cfg.resume:
            run_dir = Path(cfg.resume).expanduser()
        elif run_dir is None:
            from hydra.core.hydra_config import HydraConfig

            run_dir = HydraConfig.get().runtime.output_dir
        own = Path(run_dir)
        run_dir = Path(broadcast_object(str(run_dir), ranks))  # every rank writes into rank 0's run folder
        if own != run_dir:
            remove_if_only_hydra_files(own)  # (the folder Hydra made for this rank a second later)
        exp = cls(cfg, run_dir, ranks)
        if cfg.resume:
            exp._resume_ckpt = exp._read_resume_checkpoint()
        exp._build()
        return exp

    def _read_resume_checkpoint(self) -> dict[str, Any]:
        if not self.run_dir.is_dir():
            raise ConfigError(f"resume={self.cfg.resume} is not a run folder (the folder of an earlier run, with its "
                              "checkpoints/last.pt)")
        return load_policy_checkpoint(self.run_dir / "checkpoints" / "last.pt", self.conf["policy"],
                                      f"resume={self.cfg.resume}")

    def _build(self) -> None:
        cfg, conf = self.cfg, self.conf
        seed_everything(cfg.seed)
        self.cores = rank_cores(cfg)
        self.device = run_device(cfg)
        if cfg.hw.gpus > 1 and not self.ranks.distributed:
            console.print(f"hw={cfg.hw.name} has {cfg.hw.gpus} GPUs and this run is one rank on one of them; "
                          f"`torchrun --nproc-per-node {cfg.hw.gpus} run.py ...` trains on all", soft_wrap=True)
        torch.set_num_threads(generation_threads(cfg, len(self.cores), self.device))
        # Subnormal floats (weights and Adam moments decaying towards 0) take a slow microcode path on x86
        # (README, "Measured choices")
        torch.set_flush_denormal(True)

        # the simulators render on this rank's GPU: read before an MPS client's environment replaces this process's
        sim_env = simulator_gpu_environment(cfg.hw.gpus)
        pipelined = cfg.scheduler.name != "colocated"
        self.generation = generation_place(cfg) if pipelined else "supervisor"
        # the allocator splits the node between stages that run side by side; disaggregated keeps the split that
        # defines it, and a schedule without overlap (hybrid) runs rollout and training one after the other, each on
        # every core and the whole GPU, as RLinf's does
        if pipelined and cfg.scheduler.train_share is None and cfg.scheduler.overlap:
            self.allocator = Allocator(cfg, self.cores)  # before any process starts: a bad profile is one line
            console.print(f"allocator={cfg.allocator.name}: {self.allocator.source}", soft_wrap=True)
            try:
                gpus = 1 if self.ranks.distributed and cfg.hw.gpus else cfg.hw.gpus  # a rank has its own GPU
                self.resources = ResourcePool(self.cores, gpus=gpus, sm_count=cfg.hw.sm_count,
                                              gpu_memory_bytes=int(cfg.hw.gpu_memory_gb * 2**30),
                                              partition=sm_partition(cfg.hw), run_dir=self.out_dir)
                self._lease_plan()
                if self.resources.partition == "mps":  # before any CUDA starts: a client's share is fixed then
                    self.mps = MpsDaemons(range(gpus), self.out_dir)
                    self.mps.start()
            except ResourceError as e:  # (a missing MPS binary, a pool the hw cannot have: one line)
                raise ConfigError(str(e)) from None
        group_size = cfg.algo.group_size if cfg.algo.name == "grpo" else 1  # a group's envs are built alike
        s = cfg.scheduler
        self.pool = SimWorkerPool(env_cfg=conf["env"], num_envs=cfg.env.num_envs, seed=self.seed, group_size=group_size,
                                  chunk_timeout_s=s.chunk_timeout_s, max_failures=s.max_sim_failures,
                                  failure_window_s=s.sim_failure_window_s, process_env=sim_env)
        try:
            self.pool.start()  # simulators build concurrently; their spec shapes the policy
            if pipelined:
                self._plan_memory()
            # generation in its own process: this process only tokenizes, keeps the first weights and restores a
            # checkpoint, on the CPU (no CUDA context here, no second copy of the weights on the GPU)
            here = torch.device("cpu") if self.generation == "process" else self.device
            # colocated trains this policy (float32 masters of what it trains); a pipelined run's only acts. A resumed
            # run's weights come from its checkpoint, so none are initialised
            weights = "given" if self._resume_ckpt is not None else "init"
            self.policy = build_policy(conf["policy"], self.pool.spec, here, train=not pipelined, weights=weights)
            warning = tokenizer_warning(conf["policy"], self.policy)
            if warning:
                console.print(warning, soft_wrap=True)
            if self.ranks.leader:  # (once the run is past its one-line checks: the simulators and policy are built)
                console.print(recipe_line(cfg), soft_wrap=True)
            broadcast_module(self.policy, self.ranks)  # every rank starts from rank 0's weights
            if self.ranks.rank > 0:
                seed_everything(self.seed)  # then samples its own noise
            self.pool.attach(self.policy.chunk_len)
            # a pipelined schedule trains in its own process (built by the scheduler); colocated trains here
            self.trainer = None if pipelined else make_trainer(self.policy, cfg.algo, self.device, self._train_group())
            if self._resume_ckpt is not None:
                self._restore(self._resume_ckpt)
            self.pool.reset_all()
            if pipelined:
                resume = str(self.run_dir / "checkpoints" / "last.pt") if self._resume_ckpt else None
                pooled = self.resources is not None
                self.scheduler = PipelineScheduler(self.pool, self.policy, self.timers, self.device, conf, self.cores,
                                                   base_version=self.iteration, resume=resume,
                                                   generation=self.generation, seed=self.seed + 2,
                                                   spawn_env=self.resources.spawn_env if pooled else None)
                if pooled:
                    generation = self.scheduler.generation
                    for stage, pid in (("generate", generation.pid), ("train", self.scheduler.trainer.process.pid)):
                        self.resources.attach(stage, pid)
                    # a respawned process's successor takes the lease over
                    self.scheduler.trainer.on_switch = functools.partial(self._switched, "train", "trainer")
                    if self.generation == "process":
                        generation.on_switch = functools.partial(self._switched, "generate", "main")
                if self.allocator is not None and self.allocator.current is not None:
                    self.scheduler.simulate_on(self.allocator.leases["simulate"])
                    self._apply_batch()
                    console.print(f"allocator: plan {describe(self.allocator.current)}", soft_wrap=True)
            else:
                self.scheduler = ColocatedScheduler(self.pool, self.policy, self.timers, self.device)
        except BaseException:
            self.close()
            raise

    def _train_group(self) -> Any:
        """The process group colocated training is data-parallel over: the supervisors' (gloo) on CPU, an NCCL group
        of the same ranks on GPUs; None for one rank."""
        if not self.ranks.distributed:
            return None
        import torch.distributed as dist

        return dist.new_group(backend="nccl") if self.device.type == "cuda" else dist.group.WORLD

    def _plan_memory(self) -> None:
        """Before the trainer and generation start (and any CUDA in this process): stop, with one line, when
        /dev/shm or the GPU cannot hold what the memory model says the run needs; on a GPU lease generation and the
        trainer their budgets (MPS: a pinned-memory limit; otherwise torch's per-process cap, set in the child)."""
        cfg, spec = self.cfg, self.pool.spec
        gpu = self.device.type == "cuda"
        model = MemoryModel.of(self.conf["policy"], spec, cfg.algo.optimizer_dtype, self.device.type, trace=gpu)
        chunks = (math.ceil(spec.max_episode_steps / model.chunk_len) if cfg.algo.name == "grpo"
                  else cfg.algo.rollout_chunks)
        rows = cfg.env.num_envs * chunks
        one_gpu = gpu and cfg.scheduler.train_share is None  # (disaggregated trains on a GPU of its own)
        check_shared_memory(model.shared_memory(0, rows, channel_on_device=one_gpu))  # (the simulators' are held)
        if gpu and self.resources is not None:
            micro = cfg.algo.micro_batch or max(1, rows // cfg.algo.minibatches)
            self.memory_budgets = budgets(model, self.resources.gpu_memory_bytes, cfg.env.num_envs, micro, chunks,
                                          rendering=bool(cfg.env.cameras), where=f"hw={cfg.hw.name}")
            try:
                self._lease_plan()
            except ResourceError as e:
                raise ConfigError(str(e)) from None
        if self.resources is not None and self.resources.partition == "mps":
            if self.generation == "supervisor":  # generation in this process: its share is this one's
                os.environ.update(self.resources.child_env("generate"))
            self.resources.on_requota("generate", self._requota_generation)
            self.resources.on_requota("train", self._requota_trainer)
        elif gpu and self.generation == "supervisor" and "generate" in self.memory_budgets:
            apply_memory_budget(self.memory_budgets["generate"], 0)

    def _lease_plan(self) -> None:
        """Lease each stage its cores of the allocator's plan, and on a GPU generation and training their SM shares
        and memory budgets (`_plan_memory`); before there is a plan (calibrating), every core and no SM share.
        Attached processes move at once."""
        plan = self.allocator.current
        cpus = self.allocator.leases or {stage: self.cores for stage in ("simulate", "generate", "train")}
        gpu = 0 if self.cfg.hw.gpus else None
        for stage in ("generate", "train"):
            share = None if gpu is None or plan is None else plan.x[stage]
            self.resources.lease(stage, cpus[stage], gpu=gpu, sm_share=share,
                                 mem_bytes=self.memory_budgets.get(stage) if gpu is not None else None)
        self.resources.lease("simulate", cpus["simulate"])

    def _apply_plan(self) -> None:
        """Lease the new plan (the pool moves generation, this process, and training, the trainer's, every thread)
        and move the simulators onto it."""
        self._lease_plan()
        self.scheduler.simulate_on(self.allocator.leases["simulate"])
        self._apply_batch()

    def _apply_batch(self) -> None:
        """Generation batches of the plan's size: the scheduler regroups the envs at its next common segment
        boundary (a no-op when the batch did not change)."""
        self.scheduler.regroup(self.allocator.current.groups)

    # An MPS share (and memory cap) is read when a process's CUDA starts: a new one is a new process, started under
    # it while the old one works on (make before break).
    def _requota_generation(self, lease: Lease) -> None:
        if self.generation != "process":  # (scheduler.generation=supervisor: this process's share is fixed)
            return self._requota_recorded(lease, "generation runs in this process (scheduler.generation=supervisor)")
        free = gpu_free_bytes(visible_gpu(0)) if self.cfg.hw.gpus else None
        need = self.memory_budgets.get("generate", 0)
        overlap = free is None or free >= need  # (room for a second copy of generation's weights while it starts)
        with self.resources.spawn_env("generate"):
            self.scheduler.generation.respawn(cpus=lease.cpus, overlap=overlap)
        how = ("the running one serves until it is ready" if overlap else
               f"the GPU has {free / 2**30:.1f} GiB free and a second generation needs {need / 2**30:.1f}: the running "
               "one stopped first, and generation waited for the new one")
        self._requota_started(lease, "generation", how)

    def _requota_trainer(self, lease: Lease) -> None:
        if self.ranks.distributed:  # a successor would have to join the other ranks' process group
            return self._requota_recorded(lease, "the trainer is one of several ranks' data-parallel group")
        with self.resources.spawn_env("train"):
            self.scheduler.respawn_trainer(cpus=lease.cpus)
        self._requota_started(lease, "the trainer", "it takes over between two updates, with the model and Adam state; "
                              "the old one frees the GPU before the new one allocates")

    @staticmethod
    def _requota_started(lease: Lease, what: str, how: str) -> None:
        console.print(f"allocator: {what} restarts with {_share(lease)} (an MPS share is fixed for a process's "
                      f"life); {how}", soft_wrap=True)

    @staticmethod
    def _requota_recorded(lease: Lease, why: str) -> None:
        console.print(f"allocator: {lease.stage}'s {_share(lease)} is recorded, not applied: {why}, and an MPS share "
                      "is fixed for a process's life", soft_wrap=True)

    def _switched(self, stage: str, cpu_group: str, old_pid: int, new_pid: int) -> None:
        """A respawned stage's successor took over: the lease moves to it, and its CPU time counts for the stage."""
        self.resources.detach(stage, old_pid)
        self.resources.attach(stage, new_pid)
        if self.cpu_shares is not None:  # (the allocator reads generation's CPU time from the main group)
            self.cpu_shares.add(cpu_group, new_pid)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        restore_weights(self.policy, ckpt, f"resume={self.cfg.resume}")
        if self.trainer is not None:
            self.trainer.load_optimizer_state(ckpt["optimizer"])
        self.iteration = ckpt["iteration"]
        self.env_steps = ckpt["env_steps"]  # the run's, over all ranks
        torch.set_rng_state(ckpt["torch_rng"])
        np.random.set_state(ckpt["numpy_rng"])
        if self.ranks.rank > 0:  # the checkpoint holds rank 0's generators; the others continue from their own seeds
            seed_everything(self.seed + self.iteration)

    # --- running ---------------------------------------------------------------------------
    def train(self) -> RunSummary:
        """Run the remaining iterations, each followed by the hooks (ebrl/runtime/hooks.py); always closes the
        simulator processes."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.conf))
        self.scheduler.trace.stream_to(self.out_dir / "trace.json")  # (a long run's spans are not all kept)
        resume_id = self._resume_ckpt.get("wandb_id") if self._resume_ckpt else None
        logger = self.conf["logger"] if self.ranks.leader else {"name": "none"}  # one W&B run: rank 0's
        self.log = MetricsLog(self.out_dir, logger, self.conf, resume_id=resume_id)
        gpu = GpuMonitor() if cfg.hw.gpus else None  # device totals; each stage's own GPU time is in the trace
        if gpu is not None:
            gpu.start()
            if not gpu.available:
                console.print(f"no GPU figures: {gpu.reason}", soft_wrap=True)
        monitors = (CpuMonitor(self.cores), gpu, ProcessCpu(self.stage_processes(), len(self.cores)))
        self.cpu_shares = monitors[2]
        cpu_samples = CpuSampler(self.cores)  # cpu_busy.png; the per-iteration metrics come from the CpuMonitor
        start = time.perf_counter()
        cpu_samples.start()
        bar = ProgressBar(total=cfg.iterations, done=self.iteration, enabled=cfg.progress)
        measure, guard = Measure(cfg.iterations), NanGuard(cfg.algo.max_nonfinite_updates,
                                                           self.run_dir / "checkpoints" / "last.pt", cfg.algo.lr)
        pipelined = self.trainer is None
        hooks = [
            *([Replan(self.allocator, self._apply_plan)] if self.allocator is not None else []),
            RankMetrics(self.ranks), self._record, measure, Progress(bar), guard,
            Checkpoints(cfg.checkpoint_every, cfg.iterations, guard, self.ranks.leader, self.save_checkpoint,
                        self.scheduler.gathered_state if pipelined else lambda iteration: None),
        ]
        try:
            while self.iteration < cfg.iterations:
                it = self._iterate(monitors)
                for hook in hooks:
                    hook(it)
            summary = self._summarise(start, measure)
            self._write_telemetry(start, cpu_samples, gpu)
            self.log.log_summary(summary.__dict__)
        except BaseException as e:  # what can be written is: a checkpoint where the state is whole, the telemetry
            if isinstance(e, (KeyboardInterrupt, SimulatorsFailing)) and self.ranks.leader:
                self._save_on_the_way_out()
            try:
                self._write_telemetry(start, cpu_samples, gpu)
            except Exception as failed:  # noqa: BLE001  (the run's own error is the one to report)
                console.print(f"no trace or plots: {one_line(failed)}", soft_wrap=True)
            raise
        finally:
            bar.close()
            for monitor in (cpu_samples, gpu):
                if monitor is not None:
                    monitor.stop()
            self.close()
        (self.out_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
        if self.ranks.leader:
            print_summary(summary, self.run_dir)
        return summary

    def _iterate(self, monitors: tuple[CpuMonitor, GpuMonitor | None, ProcessCpu]) -> Finished:
        """One iteration: rollout and update (pipelined: overlapping, one update finished), and this rank's
        figures of it."""
        cpu, gpu, shares = monitors
        mark = self.scheduler.trace.mark()  # spans of this iteration are added past it
        t0 = time.perf_counter()
        if self.trainer is None:  # pipelined: rollout and training overlap; one update finished
            stats, train_metrics = self.scheduler.next_iteration()
            t_rollout = time.perf_counter() - t0
        else:
            batch, stats = self.collect()
            t_rollout = time.perf_counter() - t0
            t_train = time.perf_counter()
            with self.timers.stage("train"):
                train_metrics = self._update(batch)
            self.scheduler.trace.add("train", "update", t_train, time.perf_counter(), iteration=self.iteration)
        wall = time.perf_counter() - t0
        busy_stages = self.scheduler.trace.busy(t0, t0 + wall, len(self.scheduler.sim_cpus), since=mark)
        self.iteration += 1
        metrics = {
            "iteration": self.iteration,
            "perf/iteration_env_steps": stats.env_steps,  # this rank's, this iteration
            "perf/env_steps_per_s": stats.env_steps / wall,
            "perf/rollout_only_steps_per_s": stats.env_steps / t_rollout,
            "time/iteration_s": wall,
            **self.timers.pop_iteration(),
            **cpu.read(),
            **(gpu.read() if gpu is not None else {}),
            **shares.read(),
            **stats.metrics(),
            **train_metrics,
            **{f"perf/busy_{stage}": value for stage, value in busy_stages.items()},
        }
        return Finished(self.iteration, t0, metrics)

    def _record(self, it: Finished) -> None:
        """Count the run's env steps (over every rank) and log the iteration: rank 0 the run's figures, the others
        their own."""
        self.env_steps += int(it.run["perf/iteration_env_steps"])
        it.metrics["env_steps"] = it.run["env_steps"] = self.env_steps
        self.log.log(it.run if self.ranks.leader else it.metrics)

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        """Colocated training's update; with several ranks a failed all-reduce (another rank died) is one line."""
        self._updating = True
        try:
            metrics = self.trainer.update(batch)
            if self.ranks.distributed:  # rank 0 checks that every replica holds the same weights
                metrics["dist/weights_sum"] = weights_sum(self.policy.state_dict())
            return metrics
        except RuntimeError as e:
            if not self.ranks.distributed:
                raise
            raise DistributedError(f"rank {self.ranks.rank}'s update failed ({one_line(e)}); another rank may have "
                                   "stopped") from None
        finally:
            self._updating = False

    def _save_on_the_way_out(self) -> None:
        """A checkpoint as the run stops; if the state cannot be had any more (the trainer or another rank is gone)
        the last one stays, as atomic_save leaves it. Not from inside an update: its weights would be half-stepped."""
        if self._updating or self.sharded:  # (FSDP: gathering the state needs every rank, and some may be gone)
            console.print("no final checkpoint: checkpoints/last.pt stays the one written before", soft_wrap=True)
            return
        try:
            state = None
            if self.trainer is None:  # pipelined: the trainer's newest state, after updates not yet logged
                state = self.scheduler.training_state()
                self._log_unreturned()
            self.save_checkpoint(state)
        except (TrainerError, DistributedError, OSError) as e:
            console.print(f"no final checkpoint ({e}); checkpoints/last.pt is the one written before", soft_wrap=True)

    def _log_unreturned(self) -> None:
        """Count and log the updates the trainer finished that the loop has not handed out (a run stopping): their
        rollout's and training's figures, without the iteration's timing, which nobody measured."""
        for stats, train_metrics in self.scheduler.unreturned():
            self.iteration += 1
            # (several ranks: the others' steps are not here; each rank collects as many as this one)
            steps = stats.env_steps * self.ranks.world
            self.env_steps += steps
            self.log.log({"iteration": self.iteration, "perf/iteration_env_steps": steps, **stats.metrics(),
                          **train_metrics, "env_steps": self.env_steps})

    def _summarise(self, start: float, measure: Measure) -> RunSummary:
        """The run's totals (what summary.json, the console table and W&B's summary show)."""
        end = time.perf_counter()
        summary = RunSummary(env_steps=self.env_steps, wall_s=end - start, rollout_steps_per_s=measure.steps_per_s,
                             success_rate=measure.success_rate, mean_return=measure.mean_return,
                             cpu_busy=measure.cpu_busy, busy=measure.stage_means())
        if self.trainer is None:  # stages overlap: their busy time from the trace (simulation: per sim core)
            busy_s = self.scheduler.trace.busy(start, end, len(self.scheduler.sim_cpus))
            summary.stage_s = {k: busy_s[k] * (end - start) for k in STAGES}
        else:
            summary.stage_s = {k: self.timers.total.get(k, 0.0) for k in STAGES}
        return summary

    def _write_telemetry(self, start: float, cpu_samples: CpuSampler, gpu: GpuMonitor | None) -> None:
        """trace.json and the utilisation plots, while the W&B run is still open to take the plots."""
        end = time.perf_counter()
        for monitor in (cpu_samples, gpu):  # their sample lists are final from here
            if monitor is not None:
                monitor.stop()
        trace = self.scheduler.trace
        trace.write(self.out_dir / "trace.json")
        plots = write_plots(self.out_dir, trace, start, end, len(self.scheduler.sim_cpus), cpu_samples.samples,
                            gpu.samples if gpu is not None else None)
        self.log.log_images(plots, self.env_steps)

    def stage_processes(self) -> dict[str, list[int]]:
        """Which processes do which stage's work: simulators, this one (orchestration; generation, and colocated
        training too) with a generation process of its own, the trainer process (pipelined)."""
        out = {"simulate": [w.pid for w in self.pool.workers], "main": [os.getpid()]}
        if self.generation == "process":
            out["main"].append(self.scheduler.generation.pid)
        if self.trainer is None:
            out["trainer"] = [self.scheduler.trainer.process.pid]
        return out

    def collect(self) -> tuple[RolloutBatch, RolloutStats]:
        """One iteration's rollout: algo.rollout_chunks per env (ppo), or one whole episode per env from
        its group's seeded reset (grpo)."""
        cfg = self.cfg
        if cfg.algo.name == "grpo":
            chunks = math.ceil(self.pool.spec.max_episode_steps / self.policy.chunk_len)
            seeds = group_seeds(self.seed, self.iteration, cfg.env.num_envs, cfg.algo.group_size)
            return self.scheduler.collect(chunks, reset_seeds=seeds)
        return self.scheduler.collect(cfg.algo.rollout_chunks)

    def save_checkpoint(self, state: tuple[dict, dict] | None = None) -> Path:
        """checkpoints/last.pt at self.iteration: `state` (model, optimizer), or the state of this iteration's update
        (pipelined: what the trainer process sent right after it). Written in the background (`CheckpointWriter`):
        the run goes on while it reaches the disk; the next save, and closing, wait for it."""
        path = self.run_dir / "checkpoints" / "last.pt"
        if state is not None:
            model, optimizer = state
        elif self.trainer is None:  # (the trainer process sent copies)
            model, optimizer = self.scheduler.gathered_state(self.iteration)
        else:  # colocated: the next update changes these in place
            model, optimizer = detached_copy((self.policy.state_dict(), self.trainer.optimizer.state_dict()))
        self.writer.save({
            "format": CHECKPOINT_FORMAT,
            "policy": policy_identity(self.conf["policy"]),
            **model_entries(model, self.conf["policy"]),
            "optimizer": optimizer,
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "wandb_id": self.log.wandb_id if self.log else None,
            "config": self.conf,
        }, path)  # (checkpoints/previous.pt keeps the one before, should this one turn out unreadable)
        return path

    def close(self) -> None:
        try:
            self.writer.wait()  # the last checkpoint on disk before anything goes
        except OSError as e:
            console.print(f"the last checkpoint was not written ({one_line(e)}); checkpoints/previous.pt is the one "
                          "before", soft_wrap=True)
        if isinstance(getattr(self, "scheduler", None), PipelineScheduler):
            self.scheduler.close()
        if self.pool is not None:
            self.pool.close()
        if self.mps is not None:  # after every client is gone
            self.mps.stop()
            self.mps = None
        if self.log is not None:
            self.log.close()
            self.log = None
        close_group()
