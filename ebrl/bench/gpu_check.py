"""Every GPU path of the resource pool, exercised and measured on one node: `python -m ebrl.bench.gpu_check`.

Each check runs on its own (one failure hides no other) and prints PASS, FAIL or SKIP with its figures:
  basics  device, SMs, memory; bf16 4096x4096 matmul TFLOP/s
  mps     a daemon of our own for GPU 0; two spawned clients with SM shares 0.25 and 0.75 run the same matmul loop
          at once (rates about 1:3); a client with a 2 GiB pinned-memory limit must fail to allocate 4 GiB; once
          stopped, the daemon's control pipe must be gone
  green   green contexts with 1/4 and 3/4 of the SMs, the matmul loop on each one's stream; rebuilt with the shares
          swapped, with the rebuild's time; then both loops at once, to tell separate SM sets from shared ones
  memory  a budget of 10% of the device memory: an allocation past it must raise OutOfMemoryError
  nvml    GpuMonitor readings during a matmul burst (GPM SM utilisation where supported)
  policy  the openpi small preset on CUDA: ms per policy.sample and per PPO update, and the scheduler benchmark's
          limit costs on the device (generation's and training's GPU time per env step, bench.schedulers.stage_costs)
  full    pi0 at full size in bfloat16 (2 cameras at 224 px), built with given weights: build time, policy.sample at
          batch 1, 8 and 32 (beside the roofline's, ebrl/forecast/gpu_cost.py), one PPO update (train=all) at
          algo.micro_batch=4; the peak memory allocated against the memory model's prediction, and the CUDA
          context's size; "costs" are what `python -m ebrl.bench.at_scale --gpu-costs` reads
  capture generation's pi0 at full size (bfloat16, 2 cameras at 224 px): policy.sample's ms per chunk at batch 1, 16
          and 32 (ebrl's and colocated's generation batch on the at-scale testbed) with the denoising loop as it is
          and replayed from CUDA graphs (policy.capture=off / graph; --capture-settings adds compile), alternated,
          with each one's first call (the capture); the same draws' actions under each, before and after new
          weights are copied in, must agree within --capture-atol
  checkpoint  `python -m ebrl.bench.checkpoint`'s path on CUDA: a full-size pi0 folder in lerobot's layout (random
          bfloat16 weights) built through policy.checkpoint with a SentencePiece tokenizer trained on the spot, one
          deterministic chunk on a synthetic LIBERO observation (2 cameras at 224 px): folder write, build, first and
          warm chunk times, the file's size and the peak memory allocated; the chunk must be finite and (1, 50, 7)
  publish one publication of a pi0-sized bfloat16 payload from a trainer process to a reader on the same GPU, through
          CUDA IPC (the channel's device slots) and through shared memory (host slots): publish and pull times
  ranks   torchrun with two ranks on two GPUs: each rank's supervisor and trainer on its own GPU (skipped on one GPU)
  egl     EGL's devices, each with its CUDA ordinal (EGL_CUDA_DEVICE_NV), and the one a simulator of GPU 0 is given
          (ebrl/envs/egl.py): NVIDIA's device of CUDA ordinal 0; a MuJoCo EGL context rendered through it: its
          renderer and the device memory one simulator's context holds
  run     python run.py hw=h200x1 scheduler=ebrl: MPS daemon, trainer and generation as clients, both respawned
          with the shares the plan gives them at iteration 2, the daemon's pipes gone at the end
The mps check also probes the daemon (MpsDaemons.unenforced): both share clients must be its clients, and a process
whose pipe directory has no daemon must be named as not one.

The figures also go to --out as JSON, rewritten after every check. `--part 1` and `--part 2` split the checks into
two runs of under 10 minutes each, the first holding those that matter most (PARTS). Without CUDA each check imports
what it needs and skips, and the exit is 0 unless one failed. --timeout (or SIGTERM) ends the check under way: the MPS
daemons it started are stopped and the processes it started killed, so the GPU is free; the figures so far are kept.
`--kit DIR` builds the folder a GPU machine that reaches no package registry needs and prints the command that runs
each part there (ebrl/bench/gpu_kit.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

N = 4096  # matmul size
CHECKS = (
    "basics",
    "mps",
    "green",
    "memory",
    "nvml",
    "policy",
    "full",
    "capture",
    "checkpoint",
    "publish",
    "ranks",
    "egl",
    "run",
)
# two runs of under 10 minutes each; the first holds issue 50's EGL and MPS items, the SM partitions and the full
# policy's costs that `python -m ebrl.bench.at_scale --gpu-costs` reads
PARTS = {
    1: ("basics", "egl", "mps", "memory", "green", "nvml", "full"),
    2: ("policy", "capture", "checkpoint", "publish", "ranks", "run"),
}


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Deadline(BaseException):
    """--timeout passed or SIGTERM came; a BaseException so that no check's own handler takes it for its failure."""


def require_cuda() -> None:
    """Skip a check on a machine without CUDA; called after its imports, so that it has checked them."""
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")


