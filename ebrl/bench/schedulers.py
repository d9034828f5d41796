"""Scheduling modes side by side on one workload, with their yardsticks: `python -m ebrl.bench.schedulers`.

One invocation runs `--repeats` rounds (3 by default), the modes in the given order in even rounds and reversed in
odd ones (A B, B A, A B, ...: a drift of the machine over the run favours no mode), and reports each row's median
over the rounds with its min-max:
- each mode (`--modes`, any `scheduler=` option): env steps/s end to end (rollout + PPO update), from the
  real Experiment built from the composed config, the first (warm-up) iteration discarded as RunSummary does;
- sim-only: the same envs (SimWorkerPool, same env config and count) stepped in lockstep with no policy in
  the loop, all envs submitted then waited, chunk by chunk, replaying action chunks the policy sampled in a
  warm-up iteration (the physics of a moving arm costs more than of a still one);
- gymnasium AsyncVectorEnv: the same policy driving the same adapters in gymnasium's subprocess vector env
  (a chunk sampled for all envs, then its actions stepped one step at a time in lockstep), rollout only
  and with the same PPO update per iteration;
- the work-conserving limit: cores / (CPU-seconds per env step of simulation + generation + training),
  each stage measured alone, the least over rounds. Simulation: CPU time of the sim-only run's worker
  processes per env step, or, if less, of the same chunks replayed with each env pinned to a core of its own
  and no more envs running than cores (time-slicing many runnable envs over few cores costs CPU that a
  schedule handing out cores does not pay).
  Generation and training: CPU time of policy.sample at the rollout's batch and of one PPO update on a
  rollout of the same size, with one torch thread (the least CPU a stage can take: no thread-pool
  overhead), per env step, the least of a few timings. No schedule on these cores can beat it;
  achieved/limit says how close a row is. Where the run's policy is on a GPU, generation and training are
  measured there (device time) and share the one GPU: the limit is the lesser of the cores over simulation's CPU
  time and the GPU over theirs.
Rows that do less work are set against the limit of the work they do (sim-only: simulation alone;
gymnasium rollout: simulation + generation).

This module imports torch and the runtime lazily: gymnasium's spawned env processes re-import the
main module, and should not pay for torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ebrl.shape import group_size  # the envs built from one seed (SimWorkerPool's group_size, as Experiment gives it)

CONF = Path(__file__).resolve().parents[2] / "conf"
SIM_ONLY, GYM_ROLLOUT, GYM_E2E = "sim-only", "gym AsyncVectorEnv (rollout)", "gym AsyncVectorEnv + PPO"
STAGES = ("simulate", "generate", "train")
REPS = 3  # timings of generation and training alone per round; the least counts


@dataclass
class Workload:
    """What every row runs: the composed config's env, policy, algo and cores."""

    policy: str = "openpi"
    preset: str = "tiny"
    task: str = "Lift"
    num_envs: int = 8
    iterations: int = 3  # per measurement; the first warms up and is discarded
    rollout_chunks: int | None = None  # null: algo's default
    overrides: list[str] = field(default_factory=list)  # more Hydra overrides, applied to every row
    seed: int = 0
    stragglers: float = 0.0  # fraction of the envs that step slower (ebrl.bench.stragglers)
    straggler_task: str | None = None  # null: the same task
    straggler_slowdown: int = 3  # physics substeps per action, times the others'
    straggler_after_steps: int = 0  # > 0: stragglers slow down at their first reset after this many steps

    @property
    def straggler_envs(self) -> int:
        return round(self.stragglers * self.num_envs)

    def straggler_units(self, group_size: int = 1) -> int:
        """The straggling envs, or under GRPO the straggling groups of `group_size`: a group's envs are built from one
        seed, alike (SimWorkerPool), so a straggler is a whole group; `StragglerEnv` counts them by seed."""
        return round(self.stragglers * self.num_envs / group_size)


@dataclass
class Round:
    """One round's figures: env steps/s per row, per-stage CPU-seconds per env step, colocated's busy fraction."""

    rates: dict[str, float] = field(default_factory=dict)
    cpu_per_step: dict[str, float] = field(default_factory=dict)
    cpu_busy: dict[str, float] = field(default_factory=dict)
    stages: dict[str, dict[str, float]] = field(default_factory=dict)  # per mode: RunSummary.busy
    orchestration_cpu_per_step: float = float("nan")  # the parent's CPU per env step while only simulating
    step_ms: dict[str, float] = field(default_factory=dict)  # sim-only: step latencies, sim CPU ms per env step


