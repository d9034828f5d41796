"""The supervisor: validates the config, builds the parts, runs iterations, logs and checkpoints
(docs/internals/design.md, "A run")."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.alloc.allocator import Measured
from ebrl.checks import rank_cores, validate
from ebrl.config import ConfigError
from ebrl.envs.base import one_line
from ebrl.envs.worker import SimulatorsFailing, SimWorkerPool, simulator_gpu_environment
from ebrl.forecast.gpu_cost import roofline_shares
from ebrl.node import Ranks, order_gpus_by_bus, visible_gpu
from ebrl.policies.build import build_policy, executed_line, settle_execute, tokenizer_warning
from ebrl.recipes import recipe_line
from ebrl.runs.base import Run, run_device, run_folder, seed_everything
from ebrl.runs.hooks import Checkpoints, Finished, Measure, NanGuard, Progress, RankMetrics, Replan, Success
from ebrl.runs.init import describe, init_file
from ebrl.runtime.checkpoint import (
    CheckpointWriter,
    adopt_norm_stats,
    checkpoint_record,
    load_checkpoint,
    load_policy_checkpoint,
    restore_weights,
)
from ebrl.runtime.distributed import (
    DistributedError,
    broadcast_module,
    broadcast_object,
    close_group,
    init_supervisors,
    pin_gpu,
)
from ebrl.runtime.errors import remove_if_only_hydra_files
from ebrl.runtime.placement import Placement
from ebrl.runtime.schedule import Scheduler
from ebrl.runtime.trainer import TrainerError
from ebrl.shape import RolloutShape
from ebrl.telemetry.metrics import MetricsLog
from ebrl.telemetry.monitor import CpuSampler, GpuMonitor
from ebrl.telemetry.plots import write_plots
from ebrl.telemetry.report import ProgressBar, console, print_summary
from ebrl.telemetry.timers import CpuMonitor, ProcessCpu

STAGES = ("simulate", "generate", "train")


@dataclass
class RunSummary:
    """What a run achieved; `rollout_steps_per_s` is the value a sweep optimises."""

    env_steps: int = 0
    wall_s: float = 0.0
    rollout_steps_per_s: float = 0.0  # end to end (rollout + training), iterations after the first
    success_rate: float = float("nan")  # over the episodes of the last iteration that finished any
    mean_return: float = float("nan")
    # over the episodes of the first and the last (up to 3) iterations that finished any, with their intervals
    success_start: Success | None = None
    success_end: Success | None = None
    stage_s: dict[str, float] = field(default_factory=dict)
    cpu_busy: float = float("nan")
    sim_cpu_ms_per_step: float = float("nan")  # the simulators' CPU time per env step after warm-up
    # after warm-up: busy_<stage> (trace: share of the wall time a stage was running; simulate: per sim core)
    # and cpu_share_<processes> (their CPU seconds / (cores x wall))
    busy: dict[str, float] = field(default_factory=dict)
    measured: Measured | None = None  # the same per stage, as the allocator and a sweep trial read them

    def figures(self) -> dict[str, Any]:
        """What summary.json and W&B's summary hold."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("measured", "success_start", "success_end")}
        for key in ("success_start", "success_end"):
            value = getattr(self, key)
            out[key] = None if value is None else dataclasses.asdict(value)
        return out