def require_modules(*names: str, why: str = "") -> None:
    """Skip a check whose packages are not installed, saying which and why it needs them."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise Skip(f"{' and '.join(missing)} not installed{f' ({why})' if why else ''}")


# --- the workload ------------------------------------------------------------------------------
def matmul_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    return a, torch.randn_like(a), torch.empty_like(a)


def matmul_rate(ops: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seconds: float) -> float:
    """bf16 N x N matmuls per second on the current stream, over about `seconds` after one warm-up."""
    a, b, c = ops
    stream = torch.cuda.current_stream()
    torch.matmul(a, b, out=c)
    stream.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            torch.matmul(a, b, out=c)
        stream.synchronize()
        n += 8
    return n / (time.perf_counter() - t0)


def tflops(rate: float) -> float:
    return rate * 2 * N**3 / 1e12


# --- children (spawned: module-level, and nothing touches CUDA before their environment is set) ----------
def mps_client(seconds: float, go: Any, reports: Any) -> None:
    """An MPS client: ready once CUDA is up, then the matmul loop for `seconds` when `go` is set."""
    try:
        ops = matmul_operands()
        torch.cuda.synchronize()
        reports.put(("ready", os.getpid()))
        go.wait()
        reports.put(
            (
                "done",
                {
                    "percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                    "matmul_per_s": matmul_rate(ops, seconds),
                },
            )
        )
    except Exception as e:
        reports.put(("error", f"{type(e).__name__}: {e}"))


def mps_memory_client(reports: Any) -> None:
    """An MPS client with a pinned-memory limit: 1 GiB must fit, 4 GiB must not."""
    out: dict[str, Any] = {"limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    for name, size in (("alloc_1GiB", 2**30), ("alloc_4GiB", 4 * 2**30)):
        try:
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            torch.cuda.synchronize()
            out[name] = "ok"
            del x
            torch.cuda.empty_cache()
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
    reports.put(("done", out))


def cuda_holder(reports: Any) -> None:
    """A process that holds a CUDA context until it is killed (the MPS probe's process outside the daemon)."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        reports.put(("ready", os.getpid()))
        time.sleep(3600)
    except Exception as e:
        reports.put(("error", f"{type(e).__name__}: {str(e).strip()[:200]}"))


def _collect(reports: Any, count: int, timeout_s: float) -> list[Any]:
    """`count` reports of the children; a child's error fails the check at once."""
    out = []
    for _ in range(count):
        kind, value = reports.get(timeout=timeout_s)
        if kind == "error":
            raise RuntimeError(f"child: {value}")
        out.append(value)
    return out


# --- the checks -------------------------------------------------------------------------------
def check_basics(args: argparse.Namespace) -> tuple[bool, dict]:
    require_cuda()
    props = torch.cuda.get_device_properties(0)
    rate = matmul_rate(matmul_operands(), args.seconds)
    figures = {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "bf16_tflops": round(tflops(rate), 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    return rate > 0, figures


def check_mps(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.runtime.resources import MPS_CONTROL, MpsDaemons, ResourcePool

    require_cuda()
    if shutil.which(MPS_CONTROL) is None:
        raise Skip(f"{MPS_CONTROL} is not on PATH")
    props = torch.cuda.get_device_properties(0)
    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ebrl-mps-") as tmp:
        run_dir = Path(tmp)

        def pool() -> ResourcePool:
            return ResourcePool(
                cores,
                gpus=1,
                sm_count=props.multi_processor_count,
                gpu_memory_bytes=props.total_memory,
                partition="mps",
                run_dir=run_dir,
            )

        daemons = MpsDaemons([0], run_dir)
        control = daemons.daemons[0].control
        procs: list[Any] = []
        with daemons:
            try:  # (the clients end before the daemon is told to quit, which waits for its clients)
                shares = pool()
                shares.lease("small", cores, gpu=0, sm_share=0.25)
                shares.lease("large", cores, gpu=0, sm_share=0.75)
                go, reports = ctx.Event(), ctx.Queue()
                for stage in ("small", "large"):
                    with shares.spawn_env(stage):
                        procs.append(ctx.Process(target=mps_client, args=(args.seconds, go, reports), daemon=True))
                        procs[-1].start()
                _collect(reports, len(procs), 120)
                figures.update(
                    mps_probe(
                        daemons, {stage: p.pid for stage, p in zip(("small", "large"), procs)}, ctx, run_dir, procs
                    )
                )
                go.set()  # both loops run at once: the shares split the SMs between them
                rates = {r["percentage"]: r["matmul_per_s"] for r in _collect(reports, 2, args.seconds + 60)}
                for p in procs[:2]:
                    p.join(30)
                small, large = rates["25"], rates["75"]
                figures.update(
                    {
                        "share25_tflops": round(tflops(small), 1),
                        "share75_tflops": round(tflops(large), 1),
                        "ratio": round(small / large, 3),
                    }
                )

                capped = pool()
                capped.lease("capped", cores, gpu=0, sm_share=0.5, mem_bytes=2 * 2**30)
                with capped.spawn_env("capped"):
                    procs.append(ctx.Process(target=mps_memory_client, args=(reports,), daemon=True))
                    procs[-1].start()
                figures.update(_collect(reports, 1, 120)[0])
                procs[-1].join(30)
            finally:
                for p in procs:
                    p.kill()
                    p.join(10)
        figures["control_pipe_gone"] = not control.exists()
    ok = (
        0.15 < figures["ratio"] < 0.6
        and figures["alloc_1GiB"] == "ok"
        and figures["alloc_4GiB"] != "ok"
        and figures["control_pipe_gone"]
        and figures["probe_ok"]
    )
    return ok, figures


def mps_probe(daemons: Any, clients: dict[str, int], ctx: Any, run_dir: Path, procs: list[Any]) -> dict[str, Any]:
    """Issue 50's MPS probe, as the placement asks it (MpsDaemons.unenforced): the share clients must all be the
    daemon's (`probe_clients` None); a process whose pipe directory has no daemon, a client that cannot reach it, must
    be named as not one (`probe_stray`), unless it could not start CUDA at all (`stray` says so)."""
    from ebrl.runtime.resources import environment

    out: dict[str, Any] = {"probe_clients": daemons.unenforced({k: (pid, 0) for k, pid in clients.items()})}
    reports = ctx.Queue()
    with environment({"CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "no-daemon")}):
        procs.append(ctx.Process(target=cuda_holder, args=(reports,), daemon=True))
        procs[-1].start()
    stray = procs[-1]
    kind, value = reports.get(timeout=120)
    out["stray"] = f"pid {stray.pid} holds a CUDA context" if kind == "ready" else f"no CUDA context: {value}"
    out["probe_stray"] = daemons.unenforced({"stray": (stray.pid, 0)}) if kind == "ready" else None
    named = out["probe_stray"] is not None and f"pid {stray.pid}" in out["probe_stray"]
    out["probe_ok"] = out["probe_clients"] is None and (named or kind != "ready")
    stray.kill()
    stray.join(10)
    return out


def check_green(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.runtime.resources import GreenPartition, ResourceError, green_granule

    require_cuda()
    try:
        part = GreenPartition(0, {"a": 0.25, "b": 0.75})
    except ResourceError as e:
        raise Skip(str(e)) from None
    ops = matmul_operands()  # allocated once, in the primary context, used from both green contexts

    def rates() -> dict[str, dict[str, float]]:
        out = {}
        for stage in ("a", "b"):
            with part.use(stage):
                out[stage] = {"sms": part.sms[stage], "tflops": round(tflops(matmul_rate(ops, args.seconds / 2)), 1)}
        return out

    figures: dict[str, Any] = {"granule": green_granule(0), "sm_count": part.sm_count, "first": rates()}
    t0 = time.perf_counter()
    part.rebuild({"a": 0.75, "b": 0.25})
    figures["rebuild_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
    figures["swapped"] = rates()
    first, swapped = figures["first"], figures["swapped"]
    ok = first["a"]["tflops"] < first["b"]["tflops"] and swapped["a"]["tflops"] > swapped["b"]["tflops"]

    # both at once, a thread per context: on SMs of their own they add up; on shared SMs (torch creates every
    # context from the first SMs, see GreenPartition) together is about the larger one alone. Reported, not judged.
    together: dict[str, float] = {}
    both = {stage: matmul_operands() for stage in ("a", "b")}

    def loop(stage: str) -> None:
        with part.use(stage):
            together[stage] = tflops(matmul_rate(both[stage], args.seconds / 2))

    threads = [threading.Thread(target=loop, args=(stage,)) for stage in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = swapped["a"]["tflops"] + swapped["b"]["tflops"]
    figures["together_tflops"] = {stage: round(v, 1) for stage, v in together.items()}
    figures["together_over_sum_alone"] = round(sum(together.values()) / alone, 2) if alone else math.nan
    # shared: 96 + 32 SMs run as 96, about 0.75 of the sum; separate: about 1
    figures["sm_sets"] = "separate" if figures["together_over_sum_alone"] > 0.875 else "shared"
    return ok, figures


def check_memory(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.runtime.resources import apply_memory_budget

    require_cuda()
    total = torch.cuda.get_device_properties(0).total_memory
    budget = total // 10
    torch.cuda.empty_cache()
    fraction = apply_memory_budget(budget, 0)
    figures: dict[str, Any] = {"budget_gib": round(budget / 2**30, 2), "fraction": round(fraction, 4)}
    try:
        x = torch.empty(budget // 2, dtype=torch.uint8, device="cuda")
        figures["within"] = "ok"
        del x
        try:
            x = torch.empty(budget + 2**30, dtype=torch.uint8, device="cuda")
            figures["beyond"] = "allocated"
            del x
        except torch.cuda.OutOfMemoryError as e:
            figures["beyond"] = f"OutOfMemoryError: {str(e).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)  # the later checks get the whole device again
        torch.cuda.empty_cache()
    return figures["within"] == "ok" and figures["beyond"].startswith("OutOfMemoryError"), figures


def check_nvml(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.telemetry.monitor import GpuMonitor

    require_cuda()
    monitor = GpuMonitor(interval_s=0.1)
    if not monitor.available:
        raise Skip(monitor.reason)
    ops = matmul_operands()
    with monitor:
        rate = matmul_rate(ops, min(args.seconds, 3.0))
    summary = monitor.summary()
    figures = {
        "gpm_supported": monitor.gpm,
        "samples": len(monitor.samples),
        "bf16_tflops": round(tflops(rate), 1),
        **{f"gpu{gpu}": {k: round(v, 1) for k, v in s.items()} for gpu, s in summary.items()},
    }
    return bool(summary) and max(s["mean_util"] for s in summary.values()) > 50, figures


def check_policy(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.bench.memory import compose
    from ebrl.bench.policies import build, make_obs, timed
    from ebrl.bench.schedulers import stage_costs
    from ebrl.config import register_configs
    from ebrl.envs.base import ArraySpec, EnvSpec
    from ebrl.rl.ppo import PPOTrainer
    from ebrl.rl.rollout import ChunkStep, stack_steps

    require_cuda()
    register_configs()
    spec = EnvSpec(
        obs={"state": ArraySpec((42,), "float32")}, action_dim=7, instruction="lift the red cube", max_episode_steps=40
    )
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    policy = build("openpi", "small", spec).to(cuda).eval()
    batch_size, chunks = 32, 4
    obs = {k: v.to(cuda) for k, v in make_obs(policy, batch_size).items()}

    def sample() -> None:
        policy.sample(obs)
        torch.cuda.synchronize()

    sample_ms = timed(sample, 10)
    steps = []
    for _ in range(chunks):
        out = policy.sample(obs)
        steps.append(
            ChunkStep(
                obs=obs,
                chunk=out.chunk,
                extras=out.extras,
                log_prob=out.log_prob,
                value=out.value,
                reward=torch.rand(batch_size, device=cuda),
                done=torch.zeros(batch_size, dtype=torch.bool, device=cuda),
                mask=torch.ones(batch_size, policy.chunk_len, dtype=torch.bool, device=cuda),
                cutoff_value=torch.zeros(batch_size, device=cuda),
            )
        )
    batch = stack_steps(steps, torch.zeros(batch_size, device=cuda))
    # (a composed config: its algo keys resolve from the small preset's recipe)
    trainer = PPOTrainer(
        policy, compose("policy.preset=small", "algo.epochs=1", "algo.minibatches=2").algo, device=cuda
    )
    metrics: dict[str, float] = {}

    def update() -> None:
        metrics.update(trainer.update(batch))
        torch.cuda.synchronize()

    update_ms = timed(update, 3)
    # the scheduler benchmark's limit on a GPU: generation's and training's device time per env step
    seen = [{k: v.cpu().numpy() for k, v in obs.items() if k not in ("tokens", "token_mask")}] * chunks
    limit_costs = stage_costs(policy, trainer, seen, cuda)
    figures = {
        "parameters_m": round(policy.num_parameters() / 1e6, 2),
        "batch": batch_size,
        "chunk": policy.chunk_len,
        "sample_ms": round(sample_ms, 2),
        "ppo_update_ms": round(update_ms, 2),
        "rows_per_update": batch_size * chunks,
        "policy_loss": round(metrics["losses/policy"], 4),
        **{f"limit_{stage}_us_per_env_step": round(1e6 * c, 3) for stage, c in limit_costs.items()},
    }
    return all(math.isfinite(v) for v in [*metrics.values(), *limit_costs.values()]), figures


def full_obs(policy: Any, batch: int) -> dict[str, torch.Tensor]:
    """`batch` random observations of LIBERO's shapes (ebrl.bench.memory.env_spec) on the GPU, for a full policy."""
    spec, cuda = policy.env_spec, torch.device("cuda")
    tokens, mask = policy.tokenize([spec.instruction] * batch)
    out = {
        "state": torch.randn(batch, spec.obs["state"].shape[0], device=cuda),
        "tokens": torch.from_numpy(tokens).to(cuda),
        "token_mask": torch.from_numpy(mask).to(cuda),
    }
    out.update(
        {
            k: torch.randint(0, 256, (batch, *spec.obs[k].shape), dtype=torch.uint8, device=cuda)
            for k in spec.obs
            if k.startswith("image/")
        }
    )
    return out


def full_costs(gpu: str, sample_ms: dict[int, float], update_s: float, rows: int) -> dict[str, Any]:
    """What `python -m ebrl.bench.at_scale --gpu-costs` reads (its `read_gpu_costs`) from the full check's figures:
    policy.sample's seconds per batch size and one epoch's update seconds per row."""
    return {
        "gpu": gpu,
        "policy": "openpi full, 2 cameras at 224 px",
        "sample_s": {str(b): ms / 1e3 for b, ms in sample_ms.items()},
        "train_s_per_row_epoch": update_s / rows,
    }


def check_full(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.alloc.memory import MemoryModel
    from ebrl.bench.memory import compose, env_spec, fill, policy_config
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer, RolloutBatch

    require_cuda()
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    spec = env_spec(2)
    cfg = policy_config("openpi", "all")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # what the device holds beyond torch's allocator: this process's CUDA context (no other process runs now)
    context_mib = round((total - free - torch.cuda.memory_reserved()) / 2**20)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    policy = build_policy(cfg, spec, cuda, train=True, weights="given")
    fill(policy)
    torch.cuda.synchronize()
    figures: dict[str, Any] = {
        "build_s": round(time.perf_counter() - t0, 2),
        "parameters_b": round(policy.num_parameters() / 1e9, 3),
    }

    for batch in (1, 8, 32):
        obs = full_obs(policy, batch)
        policy.sample(obs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            policy.sample(obs)
        torch.cuda.synchronize()
        figures[f"sample_ms_b{batch}"] = round(1e3 * (time.perf_counter() - t0) / 3, 1)
    rows, micro = 8, 4
    obs = full_obs(policy, rows)
    out = policy.sample(obs)
    batch = RolloutBatch(
        obs={k: v[None] for k, v in obs.items()},
        chunk=out.chunk[None],
        extras={k: v[None] for k, v in out.extras.items()},
        log_prob=out.log_prob[None],
        value=out.value[None],
        reward=torch.randn(1, rows, device=cuda),
        done=torch.zeros(1, rows, dtype=torch.bool, device=cuda),
        mask=torch.ones(1, rows, policy.chunk_len, dtype=torch.bool, device=cuda),
        last_value=torch.zeros(rows, device=cuda),
        cutoff_value=torch.zeros(1, rows, device=cuda),
    )
    algo = compose("algo.epochs=1", "algo.minibatches=1", f"algo.micro_batch={micro}").algo
    trainer = PPOTrainer(policy, algo, device=cuda)
    trainer.update(batch)  # (the first step allocates Adam's moments)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = trainer.update(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    predicted = MemoryModel.of(cfg, spec).trainer(micro, rows)
    figures.update(
        {
            "update_s": round(time.perf_counter() - t0, 2),
            "rows": rows,
            "micro_batch": micro,
            "peak_allocated_gib": round(peak / 2**30, 2),
            "predicted_gib": round(predicted.total / 2**30, 2),
            "error": round((predicted.total - peak) / peak, 3),
            "predicted": {k: round(v / 2**30, 2) for k, v in predicted.parts.items()},
            "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "nonfinite_steps": metrics["train/nonfinite_steps"],
        }
    )
    figures["cuda_context_mib"] = context_mib
    # the costs the at-scale benchmark takes in place of its roofline, with the roofline's figures beside them
    figures["costs"] = full_costs(
        torch.cuda.get_device_name(), {b: figures[f"sample_ms_b{b}"] for b in (1, 8, 32)}, figures["update_s"], rows
    )
    figures["modelled_sample_ms"] = modelled_sample_ms(cfg, spec)
    return abs(figures["error"]) < 0.15, figures


def check_capture(args: argparse.Namespace) -> tuple[bool, dict]:
    """policy.capture on generation's pi0 at full size (bfloat16, given weights, 2 cameras at 224 px): ms per chunk
    with the denoising loop as it is and replayed from CUDA graphs (and compiled, where asked), the settings
    alternated; the same draws' actions and log-probs under each; and again after new weights are copied in."""
    require_modules("hydra", "omegaconf", why="the policy's config schemas import them")
    from ebrl.bench.memory import env_spec, fill, policy_config
    from ebrl.bench.policies import capture_differences, compare_capture, sampled
    from ebrl.policies.build import build_policy

    require_cuda()
    if not all(hasattr(torch.cuda, name) for name in ("CUDAGraph", "graph", "graph_pool_handle")):
        raise Skip(f"torch {torch.__version__} has no CUDA graph API")

    figures: dict[str, Any] = {}
    settings = list(dict.fromkeys(["off", *args.capture_settings]))
    if "compile" in settings and importlib.util.find_spec("triton") is None:
        settings.remove("compile")
        figures["compile"] = "skipped: triton is not installed"
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    spec = env_spec(2)
    t0 = time.perf_counter()
    policy = build_policy(policy_config("openpi", "all"), spec, cuda, weights="given")
    fill(policy)
    figures.update(
        {
            "build_s": round(time.perf_counter() - t0, 1),
            "dtype": str(policy.compute_dtype),
            "chain": f"{policy.logprob} {policy.chain_logprob}, {policy.denoise_steps} steps",
        }
    )

    rows = compare_capture(policy, settings, args.capture_batches, args.capture_rounds, lambda b: full_obs(policy, b))
    for batch, row in rows.items():
        figures[f"b{batch}"] = {
            **{f"{s}_first_s": round(row["first_s"][s], 2) for s in settings},
            **{f"{s}_ms": round(row["ms"][s], 2) for s in settings},
            **{f"{s}_speedup": round(row["ms"]["off"] / row["ms"][s], 2) for s in settings[1:]},
            "differences": row["differences"],
        }
    # new weights copied into the tensors the graphs read, as the weight channel's pull copies them
    obs = full_obs(policy, args.capture_batches[-1])
    before = sampled(policy, "off", obs, 7)[0].chunk
    torch.manual_seed(1)
    fill(policy)
    figures["after_new_weights"] = capture_differences(policy, settings, obs, 7)
    figures["new_weights_moved_actions"] = not torch.allclose(sampled(policy, "off", obs, 7)[0].chunk, before)
    checked = [
        *(d for row in rows.values() for d in row["differences"].values()),
        *figures["after_new_weights"].values(),
    ]
    ok = figures["new_weights_moved_actions"] and all(
        d["finite"] and d["action"] <= args.capture_atol and d["log_prob"] <= args.capture_atol * 100 for d in checked
    )
    return ok, figures


def modelled_sample_ms(policy_cfg: dict, spec: Any) -> dict[str, float] | str:
    """The roofline's sample times for this GPU (ebrl/forecast/gpu_cost.py), to set beside the measured ones."""
    from ebrl.forecast.gpu_cost import GPUS, PolicyOps, host_seconds_per_op, roofline

    device = torch.cuda.get_device_name()
    name = next((k for k in GPUS if k.split("-")[0] in device), None)
    if name is None:
        return f"no published peaks for {device}"
    ops, (host_s, _) = PolicyOps.of(policy_cfg, spec), host_seconds_per_op()
    return {str(b): round(1e3 * roofline(ops.sample, b, GPUS[name], 1.0, host_s).seconds, 1) for b in (1, 8, 32)}


def check_checkpoint(args: argparse.Namespace) -> tuple[bool, dict]:
    require_modules("safetensors", "sentencepiece", why="the checkpoint's file and its tokenizer")
    from ebrl.bench.checkpoint import ACTION_DIM, CHUNK, load_and_act

    require_cuda()

    # LIBERO is not installed here: random values in the shapes LiberoEnv gives for libero_spatial task 0 (its state
    # is openpi's 8 proprio dims and the objects'; policy.state_dims takes the 8)
    rng = np.random.default_rng(0)
    obs = {
        "state": rng.standard_normal(78).astype(np.float32),
        **{
            f"image/{c}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
            for c in ("agentview", "robot0_eye_in_hand")
        },
    }
    instruction = "pick up the black bowl between the plate and the ramekin and place it on the plate"
    with tempfile.TemporaryDirectory(prefix="ebrl-checkpoint-") as tmp:
        figures = load_and_act(Path(tmp), obs, instruction, torch.device("cuda"))
    return figures["finite"] and figures["chunk_shape"] == [1, CHUNK, ACTION_DIM], figures


def publish_writer(channel: Any, numel: int, count: int, reports: Any) -> None:
    """A trainer-like process: `count` publications of a state of `numel` bfloat16 values from its GPU."""
    try:
        state = {f"w{i}": torch.randn(numel // 16, device="cuda").to(torch.bfloat16) for i in range(16)}
        if channel.cuda:
            channel.attach("cuda", state)
        reports.put(("ready", None))
        times = []
        for _ in range(count):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            channel.publish(state)
            times.append(time.perf_counter() - t0)
            time.sleep(0.5)
        reports.put(("done", times))
        time.sleep(5)  # the device slots stay alive while the reader copies the last version
    except Exception as e:
        reports.put(("error", f"{type(e).__name__}: {e}"))


def check_publish(args: argparse.Namespace) -> tuple[bool, dict]:
    from ebrl.runtime.channel import WeightChannel

    require_cuda()
    numel = 3_246_475_057 // 16 * 16  # pi0's parameters, bfloat16
    ctx = mp.get_context("spawn")
    figures: dict[str, Any] = {"payload_gib": round(numel * 2 / 2**30, 2)}
    for mode in ("cuda_ipc", "shared_memory"):
        first = {f"w{i}": torch.zeros(numel // 16, dtype=torch.bfloat16) for i in range(16)}
        channel = WeightChannel(first, ctx, torch.bfloat16, cuda=mode == "cuda_ipc")
        del first
        reader = torch.nn.Module()
        for i in range(16):
            reader.register_parameter(
                f"w{i}", torch.nn.Parameter(torch.empty(numel // 16, dtype=torch.bfloat16, device="cuda"))
            )
        reports = ctx.Queue()
        writer = ctx.Process(target=publish_writer, args=(channel, numel, 3, reports), daemon=True)
        writer.start()
        _collect(reports, 1, 180)
        have, pulls = 0, []
        while have < 3:
            if channel.version > have:
                t0 = time.perf_counter()
                have = channel.pull(reader, have)
                pulls.append(time.perf_counter() - t0)
            time.sleep(0.01)
        publishes = _collect(reports, 1, 180)[0]
        channel.release()
        writer.join(30)
        figures[mode] = {"publish_s": [round(t, 3) for t in publishes], "pull_s": [round(t, 3) for t in pulls]}
        del reader, channel
        torch.cuda.empty_cache()
    ipc, shm = figures["cuda_ipc"], figures["shared_memory"]
    figures["ipc_over_shm"] = round(
        (min(ipc["publish_s"]) + min(ipc["pull_s"])) / (min(shm["publish_s"]) + min(shm["pull_s"])), 3
    )
    return figures["ipc_over_shm"] < 1.0, figures


def check_ranks(args: argparse.Namespace) -> tuple[bool, dict]:
    import ebrl.runtime.distributed  # (what each rank imports: a missing package fails here, not inside torchrun)

    require_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"{torch.cuda.device_count()} GPU: placing two ranks needs two")
    code = (
        "import os, torch; from ebrl.node import Ranks; from ebrl.runtime.distributed import pin_gpu; "
        "r = Ranks.from_env(); pin_gpu(r); "
        "torch.cuda.init(); import pynvml; pynvml.nvmlInit(); "
        "print('RANK', r.rank, os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.get_device_properties(0).uuid)"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = sorted(line.split(maxsplit=3)[1:] for line in done.stdout.splitlines() if line.startswith("RANK"))
    figures = {"ranks": lines, "exit": done.returncode}
    return done.returncode == 0 and len(lines) == 2 and lines[0][2] != lines[1][2], figures


# a simulator's MuJoCo EGL context, which stays up for a while so that NVML can see its memory; it prints READY and
# the renderer's name (the context's OpenGL renderer, where PyOpenGL can read it)
RENDER = """import os, time
os.environ['MUJOCO_GL'] = 'egl'
import mujoco
m = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos="0 0 3"/><geom type="box" size=".1 .1 .1"/>'
                                   '</worldbody></mujoco>')
r = mujoco.Renderer(m, 128, 128)
r.update_scene(mujoco.MjData(m))
r.render()
try:
    from OpenGL import GL
    name = GL.glGetString(GL.GL_RENDERER).decode()
except Exception as e:
    name = f'unknown ({type(e).__name__})'
print('READY', name, flush=True)
time.sleep(8)
"""


def check_egl(args: argparse.Namespace) -> tuple[bool, dict]:
    """Issue 50's item 2 on a GPU: EGL's devices with their CUDA ordinals, the one a simulator of GPU 0 is given
    (`simulator_gpu_environment`, as the simulators' pool computes it), and a MuJoCo context rendered through it."""
    from ebrl.envs.egl import device_of_gpu, egl_devices
    from ebrl.envs.worker import simulator_gpu_environment
    from ebrl.telemetry.monitor import open_nvml

    devices = egl_devices()
    listing = [{"index": d.index, "cuda": d.cuda, "software": d.software} for d in devices or ()]
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device (EGL's devices here: {json.dumps(listing) if devices else 'none listed'})")
    if devices is None:
        raise Skip("libEGL lists no device: unpack the kit's EGL loader packages (see --kit)")
    nvidia = device_of_gpu(0, devices, None)
    env = simulator_gpu_environment(1)
    figures: dict[str, Any] = {
        "devices": listing,
        "gpu0_egl_device": None if nvidia is None else nvidia.index,
        "simulator_env": env,
    }
    chosen = nvidia is not None and env.get("MUJOCO_EGL_DEVICE_ID") == str(nvidia.index)
    if importlib.util.find_spec("mujoco") is None:
        figures["render"] = "skipped: mujoco is not installed"
        return chosen, figures
    nvml, why = open_nvml()
    proc = subprocess.Popen(
        [sys.executable, "-c", RENDER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    used: dict[int, int] = {}
    try:
        ready = proc.stdout.readline().strip()
        time.sleep(1)
        if nvml is not None:
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            used = {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)}
            used.update({p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)})
    finally:
        proc.kill()
        err = proc.communicate()[1]
        if nvml is not None:
            nvml.nvmlShutdown()
    figures["rendered"] = ready.startswith("READY")
    figures["renderer"] = ready.removeprefix("READY").strip()
    if nvml is None:
        figures["egl_context_mib"] = f"unknown: {why}"
    else:
        figures["egl_context_mib"] = round((used.get(proc.pid) or 0) / 2**20, 1)
        figures["processes_seen"] = len(used)
    if not figures["rendered"]:
        figures["stderr"] = err.strip().splitlines()[-2:]
    # on the GPU: NVML sees the renderer's memory there, and its renderer is not Mesa's software one
    on_gpu = (nvml is None or figures["egl_context_mib"] > 0) and "llvmpipe" not in figures["renderer"]
    return chosen and figures["rendered"] and on_gpu, figures


def check_run(args: argparse.Namespace) -> tuple[bool, dict]:
    """`python run.py hw=h200x1 scheduler=ebrl` end to end: MPS daemon, trainer and generation processes as clients,
    the plan calibrated at iteration 2 giving both their SM shares (a respawn each), the daemon stopped at the end."""
    from ebrl.runtime.resources import MPS_CONTROL, MpsDaemon

    require_modules("hydra", "robosuite", why="the run simulates robosuite Lift; robosuite is too large to carry")
    require_cuda()
    if shutil.which(MPS_CONTROL) is None:
        raise Skip(f"{MPS_CONTROL} is not on PATH")
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="ebrl-run-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [
            sys.executable,
            str(repo / "run.py"),
            "hw=h200x1",
            "scheduler=ebrl",
            "policy.preset=small",
            "env.num_envs=8",
            f"iterations={args.run_iterations}",
            "logger=none",
            "progress=false",
            "checkpoint_every=1000",
            f"hydra.run.dir={run_dir}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        daemon = MpsDaemon(0, run_dir, pid=proc.pid)  # where the run's daemon has its pipes (resources.mps_dirs)
        try:
            stdout, stderr = proc.communicate(timeout=args.run_timeout)
        finally:  # (past its time, or --timeout: stopped as a user would, so that it stops its daemon)
            end_process(proc)
            pipes_left = [str(daemon.control)] if daemon.control.exists() else []
            if daemon.adopt():  # (killed before it stopped its daemon: stopped here, the GPU freed)
                daemon.stop()
        out = stdout + stderr
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if proc.returncode == 0 else []
        metrics = [json.loads(line) for line in lines]
        figures: dict[str, Any] = {
            "exit": proc.returncode,
            "wall_s": round(time.perf_counter() - t0, 1),
            "iterations": len(metrics),
            "plan": next((line for line in out.splitlines() if "allocator: plan" in line), ""),
            "generation_respawned": "generation restarts with SM share" in out,
            "trainer_respawned": "the trainer restarts with SM share" in out,
            "mps_pipes_left": pipes_left,
        }
        if metrics:
            last = metrics[-1]
            figures.update(
                {
                    k: round(float(last[k]), 2)
                    for k in ("perf/env_steps_per_s", "sched/weights_version", "alloc/generate", "alloc/train")
                    if k in last
                }
            )
        if proc.returncode:
            figures["tail"] = out.strip().splitlines()[-3:]
    ok = (
        proc.returncode == 0
        and len(metrics) == args.run_iterations
        and figures["generation_respawned"]
        and figures["trainer_respawned"]
        and not figures["mps_pipes_left"]
    )
    return ok, figures


def end_process(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM for a process still running (a run stops its workers and daemons on it), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.communicate(timeout=grace_s)  # (read, so that a child blocked on a full pipe can end)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def end_children() -> None:
    """Kill every process this one started that still runs (share clients, a run, a renderer), so the GPU is free."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    except ImportError:  # (psutil is in requirements.txt; without it, the spawned children at least)
        pass
    for child in mp.active_children():
        child.kill()
        child.join(5)


RUNNERS: dict[str, Callable[[argparse.Namespace], tuple[bool, dict]]] = {
    "basics": check_basics,
    "mps": check_mps,
    "green": check_green,
    "memory": check_memory,
    "nvml": check_nvml,
    "policy": check_policy,
    "full": check_full,
    "capture": check_capture,
    "checkpoint": check_checkpoint,
    "publish": check_publish,
    "ranks": check_ranks,
    "egl": check_egl,
    "run": check_run,
}


# --- driver ------------------------------------------------------------------------------------
def _line(figures: dict) -> str:
    return "  ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in figures.items())


def run_check(name: str, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    try:
        ok, figures = RUNNERS[name](args)
        result = {"status": "PASS" if ok else "FAIL", **figures}
    except Skip as e:
        result = {"status": "SKIP", "reason": str(e)}
    except Exception as e:
        result = {"status": "FAIL", "error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    status = result.pop("status")
    print(f"{status:4}  {name:10} {_line(result)}", flush=True)
    return {"status": status, **result}


def write_results(results: dict[str, Any], out: Path) -> None:
    """The figures so far as the JSON --out holds (`python -m ebrl.bench.at_scale --gpu-costs` reads full's costs)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the figures go as JSON")
    parser.add_argument(
        "--timeout",
        type=int,
        default=540,
        help="seconds for the checks (a part's run: the 10 minutes of a call, less the kit's install)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each matmul loop")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="+", choices=CHECKS, help="run these checks only (default: every one)")
    which.add_argument(
        "--part",
        type=int,
        choices=sorted(PARTS),
        help="run one part's checks: " + "; ".join(f"{n}: {' '.join(names)}" for n, names in PARTS.items()),
    )
    parser.add_argument(
        "--kit",
        type=Path,
        help="build the folder a GPU machine that reaches no package registry "
        "needs (wheels, EGL loaders), print the command that runs each part there, and exit",
    )
    parser.add_argument(
        "--capture-batches", nargs="+", type=int, default=[1, 16, 32], help="generation batches of the capture check"
    )
    parser.add_argument(
        "--capture-settings",
        nargs="+",
        choices=("graph", "compile"),
        default=["graph"],
        help="policy.capture settings the capture check sets beside off",
    )
    parser.add_argument("--capture-rounds", type=int, default=5, help="alternated rounds per batch (medians)")
    parser.add_argument(
        "--capture-atol",
        type=float,
        default=2e-2,
        help="the largest action difference from off allowed (log-probs: 100 times it)",
    )
    parser.add_argument("--run-iterations", type=int, default=4, help="iterations of the end-to-end run")
    parser.add_argument("--run-timeout", type=int, default=200, help="seconds the end-to-end run may take")
    args = parser.parse_args()
    if args.kit is not None:
        from ebrl.bench.gpu_kit import build_and_print

        return build_and_print(args.kit, PARTS)
    names = list(PARTS[args.part] if args.part else args.only or CHECKS)
    if not torch.cuda.is_available():
        print("no CUDA device: each check imports what it needs, then skips (run this on a GPU node)")
        from ebrl.telemetry.monitor import GpuMonitor

        monitor = GpuMonitor()
        if not monitor.available:
            print(f"nvml: {monitor.reason}")

    def deadline(signum: int, frame: Any) -> None:
        # once: the cleanup that follows (daemons told to quit, children killed) must not be cut short by another
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        raise Deadline(f"--timeout={args.timeout} s passed" if signum == signal.SIGALRM else "SIGTERM came")

    previous = signal.signal(signal.SIGTERM, deadline)
    signal.signal(signal.SIGALRM, deadline)
    signal.alarm(args.timeout)
    results: dict[str, Any] = {}
    name = names[0]
    try:
        for name in names:
            results[name] = run_check(name, args)
            write_results(results, args.out)
    except Deadline as e:
        end_children()
        print(
            f"FAIL  {name:10} {e} during it; the processes it started are ended; figures so far in {args.out}",
            flush=True,
        )
        results[name] = {"status": "FAIL", "error": f"{e} during it"}
        results.update(
            {rest: {"status": "SKIP", "reason": f"not reached: {e}"} for rest in names[names.index(name) + 1 :]}
        )
        write_results(results, args.out)
        return 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, previous)
    return 0 if all(r["status"] != "FAIL" for r in results.values()) else 1


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(lambda: sys.exit(main()), "gpu_check")