def compose_overrides(overrides: Sequence[str], mode: str = "colocated") -> Any:
    """The config `python run.py scheduler=<mode> <overrides>` composes; a mode may carry its own overrides,
    `ebrl[scheduler.groups=4,scheduler.core_rebinding=false]`, applied last."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ebrl.config import register_configs

    register_configs()
    name, extra = split_mode(mode)
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return hydra_compose("config", overrides=[f"scheduler={name}", *overrides, *extra])


def compose(workload: Workload, mode: str = "colocated") -> Any:
    """The config of this workload under `mode` (see `compose_overrides`)."""
    overrides = [
        f"policy={workload.policy}",
        f"policy.preset={workload.preset}",
        f"env.task={workload.task}",
        f"env.num_envs={workload.num_envs}",
        f"iterations={workload.iterations}",
        f"seed={workload.seed}",
        "logger=none",
        "progress=false",
        "checkpoint_every=1000000",
    ]
    if workload.rollout_chunks:
        overrides.append(f"algo.rollout_chunks={workload.rollout_chunks}")
    cfg = compose_overrides(overrides + list(workload.overrides), mode)
    from ebrl.checks import complete_benchmark_tasks

    complete_benchmark_tasks(cfg)  # (the references build simulators from it, as a run does after validating)
    if workload.straggler_envs:
        from ebrl.bench.stragglers import with_stragglers

        cfg = with_stragglers(
            cfg,
            workload.straggler_units(group_size(cfg)),
            workload.straggler_task,
            workload.straggler_slowdown,
            workload.straggler_after_steps,
        )
    return cfg


def reference_algo(cfg: Any) -> Any:
    """The algo config the yardsticks take (the simulators alone for its rollout_chunks chunks, one PPO update on a
    rollout of that size): the run's under PPO. Under GRPO, whose schema has neither a rollout length nor a critic,
    the run's values of the keys both have over PPO's schema, PPO's defaults (from the run's recipe) for the rest
    and the value loss at weight 0, as GRPO's union config had before each algorithm had a schema of its own."""
    from omegaconf import OmegaConf

    if "rollout_chunks" in cfg.algo:
        return cfg.algo
    from ebrl.config import PPOConfig

    ppo = OmegaConf.to_container(OmegaConf.structured(PPOConfig))
    run = OmegaConf.create(OmegaConf.to_container(cfg))  # (interpolations kept: the recipe is the run's)
    run.algo = {**ppo, **{k: v for k, v in run.algo.items() if k in ppo}, "value_coef": 0.0}
    return OmegaConf.create(OmegaConf.to_container(run.algo, resolve=True))


def split_mode(spec: str) -> tuple[str, list[str]]:
    """ "ebrl[a=1,b=2]" -> ("ebrl", ["a=1", "b=2"])."""
    name, _, rest = spec.partition("[")
    return name, [o for o in rest.rstrip("]").split(",") if o]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with n intra-op threads, then restore what was set (Experiment sets its own)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_device_type(cfg: Any) -> str:
    """ "cuda" where the run's policy runs on a GPU, else "cpu"."""
    from ebrl.runs.base import run_device

    return run_device(cfg).type


def bench_cores(cfg: Any) -> int:
    from ebrl.checks import available_cpu_cores

    return cfg.hw.cpu_cores or available_cpu_cores()


# --- the modes ---------------------------------------------------------------------------
def run_mode(cfg: Any) -> tuple[float, float, dict[str, float]]:
    """End-to-end env steps/s of the real Experiment after warm-up, its mean CPU busy fraction, and its stages'
    busy fractions and CPU shares (RunSummary.busy)."""
    import torch

    from ebrl.runs.experiment import Experiment

    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="ebrl-bench-") as tmp:
            summary = Experiment.from_config(cfg, run_dir=Path(tmp) / "run").train()
    finally:
        torch.set_num_threads(threads)
    return summary.rollout_steps_per_s, summary.cpu_busy, summary.busy