class Experiment(Run):
    """One training run: simulator workers, the policy, the placement of the stages and the schedule's runtime."""

    def __init__(self, cfg: DictConfig, run_dir: Path, ranks: Ranks | None = None) -> None:
        super().__init__(cfg, run_dir)
        self.ranks = ranks or Ranks()
        # rank 0 writes the run's metrics, summary, checkpoints and W&B run; rank r its own metrics and trace in rank<r>
        self.out_dir = run_dir if self.ranks.leader else run_dir / f"rank{self.ranks.rank}"
        self.iteration = 0
        self.env_steps = 0
        self.pool: SimWorkerPool | None = None
        self.gpus: list[str] = []  # this rank's GPUs, as its CUDA_VISIBLE_DEVICES named them before MPS (_build)
        self.placement: Placement | None = None
        self.scheduler: Scheduler | None = None
        self.log: MetricsLog | None = None
        self._resume_ckpt: dict[str, Any] | None = None
        self.writer = CheckpointWriter()  # checkpoints reach the disk in the background

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: DictConfig, run_dir: str | Path | None = None) -> "Experiment":
        """Validate, then build every part; bad input raises ConfigError/EnvSetupError/CheckpointError (one line)."""
        order_gpus_by_bus()  # before anything counts or starts a GPU; every child inherits it
        validate(cfg)
        init_file(cfg)  # (an init that names nothing: one line before anything starts)
        executes = settle_execute(cfg)  # (before the config is read: the placement's memory, the processes' copies)
        ranks = Ranks.from_env()
        if run_device(cfg).type == "cuda":
            pin_gpu(ranks)  # before anything touches CUDA
        init_supervisors(ranks, cfg.distributed.timeout_s)
        run_dir = own = run_folder(cfg, run_dir)
        run_dir = Path(broadcast_object(str(run_dir), ranks))  # every rank writes into rank 0's run folder
        if own != run_dir:
            remove_if_only_hydra_files(own)  # (the folder Hydra made for this rank a second later)
        exp = cls(cfg, run_dir, ranks)
        if cfg.resume:
            exp._resume_ckpt = exp._read_resume_checkpoint()
        exp._build()
        line = executed_line(exp.policy, executes)
        if line and ranks.leader:
            console.print(line, soft_wrap=True, markup=False)
        return exp

    def _read_resume_checkpoint(self) -> dict[str, Any]:
        if not self.run_dir.is_dir():
            raise ConfigError(
                f"resume={self.cfg.resume} is not a run folder (the folder of an earlier run, with its "
                "checkpoints/last.pt)"
            )
        return load_policy_checkpoint(
            self.run_dir / "checkpoints" / "last.pt", self.conf["policy"], f"resume={self.cfg.resume}"
        )

    @property
    def seed(self) -> int:
        """This rank's seed for its simulators and sampling."""
        return self.ranks.seed(self.cfg.seed)

    @property
    def cores(self) -> list[int]:
        return self.placement.cores

    def _build(self) -> None:
        cfg, conf = self.cfg, self.conf
        device = self.start_device()
        if cfg.hw.gpus > 1 and not self.ranks.distributed:
            console.print(
                f"hw={cfg.hw.name} has {cfg.hw.gpus} GPUs and this run is one rank on one of them; "
                f"`torchrun --nproc-per-node {cfg.hw.gpus} run.py ...` trains on all",
                soft_wrap=True,
            )
        # Subnormal floats (weights and Adam moments decaying towards 0) take a slow microcode path on x86
        # (docs/internals/schedules.md, "Measured choices")
        torch.set_flush_denormal(True)
        # the simulators render on this rank's GPU, and its telemetry samples its own GPUs (by their node's numbers):
        # read before an MPS client's environment replaces this process's
        sim_env = simulator_gpu_environment(cfg.hw.gpus)
        self.gpus = [visible_gpu(i) for i in range(self.ranks.gpus(cfg.hw.gpus))]
        try:
            # the allocator's first plan and the leases, and MPS daemons when hw asks for them, before any process
            self.placement = Placement(cfg, rank_cores(cfg), device, self.out_dir, self.ranks)
            torch.set_num_threads(self.placement.supervisor_threads())
            shape = RolloutShape.of(cfg, self.ranks.world)  # (a GRPO group's envs are built alike: group_size)
            s = cfg.scheduler
            self.pool = self.start_pool(
                shape.envs,
                self.seed,
                group_size=shape.group_size,
                chunk_timeout_s=None if s.serial else s.chunk_timeout_s,
                max_failures=s.max_sim_failures,
                failure_window_s=s.sim_failure_window_s,
                process_env=sim_env,
            )
            self.placement.check_memory(self.pool.spec, roofline_shares)
            # generation in its own process: this process only tokenizes, keeps the first weights and restores a
            # checkpoint, on the CPU (no CUDA context here, no second copy of the weights on the GPU)
            here = torch.device("cpu") if self.placement.generation == "process" else device
            # a local trainer trains this policy (float32 masters of what it trains); with a trainer process it only
            # acts. A resumed run's weights come from its checkpoint, a run from `init` from that one's, so none are
            # initialised
            init = init_file(cfg)
            self.conf["init"] = str(init) if init is not None else None  # (the run's config names the file)
            start = self._resume_ckpt or (load_checkpoint(init) if init is not None else None)
            if start is not None:  # the statistics its weights were trained with
                adopt_norm_stats(start, conf, self.out_dir)
            weights = "given" if self._resume_ckpt is not None or init is not None else "init"
            self.policy = build_policy(
                conf["policy"], self.pool.spec, here, train=self.placement.local, weights=weights
            )
            if init is not None:
                self._start_from(init)
            warning = tokenizer_warning(conf["policy"], self.policy)
            if warning:
                console.print(warning, soft_wrap=True)
            if self.ranks.leader:  # (once the run is past its one-line checks: the simulators and policy are built)
                console.print(recipe_line(cfg), soft_wrap=True)
            broadcast_module(self.policy, self.ranks)  # every rank starts from rank 0's weights
            if self.ranks.rank > 0:
                seed_everything(self.seed)  # then samples its own noise
            self.pool.attach(self.policy.execute)
            if self._resume_ckpt is not None:
                self._restore(self._resume_ckpt)
            self.pool.reset_all()
            resume = str(self.run_dir / "checkpoints" / "last.pt") if self._resume_ckpt else None
            # the value head of an SFT checkpoint never learned: it trains alone first (from init, or resumed from a
            # run that started from init)
            started_from = (self._resume_ckpt or {}).get("config", conf).get("init")
            warmup = int(cfg.algo.critic_warmup) if started_from and cfg.algo.name == "ppo" else 0
            self.scheduler = Scheduler(
                self.pool,
                self.policy,
                conf,
                self.placement,
                base_version=self.iteration,
                resume=resume,
                seed=self.seed,
                critic_warmup=warmup,
                init=str(init) if init is not None else None,
            )
            self.placement.take(self.scheduler)
        except BaseException:
            self.close()
            raise

    def _start_from(self, path: Path) -> None:
        """The first weights from `init`'s checkpoint (one line where it was made for another policy)."""
        record = load_policy_checkpoint(path, self.conf["policy"], f"init={self.cfg.init}", resume=False)
        restore_weights(self.policy, record, f"init={self.cfg.init}")
        if self.ranks.leader:
            console.print(describe(path, record), soft_wrap=True, markup=False)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        """A resumed run's weights (a local trainer's float32 masters, or the acting copy), counts and generators; its
        trainer reads its own state from the checkpoint file."""
        restore_weights(self.policy, ckpt, f"resume={self.cfg.resume}")
        self.iteration = ckpt["iteration"]
        self.env_steps = ckpt["env_steps"]  # the run's, over all ranks
        torch.set_rng_state(ckpt["torch_rng"])
        np.random.set_state(ckpt["numpy_rng"])
        if self.ranks.rank > 0:  # the checkpoint holds rank 0's generators; the others continue from their own seeds
            seed_everything(self.seed + self.iteration)

    # --- running ---------------------------------------------------------------------------
    def train(self) -> RunSummary:
        """Run the remaining iterations, each followed by the hooks (ebrl/runs/hooks.py); always closes the
        simulator processes."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.conf))
        self.scheduler.trace.stream_to(self.out_dir / "trace.json")  # (a long run's spans are not all kept)
        resume_id = self._resume_ckpt.get("wandb_id") if self._resume_ckpt else None
        logger = self.conf["logger"] if self.ranks.leader else {"name": "none"}  # one W&B run: rank 0's
        self.log = MetricsLog(self.out_dir, logger, self.conf, resume_id=resume_id)
        # this rank's GPUs' device totals; each stage's own GPU time is in the trace
        gpu = GpuMonitor(gpus=self.gpus) if self.gpus else None
        if gpu is not None:
            gpu.start()
            if not gpu.available:
                console.print(
                    f"GPU telemetry is off: {gpu.reason}; the run goes on without perf/gpu figures",
                    soft_wrap=True,
                    markup=False,
                )
        monitors = (CpuMonitor(self.cores), gpu, self.placement.account())
        cpu_samples = CpuSampler(self.cores)  # cpu_busy.png; the per-iteration metrics come from the CpuMonitor
        start = time.perf_counter()
        cpu_samples.start()
        bar = ProgressBar(total=cfg.iterations, done=self.iteration, enabled=cfg.progress)
        measure, guard = (
            Measure(cfg.iterations),
            NanGuard(cfg.algo.max_nonfinite_updates, self.run_dir / "checkpoints" / "last.pt", cfg.algo.lr),
        )
        hooks = [
            *([Replan(self.placement)] if self.placement.allocator is not None else []),
            RankMetrics(self.ranks),
            self._record,
            measure,
            Progress(bar),
            guard,
            Checkpoints(cfg.checkpoint_every, cfg.iterations, guard, self.ranks.leader, self.save_checkpoint),
        ]
        grace = 5.0  # seconds the simulators have to exit once asked, as the run ends (then they are killed)
        self.placement.follow_load(None)  # (the first iteration beside the load there is now, as the later ones)
        try:
            while self.iteration < cfg.iterations:
                it = self._iterate(monitors)
                for hook in hooks:
                    hook(it)
            summary = self._summarise(start, measure)
            self._write_telemetry(start, cpu_samples, gpu)
            self.log.log_summary(summary.figures())
        except BaseException as e:  # what can be written is: a checkpoint where the state is whole, the telemetry
            if isinstance(e, (KeyboardInterrupt, SimulatorsFailing)) and self.ranks.leader:
                self._save_on_the_way_out()
            if isinstance(e, KeyboardInterrupt):  # a stop is to take seconds: the episodes in flight are dropped
                grace = 1.0
            try:
                self._write_telemetry(start, cpu_samples, gpu)
                if isinstance(e, KeyboardInterrupt):  # a stopped run's totals so far, as a run that ends shows them
                    bar.close()
                    summary = self._summarise(start, measure)
                    self.log.log_summary(summary.figures())
                    self._write_summary(summary)
            except Exception as failed:  # noqa: BLE001  (the run's own error is the one to report)
                console.print(f"no trace, plots or summary: {one_line(failed)}", soft_wrap=True)
            raise
        finally:
            bar.close()
            for monitor in (cpu_samples, gpu):
                if monitor is not None:
                    monitor.stop()
            self.close(grace)
        self._write_summary(summary)
        return summary

    def _write_summary(self, summary: RunSummary) -> None:
        """summary.json, and on rank 0 the console table."""
        (self.out_dir / "summary.json").write_text(json.dumps(summary.figures(), indent=2))
        if self.ranks.leader:
            print_summary(summary, self.run_dir)

    def _iterate(self, monitors: tuple[CpuMonitor, GpuMonitor | None, ProcessCpu]) -> Finished:
        """One iteration: the rollout and one update (overlapping, where the schedule does), and this rank's figures
        of it: each stage's seconds and busy share from the trace, every process group's CPU share."""
        cpu, gpu, shares = monitors
        trace = self.scheduler.trace
        mark = trace.mark()  # spans of this iteration are added past it
        t0 = time.perf_counter()
        stats, train_metrics = self.scheduler.next_iteration()
        wall = time.perf_counter() - t0
        busy = trace.busy(t0, t0 + wall, len(self.placement.cpus("simulate")), since=mark)
        seconds = trace.seconds(t0, t0 + wall, since=mark)
        cpu_shares = shares.shares()
        cores_busy = cpu.read()
        self.iteration += 1
        metrics = {
            "iteration": self.iteration,
            "perf/iteration_env_steps": stats.env_steps,  # this rank's, this iteration
            "perf/env_steps_per_s": stats.env_steps / wall,
            # the rollout's own rate: without the time it waited for an update that ran alone
            "perf/rollout_only_steps_per_s": stats.env_steps / max(wall - seconds["train_alone"], 1e-9),
            "time/iteration_s": wall,
            **{f"time/{stage}_s": seconds[stage] for stage in STAGES},
            **cores_busy,
            **(gpu.read() if gpu is not None else {}),
            **{f"perf/cpu_share_{group}": share for group, share in cpu_shares.items()},
            # the simulators' CPU seconds in this iteration (ebrl.bench.sim_speed measures the same per env step)
            "perf/sim_cpu_s": cpu_shares.get("simulate", 0.0) * shares.cores * shares.wall,
            **stats.metrics(),
            **train_metrics,
            **{f"perf/busy_{stage}": value for stage, value in busy.items()},
        }
        measured = self.placement.measured(
            metrics["perf/env_steps_per_s"], cpu_shares, busy, cores_busy["perf/cpu_busy"]
        )
        metrics["perf/foreign_cores"] = measured.foreign  # (other processes' load on this rank's cores)
        # this iteration's thread team and envs per simulation core; the next one's follow its foreign load
        metrics["perf/supervisor_threads"] = torch.get_num_threads()
        if (cores := self.scheduler.dispatcher.cores) is not None:
            metrics["perf/sim_slots"] = cores.slots
        self.placement.follow_load(measured.foreign)
        return Finished(self.iteration, t0, metrics, measured=measured)

    def _record(self, it: Finished) -> None:
        """Count the run's env steps (over every rank) and log the iteration: rank 0 the run's figures, the others
        their own."""
        self.env_steps += int(it.run["perf/iteration_env_steps"])
        it.metrics["env_steps"] = it.run["env_steps"] = self.env_steps
        self.log.log(it.run if self.ranks.leader else it.metrics)

    def _save_on_the_way_out(self) -> None:
        """A checkpoint as the run stops; if the state cannot be had any more (the trainer or another rank is gone)
        the last one stays, as atomic_save leaves it. An update in progress ends at its next optimizer step first, so
        the state is whole and comes within a step (a trainer interrupted mid-step, `torn`, has none to give)."""
        sharded = self.ranks.distributed and self.placement.strategy == "fsdp"
        if self.scheduler is None or self.scheduler.trainer.torn or sharded:
            # (FSDP: gathering the state needs every rank, and some may be gone)
            console.print("no final checkpoint: checkpoints/last.pt stays the one written before", soft_wrap=True)
            return
        self.scheduler.trainer.hurry()  # (an update in progress ends at its next step)
        try:
            state = self.scheduler.training_state()  # the trainer's newest state, after updates not yet logged
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
            self.log.log(
                {
                    "iteration": self.iteration,
                    "perf/iteration_env_steps": steps,
                    **stats.metrics(),
                    **train_metrics,
                    "env_steps": self.env_steps,
                }
            )

    def _summarise(self, start: float, measure: Measure) -> RunSummary:
        """The run's totals (what summary.json, the console table and W&B's summary show): each stage's busy time from
        the trace; simulation's as the time the simulation cores had an env to run, min(envs in a chunk, cores) /
        cores (as stage_busy.png)."""
        end = time.perf_counter()
        cores = len(self.placement.cpus("simulate"))
        seconds = self.scheduler.trace.timeline.occupied(start, end, cores)
        start_success, end_success = measure.success_at_ends()
        return RunSummary(
            env_steps=self.env_steps,
            wall_s=end - start,
            rollout_steps_per_s=measure.steps_per_s,
            success_rate=measure.success_rate,
            mean_return=measure.mean_return,
            success_start=start_success,
            success_end=end_success,
            stage_s={"simulate": seconds["cores"] / cores, "generate": seconds["generate"], "train": seconds["train"]},
            cpu_busy=measure.cpu_busy,
            sim_cpu_ms_per_step=measure.sim_cpu_ms_per_step,
            busy=measure.stage_means(),
            measured=measure.measured(),
        )

    def _write_telemetry(self, start: float, cpu_samples: CpuSampler, gpu: GpuMonitor | None) -> None:
        """trace.json and the utilisation plots, while the W&B run is still open to take the plots."""
        end = time.perf_counter()
        for monitor in (cpu_samples, gpu):  # their sample lists are final from here
            if monitor is not None:
                monitor.stop()
        trace = self.scheduler.trace
        trace.write(self.out_dir / "trace.json")
        plots = write_plots(
            self.out_dir,
            trace,
            start,
            end,
            len(self.placement.cpus("simulate")),
            cpu_samples.samples,
            gpu.samples if gpu is not None else None,
        )
        self.log.log_images(plots, self.env_steps)

    def save_checkpoint(self, state: tuple[dict, dict] | None = None) -> Path:
        """checkpoints/last.pt at self.iteration: `state` (model, optimizer), or what the trainer sent right after
        this iteration's update. Written in the background (`CheckpointWriter`): the run goes on while it reaches the
        disk; the next save, and closing, wait for it."""
        path = self.run_dir / "checkpoints" / "last.pt"
        model, optimizer = state if state is not None else self.scheduler.gathered_state(self.iteration)
        self.writer.save(
            checkpoint_record(
                self.conf, model, optimizer, self.iteration, self.env_steps, self.log.wandb_id if self.log else None
            ),
            path,
        )  # (checkpoints/previous.pt keeps the one before, should this one turn out unreadable)
        return path

    def close(self, grace: float = 5.0) -> None:
        """Stop everything the run started, the last checkpoint on disk first; the simulators have `grace` seconds
        to exit once asked."""
        try:
            self.writer.wait()  # the last checkpoint on disk before anything goes
        except OSError as e:
            console.print(
                f"the last checkpoint was not written ({one_line(e)}); checkpoints/previous.pt is the one before",
                soft_wrap=True,
            )
        if self.scheduler is not None:
            self.scheduler.close()
        if self.pool is not None:
            self.pool.close(grace)
        if self.placement is not None:  # (its MPS daemons after every client is gone)
            self.placement.close()
        if self.log is not None:
            self.log.close()
            self.log = None
        close_group()