# --- sim-only and the per-stage costs -----------------------------------------------------
def process_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds the given processes have used so far."""
    from ebrl.envs.worker import process_cpu_seconds

    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def sim_only(
    pool: Any, chunks: int, iterations: int, act: Any = None
) -> tuple[float, float, float, list[dict[str, np.ndarray]], dict[str, float]]:
    """Step every env in lockstep, `iterations` x `chunks` chunks; the first iteration warms up.

    The actions cost nothing to produce but are the policy's: `act(obs) -> (N, H, A)` samples them in the warm-up
    iteration and the measured iterations replay them, chunk by chunk (zero actions keep the arm still and
    cost the physics less than a policy's, which would flatter the limit); without `act`, zeros.

    Returns env steps/s, the workers' CPU-seconds per env step (the lesser of the measured iterations' and
    `placed_sim_cpu`'s) and the parent's (measured iterations), the observations seen after each chunk of the
    warm-up iteration (the per-stage costs run on them), and the step latencies (ms: mean, p99, slowest env's
    mean / fastest env's mean) with both CPU figures (ms per env step: lockstep, placed).
    """
    n, H = len(pool.workers), pool.execute
    zeros = np.zeros((n, H, pool.spec.action_dim), np.float32)
    pids = [w.pid for w in pool.workers]
    seen: list[dict[str, np.ndarray]] = []
    steps, wall, worker_cpu, parent_cpu = 0, 0.0, 0.0, 0.0
    step_times: list[list[np.ndarray]] = [[] for _ in range(n)]
    replay: list[np.ndarray] = []
    for it in range(max(iterations, 2)):
        c0, p0, t0 = process_cpu_s(pids), time.process_time(), time.perf_counter()
        it_steps = 0
        for c in range(chunks):
            if it == 0:
                replay.append(zeros if act is None else np.asarray(act(pool.stacked_obs()), np.float32))
            pool.submit_all(H, replay[c])
            reports = pool.wait_all()
            it_steps += sum(r.executed for r in reports)
            if it == 0:
                seen.append(pool.stacked_obs())
            else:
                for i, r in enumerate(reports):
                    step_times[i].append(r.step_times)
        if it == 0:
            continue
        wall += time.perf_counter() - t0
        worker_cpu += process_cpu_s(pids) - c0
        parent_cpu += time.process_time() - p0
        steps += it_steps
    placed = placed_sim_cpu(pool, replay)
    per_env = [np.concatenate(t) * 1e3 for t in step_times]
    every = np.concatenate(per_env)
    means = [t.mean() for t in per_env]
    latency = {
        "mean": float(every.mean()),
        "p99": float(np.percentile(every, 99)),
        "env_spread": float(max(means) / min(means)),
        **{
            f"task/{t}": float(np.mean([m for m, task in zip(means, pool.tasks) if task == t]))
            for t in dict.fromkeys(pool.tasks or ())
        },
        "cpu_lockstep": 1e3 * worker_cpu / steps,
        "cpu_placed": 1e3 * placed,
    }
    return steps / wall, min(worker_cpu / steps, placed), parent_cpu / steps, seen, latency


def placed_sim_cpu(pool: Any, replay: list[np.ndarray]) -> float:
    """Workers' CPU-seconds per env step with simulation at its cheapest placement: env i pinned to core
    i mod cores and never more envs running than cores (waves), replaying `replay` chunk by chunk. In lockstep
    all envs are runnable at once and the OS time-slices them over the cores, which costs CPU (switches, cold
    caches); a schedule that hands each env a core of its own does not pay it, so the limit takes the lesser."""
    cores = sorted(os.sched_getaffinity(0))
    workers, H = pool.workers, pool.execute
    pids = [w.pid for w in workers]
    try:
        for i, worker in enumerate(workers):
            worker.bind([cores[i % len(cores)]])
        c0, steps = process_cpu_s(pids), 0
        for actions in replay:
            for start in range(0, len(workers), len(cores)):
                wave = range(start, min(start + len(cores), len(workers)))
                for i in wave:
                    workers[i].actions[:H] = actions[i]
                    workers[i].submit(H)
                steps += sum(workers[i].wait().executed for i in wave)
        return (process_cpu_s(pids) - c0) / steps
    finally:
        for worker in workers:
            worker.bind(cores)


def policy_batch(obs: dict[str, np.ndarray], tokens: Any, mask: Any) -> dict[str, Any]:
    import torch

    batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in obs.items()}
    batch["tokens"], batch["token_mask"] = tokens, mask
    return batch


def stage_costs(policy: Any, trainer: Any, seen: list[dict[str, np.ndarray]], device: Any = None) -> dict[str, float]:
    """Seconds per env step of generation (policy.sample on each chunk's obs, the rollout's batch) and of training
    (one PPO update on a rollout of the same size), each alone, on the run's device: on CPU the CPU time with one
    torch thread; on a GPU the device time (synchronised wall time; the kernels, not the host's threads, are the
    cost there)."""
    import torch

    from ebrl.rl.rollout import ChunkStep, stack_steps

    device = torch.device("cpu") if device is None else torch.device(device)
    cuda = device.type == "cuda"
    n, H = len(next(iter(seen[0].values()))), policy.execute  # (the env steps of a chunk)
    tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([policy.env_spec.instruction] * n))
    executed = (torch.arange(policy.chunk_len, device=device) < H).expand(n, -1)
    batches = [{k: v.to(device) for k, v in policy_batch(obs, tokens, mask).items()} for obs in seen]
    env_steps = len(seen) * n * H

    def timed(work: Any) -> float:
        """The least of REPS timings: one-off costs (new shapes, allocator growth) are not the stage's."""
        best = math.inf
        for _ in range(REPS):
            t0 = time.perf_counter()
            work()
            if cuda:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    # On CPU: wall time of single-threaded work on otherwise idle cores (process_time would also count OpenMP
    # threads of earlier multi-threaded phases that spin-wait), with denormal floats flushed to zero: on this
    # rollout-shaped batch a small-preset PPO update otherwise ran into denormals and took 42 instead of 8.7 ms per
    # env step, and the limit is the least CPU a stage can take
    flush = torch.set_flush_denormal(True)
    with torch_threads(1 if not cuda else torch.get_num_threads()):
        outs = [policy.sample(b) for b in batches]  # warm-up: first-call allocations
        generate = timed(lambda: [policy.sample(b) for b in batches])
        gen = torch.Generator().manual_seed(0)
        steps = [
            ChunkStep(
                obs=b,
                chunk=o.chunk,
                extras=o.extras,
                log_prob=o.log_prob,
                value=o.value,
                reward=torch.randn(n, generator=gen).to(device),
                done=torch.zeros(n, dtype=torch.bool, device=device),
                mask=executed,
                cutoff_value=torch.zeros(n, device=device),
            )
            for b, o in zip(batches, outs)
        ]
        batch = stack_steps(steps, policy.value(batches[-1]))
        # warm-up on as few chunk steps as the minibatches allow: Adam's state and autograd's first-call costs
        warm = -(-trainer.cfg.minibatches // n)
        trainer.update(stack_steps(steps[:warm], batch.last_value))
        train = timed(lambda: trainer.update(batch))
    if flush:
        torch.set_flush_denormal(False)
    return {"generate": generate / env_steps, "train": train / env_steps}


def limits_of(cost: dict[str, float], cores: int, gpu: bool) -> dict[str, float]:
    """The work-conserving limits (env steps/s) of all three stages, simulation alone, and simulation with
    generation, from each stage's seconds per env step: on CPU the cores divided by the CPU work; on a GPU node the
    lesser of the cores over simulation's CPU work and the one GPU over generation's and training's GPU work."""
    sim = cores / cost["simulate"]
    if not gpu:
        return {
            "sim+gen+train": cores / sum(cost.values()),
            "sim": sim,
            "sim+gen": cores / (cost["simulate"] + cost["generate"]),
        }
    return {
        "sim+gen+train": min(sim, 1 / (cost["generate"] + cost["train"])),
        "sim": sim,
        "sim+gen": min(sim, 1 / cost["generate"]),
    }


def references_sim(cfg: Any, iterations: int) -> tuple[float, dict[str, float], float, dict[str, float], Any]:
    """The sim-only rate, the three stages' CPU-seconds per env step, the parent's orchestration CPU per env
    step and the step latencies, on this workload's envs and policy (`cfg`, policy.execute settled); and the envs'
    EnvSpec."""
    import torch
    from omegaconf import OmegaConf

    from ebrl.envs.worker import SimWorkerPool
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer
    from ebrl.runs.base import run_device

    conf = OmegaConf.to_container(cfg, resolve=True)
    torch.manual_seed(cfg.seed)
    device = run_device(cfg)  # generation and training are measured where the run puts them
    # (a run's seeds: GRPO's groups are built alike, so the stragglers are the run's)
    with SimWorkerPool(
        env_cfg=conf["env"], num_envs=cfg.env.num_envs, seed=cfg.seed, group_size=group_size(cfg)
    ) as pool:
        policy = build_policy(conf["policy"], pool.spec, device, train=True)
        pool.attach(policy.execute)
        pool.reset_all()
        n = cfg.env.num_envs
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([w.spec.instruction for w in pool.workers]))

        def act(obs: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                batch = {k: v.to(device) for k, v in policy_batch(obs, tokens, mask).items()}
                return policy.sample(batch).chunk[:, : policy.execute].float().cpu().numpy()

        algo = reference_algo(cfg)
        rate, sim_cpu, parent_cpu, seen, latency = sim_only(pool, algo.rollout_chunks, iterations, act)
    costs = {"simulate": sim_cpu, **stage_costs(policy, PPOTrainer(policy, algo, device), seen, device)}
    return rate, costs, parent_cpu, latency, pool.spec


# --- the external reference: gymnasium's AsyncVectorEnv ------------------------------------
def gym_reference(cfg: Any, spec: Any, iterations: int) -> tuple[float, float]:
    """The same policy driving gymnasium.vector.AsyncVectorEnv over the same adapters: env steps/s of the
    rollout alone and with the same PPO update per iteration (the first iteration warms up). `cfg`: policy.execute
    settled; `spec`: the envs' EnvSpec, which shapes the policy as in Experiment."""
    import gymnasium
    import torch
    from omegaconf import OmegaConf

    from ebrl.bench.vector_env import make_adapter_env
    from ebrl.envs.process import worker_environment
    from ebrl.envs.worker import env_seed
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer
    from ebrl.rl.rollout import ChunkStep, stack_steps
    from ebrl.runtime.resources import environment

    conf = OmegaConf.to_container(cfg, resolve=True)
    n = cfg.env.num_envs
    fns = [partial(make_adapter_env, conf["env"], env_seed(cfg.seed, i, group_size(cfg))) for i in range(n)]
    with environment(worker_environment()):  # the spawned children inherit one thread each, as SimWorkers do
        venv = gymnasium.vector.AsyncVectorEnv(
            fns, context="spawn", autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.scheduler.torch_threads or bench_cores(cfg))  # what Experiment gives colocated
    try:
        torch.manual_seed(cfg.seed)
        obs, _ = venv.reset(seed=[cfg.seed * 1000 + i for i in range(n)])
        policy = build_policy(conf["policy"], spec, train=True)
        algo = reference_algo(cfg)
        trainer = PPOTrainer(policy, algo)
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([spec.instruction] * n))
        H = policy.execute  # (the env runs these of each chunk)
        executed = (torch.arange(policy.chunk_len) < H).expand(n, -1)
        steps_n, rollout_s, total_s = 0, 0.0, 0.0
        for it in range(max(iterations, 2)):
            t0 = time.perf_counter()
            steps: list[dict] = []
            for _ in range(algo.rollout_chunks):
                batch = policy_batch(obs, tokens, mask)
                out = policy.sample(batch)
                actions = out.chunk.float().numpy()
                reward = np.zeros(n, np.float32)
                done = np.zeros(n, bool)
                for h in range(H):
                    obs, r, term, trunc, _ = venv.step(actions[:, h])
                    reward += r
                    done |= term | trunc
                steps.append(
                    ChunkStep(
                        obs=batch,
                        chunk=out.chunk,
                        extras=out.extras,
                        log_prob=out.log_prob,
                        value=out.value,
                        reward=torch.from_numpy(reward),
                        done=torch.from_numpy(done),
                        mask=executed,
                        cutoff_value=torch.zeros(n),
                    )
                )
            rollout = stack_steps(steps, policy.value(policy_batch(obs, tokens, mask)))
            t1 = time.perf_counter()
            trainer.update(rollout)
            t2 = time.perf_counter()
            if it > 0:
                steps_n += algo.rollout_chunks * n * H
                rollout_s += t1 - t0
                total_s += t2 - t0
    finally:
        torch.set_num_threads(threads)
        venv.close()
    return steps_n / rollout_s, steps_n / total_s


# --- the benchmark -----------------------------------------------------------------------
def round_order(modes: Sequence[str], index: int) -> list[str]:
    """The modes of round `index`: as given in even rounds, reversed in odd ones (ABBA)."""
    return list(modes) if index % 2 == 0 else list(reversed(modes))


@dataclass(frozen=True)
class Load:
    """`--foreign-load`: busy processes at nice 0 beside each mode's second measurement, pinned to the first cores
    of the run's or where the kernel puts them."""

    processes: int = 0
    pinned: bool = False

    def row(self, mode: str) -> str:
        return f"{mode} +{self.processes} busy{' pinned' if self.pinned else ''}"


def run_round(workload: Workload, modes: Sequence[str], gym: bool, load: Load = Load()) -> Round:
    """Every row once: the modes in the order given (each quiet, then beside `load` if any), then the references."""
    from ebrl.bench.load import foreign_load
    from ebrl.policies.build import settle_execute

    out = Round()
    for mode in modes:
        out.rates[mode], out.cpu_busy[mode], out.stages[mode] = run_mode(compose(workload, mode))
        if load.processes:
            cores = sorted(os.sched_getaffinity(0)) if load.pinned else None
            with foreign_load(load.processes, cores):
                out.rates[load.row(mode)], out.cpu_busy[load.row(mode)], _ = run_mode(compose(workload, mode))
    cfg = compose(workload)
    settle_execute(cfg)  # (the actions of each chunk a run executes, as a run settles them)
    out.rates[SIM_ONLY], out.cpu_per_step, out.orchestration_cpu_per_step, out.step_ms, spec = references_sim(
        cfg, workload.iterations
    )
    if gym:
        out.rates[GYM_ROLLOUT], out.rates[GYM_E2E] = gym_reference(cfg, spec, workload.iterations)
    return out


def summarize(rounds: list[Round], modes: Sequence[str], cores: int, gpu: bool = False) -> dict[str, Any]:
    """Medians over rounds, the limits and each row's ratios."""
    med = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    # the least each stage took in any round: noise (other load, cache contention) only adds time, and the limit must
    # bound every schedule from above
    cpu = {s: min(r.cpu_per_step[s] for r in rounds) for s in STAGES}
    limits = limits_of(cpu, cores, gpu)
    work = {SIM_ONLY: "sim", GYM_ROLLOUT: "sim+gen"}
    base = med([r.rates[modes[0]] for r in rounds]) if modes else float("nan")
    rows = []
    for name in list(modes) + [k for k in rounds[0].rates if k not in modes]:
        rate = med([r.rates[name] for r in rounds])
        kind = work.get(name, "sim+gen+train")
        rows.append(
            {
                "row": name,
                "work": kind,
                "env_steps_per_s": rate,
                "vs_first_mode": rate / base,
                "limit": limits[kind],
                "achieved_over_limit": rate / limits[kind],
                "cpu_busy": med([r.cpu_busy[name] for r in rounds if name in r.cpu_busy]),
                "per_round": [r.rates[name] for r in rounds],
                "min": min(r.rates[name] for r in rounds),
                "max": max(r.rates[name] for r in rounds),
            }
        )
    stages = {
        mode: {k: med([r.stages[mode][k] for r in rounds if k in r.stages[mode]]) for k in rounds[0].stages[mode]}
        for mode in modes
    }
    return {
        "cores": cores,
        "gpu": gpu,
        "rounds": len(rounds),
        "cpu_s_per_env_step": cpu,
        "limits": limits,
        "rows": rows,
        "stages": stages,
        "orchestration_cpu_s_per_env_step": med([r.orchestration_cpu_per_step for r in rounds]),
        "sim_step_ms": {k: med([r.step_ms[k] for r in rounds]) for k in rounds[0].step_ms},
    }


def print_report(result: dict[str, Any], workload: Workload, modes: Sequence[str]) -> None:
    w = workload
    size = group_size(compose(w))
    stragglers = (
        f" ({w.straggler_units(size) * size} stragglers{' (whole GRPO groups)' if size > 1 else ''}: "
        f"{w.straggler_task or w.task} at {w.straggler_slowdown}x the substeps)"
        if w.straggler_envs
        else ""
    )
    tasks = next((o.split("=", 1)[1] for o in w.overrides if o.startswith("env.tasks=")), None)
    what = f"envs over the tasks {tasks}" if tasks else f"x {w.task}"
    print(
        f"\nworkload: {w.num_envs} {what}{stragglers}, policy {w.policy}/{w.preset}, {result['cores']} cores, "
        f"{w.iterations} iterations per measurement (first discarded), median of {result['rounds']} rounds, modes in "
        "ABBA order"
    )
    first = modes[0] if modes else "-"
    header = ["row", "work", "env steps/s", "min-max", f"x {first}", "limit", "achieved/limit", "cpu busy"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in result["rows"]:
        busy = "" if math.isnan(r["cpu_busy"]) else f"{r['cpu_busy']:.0%}"
        print(
            f"| {r['row']} | {r['work']} | {r['env_steps_per_s']:.1f} | {r['min']:.1f}-{r['max']:.1f} | "
            f"{r['vs_first_mode']:.2f} | "
            f"{r['limit']:.1f} | {r['achieved_over_limit']:.2f} | {busy} |"
        )
    if modes:
        keys = [
            "busy_simulate",
            "busy_generate",
            "busy_train",
            "cpu_share_simulate",
            "cpu_share_main",
            "cpu_share_trainer",
        ]
        print(
            "\nwhere the time went (after warm-up): busy = share of the wall time a stage ran (simulate: per core, "
            "from chunk spans, >100% when envs wait for a core); cpu share = CPU seconds / (cores x wall) of the "
            "simulator processes, the main process (generation, orchestration; colocated: training too) and the "
            "trainer process"
        )
        print("| mode | " + " | ".join(keys) + " |")
        print("|" + "---|" * (len(keys) + 1))
        for mode in modes:
            st = result["stages"][mode]
            print(f"| {mode} | " + " | ".join(f"{st[k]:.0%}" if k in st else "-" for k in keys) + " |")
    cpu = result["cpu_s_per_env_step"]
    print(
        (
            "ms per env step, each stage alone (least over rounds; simulate CPU, generate and train GPU time): "
            if result.get("gpu")
            else "CPU ms per env step, each stage alone (least over rounds): "
        )
        + ", ".join(f"{s} {1e3 * cpu[s]:.2f}" for s in STAGES)
        + f" (sum {1e3 * sum(cpu.values()):.2f}); parent's orchestration while only simulating "
        f"{1e3 * result['orchestration_cpu_s_per_env_step']:.2f} (not in the limit)"
    )
    lat = result["sim_step_ms"]
    print(
        f"sim-only step latency: mean {lat['mean']:.1f} ms, p99 {lat['p99']:.1f} ms, slowest env's mean / "
        f"fastest env's {lat['env_spread']:.2f}; sim CPU ms per env step in lockstep {lat['cpu_lockstep']:.2f}, "
        f"one env per core {lat['cpu_placed']:.2f}"
    )
    per_task = {k.split("/", 1)[1]: v for k, v in lat.items() if k.startswith("task/")}
    if per_task:
        print(
            "sim-only step latency per task (mean of its envs' means, ms): "
            + ", ".join(f"{t} {v:.1f}" for t, v in per_task.items())
            + f"; slowest / fastest {max(per_task.values()) / min(per_task.values()):.2f}"
        )
    how = (
        "min(cores / simulate's CPU-seconds, 1 GPU / generate's and train's GPU-seconds) per env step"
        if result.get("gpu")
        else "cores / sum of the stages' CPU-seconds per env step"
    )
    print(f"limit = {how}: " + ", ".join(f"{k} {v:.1f} steps/s" for k, v in result["limits"].items()))


def under_load(result: dict[str, Any], modes: Sequence[str], load: Load) -> dict[str, dict[str, float]]:
    """Print and return each mode's env steps/s quiet and beside the foreign load, and the share it kept."""
    rate = {r["row"]: r["env_steps_per_s"] for r in result["rows"]}
    figures = {
        mode: {"quiet": rate[mode], "loaded": rate[load.row(mode)], "kept": rate[load.row(mode)] / rate[mode]}
        for mode in modes
    }
    where = "pinned to the first cores" if load.pinned else "unpinned"
    print(
        f"\nbeside {load.processes} busy process(es) at nice 0 ({where}; {load.processes} of {result['cores']} cores "
        f"is {load.processes / result['cores']:.0%} of the machine), medians over rounds:"
    )
    print("| mode | quiet env steps/s | loaded | kept |")
    print("|---|---|---|---|")
    for mode, f in figures.items():
        print(f"| {mode} | {f['quiet']:.1f} | {f['loaded']:.1f} | {f['kept']:.0%} |")
    return figures


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse, run `--repeats` rounds (modes in ABBA order), print the table; returns what `--json` writes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", nargs="+", default=["colocated"], help="scheduler= options to compare; the first is the ratio's base"
    )
    parser.add_argument("--policy", default="openpi", help="policy= group option")
    parser.add_argument("--policy-preset", default="tiny", choices=["tiny", "small", "full"])
    parser.add_argument("--task", default="Lift", help="robosuite task of every env")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="a multi-task workload: env.tasks=[...], envs round-robin over them (instead of --task)",
    )
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3, help="per measurement; the first is warm-up (>= 2)")
    parser.add_argument("--rollout-chunks", type=int, default=None, help="chunks per env per iteration (algo's)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds (modes in ABBA order); each row's figure is the median, with its min-max",
    )
    parser.add_argument("--no-gym", action="store_true", help="skip the gymnasium AsyncVectorEnv reference")
    parser.add_argument(
        "--stragglers",
        type=float,
        default=0.0,
        help="fraction of the envs that step slower (ebrl.bench.stragglers), 0..1",
    )
    parser.add_argument("--straggler-task", default=None, help="task the stragglers run (default: --task)")
    parser.add_argument(
        "--straggler-slowdown",
        type=int,
        default=3,
        help="stragglers take this many times the physics substeps per action",
    )
    parser.add_argument(
        "--foreign-load",
        type=int,
        default=0,
        metavar="N",
        help="also measure each mode beside N busy processes at nice 0 (a shared node's other load)",
    )
    parser.add_argument(
        "--foreign-pinned",
        action="store_true",
        help="pin the busy processes to the run's first cores (default: where the kernel puts them)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every row, e.g. algo.epochs=2")
    args = parser.parse_args(argv)
    from ebrl.checks import SCHEDULERS

    for spec in args.modes:
        mode, _ = split_mode(spec)
        if mode not in SCHEDULERS:
            parser.error(f"--modes {mode}: not a scheduler; accepted: {', '.join(SCHEDULERS)}")
    if not 0 <= args.stragglers <= 1:
        parser.error(f"--stragglers={args.stragglers}: a fraction of the envs, 0..1")
    if args.iterations < 2:
        parser.error(f"--iterations={args.iterations}: need at least 2 (the first is discarded)")
    workload = Workload(
        policy=args.policy,
        preset=args.policy_preset,
        task=args.task,
        num_envs=args.num_envs,
        iterations=args.iterations,
        rollout_chunks=args.rollout_chunks,
        overrides=[*(["env.tasks=[" + ",".join(args.tasks) + "]"] if args.tasks else []), *args.overrides],
        seed=args.seed,
        stragglers=args.stragglers,
        straggler_task=args.straggler_task,
        straggler_slowdown=args.straggler_slowdown,
    )
    if args.tasks and not args.no_gym:
        print("--tasks: no gymnasium reference (its AsyncVectorEnv runs one task)", file=sys.stderr)
    gym = not args.no_gym and not args.tasks
    load = Load(args.foreign_load, args.foreign_pinned)
    rounds = [run_round(workload, round_order(args.modes, i), gym=gym, load=load) for i in range(args.repeats)]
    cfg = compose(workload)
    result = summarize(rounds, args.modes, bench_cores(cfg), gpu=run_device_type(cfg) == "cuda")
    result["workload"] = workload.__dict__
    print_report(result, workload, args.modes)
    if load.processes:
        result["under_load"] = under_load(result, args.modes, load)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "schedulers")
