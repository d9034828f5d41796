"""A run's throughput predicted in virtual time, and checked against the real run here. `python -m ebrl.bench.at_scale`.

The real `Scheduler`, `RolloutLoop`, `CorePool` and `Placement` run with modelled stages (ebrl/forecast/virtual.py):
every figure it prints is simulated, from the costs it names. The costs come from this machine
(`measure_costs`): each env's control steps alone on a core (a placed wave of envs, the policy's actions), the
policy's sampling and valuing at three batch sizes and one update at the rollout's size, on one thread and on every
core (the parallel efficiency), and a reset.

    python -m ebrl.bench.at_scale [overrides ...] [--modes colocated ebrl async] [--envs N] [--iterations K]
                                  [--validate] [--costs FILE] [--save-costs FILE]
                                  [--task T --num-envs N --policy-preset P --stragglers F --straggler-slowdown S]

`--validate` runs each mode for real too (the scheduler benchmark's `run_mode`, the same config, `--repeats` rounds in
ABBA order, each after measuring the costs again, unless `--costs` is given) and prints the median of the rounds'
predictions beside the median of the runs. Not modelled yet: ebrl/forecast/virtual.py's
`NOT_MODELLED`.

On an hw with GPUs (`hw=a100x8`, `--testbed` for the paper's) nothing can be measured here: one rank per GPU is
predicted on `ModelledCosts` (the simulators' steps given or measured here, the policy's GPU calls from
ebrl/forecast/gpu_cost.py's roofline or gpu_check's measurements), and the output ends with what bounds a rank
(`gpu_capacity`) and the memory model's footprint per GPU (`gpu_memory`).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ebrl.bench.schedulers import (
    bench_cores,
    placed_sim_cpu,
    policy_batch,
    process_cpu_s,
    reference_algo,
    torch_threads,
)
from ebrl.shape import RolloutShape, group_size

LABEL = "simulated"
ACTION_DIMS = {"robocasa": 12}  # PandaOmron (ebrl/envs/robocasa_env.py); LIBERO's, robosuite's, ManiSkill's: 7
# the paper's testbed (section 3.1): 2x Xeon Gold 6348 (56 cores), 8x A100, pi0 on RoboCasa with PPO, steps of 40 ms
# mean and 60 ms at the 99th percentile (its Fig. 7)
TESTBED = ["policy=openpi", "policy.preset=full", "env=robocasa", "hw=a100x8", "algo=ppo"]
TESTBED_SIM_MS = (40.0, 60.0)
# a benchmark's published step distribution, a GPU node's default for it (--sim-step-ms or --sim-costs replace it)
PUBLISHED_SIM_MS = {
    "robocasa": (TESTBED_SIM_MS, "the paper's published RoboCasa steps (its Fig. 7), env=robocasa's default")
}
EPISODE_CHUNKS = 6  # rollouts' worth of chunks measured (the first warms up): enough episodes end to draw lengths from


def drawn_steps(steps: list[list[float]], envs: int, env: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` control steps of env `env`, drawn with replacement from the measured ones: of N envs predicted, env i
    steps as measured env i x M / N of the M measured."""
    own = steps[env * len(steps) // max(envs, len(steps))]
    return np.asarray(own)[rng.integers(0, len(own), n)]


def drawn_length(lengths: list[int], limit: int, rng: np.random.Generator) -> int:
    """An episode's length, drawn from those seen while measuring (none seen: every episode hits the limit)."""
    return int(rng.choice(lengths)) if lengths else limit


@dataclass
class MeasuredCosts:
    """Costs measured on this machine (seconds of one thread; see the module docstring). `steps[i]`: env i's control
    steps, drawn from with replacement; generation and valuing as intercept + slope x batch; training per decision (a
    chunk step of one env, masked or not); `efficiencies[stage][threads]`: the speed-up on that many threads over
    their number."""

    steps: list[list[float]]
    generate_fit: tuple[float, float]
    value_fit: tuple[float, float]
    train_per_row: float
    # with the proximal pass over every row (decoupled PPO, algo.proximal=all): a row the pass values costs the
    # difference more
    train_decoupled_per_row: float
    efficiencies: dict[str, dict[str, float]]
    reset_s: float
    max_episode_steps: int
    execute: int
    chunk_len: int
    action_dim: int
    source: str = "measured here"
    lengths: list[int] = field(default_factory=list)  # episode lengths seen (empty: every episode hits the limit)
    init: str | None = None  # the checkpoint whose policy acted while the costs were measured
    timeslice: float = 0.0  # CPU a simulator loses while it shares its core, over its own (lockstep over placed - 1)

    envs: int = 0  # the envs of the run being predicted (set by `predict`): env i steps as measured env i x M / N

    def sim_steps(self, env: int, n: int, rng: np.random.Generator) -> np.ndarray:
        return drawn_steps(self.steps, self.envs, env, n, rng)

    def episode_length(self, env: int, rng: np.random.Generator) -> int:
        return drawn_length(self.lengths, self.max_episode_steps, rng)

    def generate(self, batch: int) -> float:
        return max(0.0, self.generate_fit[0] + self.generate_fit[1] * batch)

    def value(self, batch: int) -> float:
        return max(0.0, self.value_fit[0] + self.value_fit[1] * batch)

    def train(self, rows: int, proximal: int = 0) -> float:
        return self.train_per_row * rows + (self.train_decoupled_per_row - self.train_per_row) * proximal

    def efficiency(self, stage: str, threads: int) -> float:
        if threads <= 1:
            return 1.0
        known = {int(k): v for k, v in self.efficiencies.get(stage, {}).items()}
        return known.get(threads, min(known.values(), default=1.0))

    def reset(self) -> float:
        return self.reset_s


def read_costs(path: str) -> MeasuredCosts:
    """A costs file (--save-costs) read back; one written by an older version lacks a cost the model now charges."""
    from dataclasses import MISSING, fields

    from ebrl.config import ConfigError

    saved, known = json.loads(Path(path).read_text()), fields(MeasuredCosts)
    missing = [f.name for f in known if f.name not in saved and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(
            f"the costs file {path} lacks {', '.join(missing)} (an older version wrote it): measure "
            "them again with --save-costs"
        )
    return MeasuredCosts(**{f.name: saved[f.name] for f in known if f.name in saved})


GPU_COST_KEYS = ("gpu", "policy", "sample_s", "train_s_per_row_epoch")  # gpu_check's full_costs


def read_gpu_costs(path: str) -> dict[str, Any]:
    """A GPU node's measured costs (--gpu-costs): the full check's `costs` in gpu_check's --out JSON (its --part 1
    file), or one line on what the file lacks."""
    from ebrl.config import ConfigError

    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--gpu-costs {path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    full = results.get("full") if isinstance(results, dict) else None
    if not isinstance(full, dict):
        raise ConfigError(
            f"--gpu-costs {path} holds no full check: give the JSON of `python -m ebrl.bench.gpu_check "
            "--part 1` (or --only full)"
        )
    costs = full.get("costs")
    missing = [k for k in GPU_COST_KEYS if not isinstance(costs, dict) or k not in costs]
    if missing:
        said = full.get("error") or full.get("reason") or f"no {', '.join(missing)}"
        raise ConfigError(
            f"--gpu-costs {path}: its full check measured no costs ({full.get('status')}: {said}): run "
            "it again on the GPU node"
        )
    return costs


# --- measuring here --------------------------------------------------------------------------
def measure_costs(cfg: Any, chunks: int | None = None) -> MeasuredCosts:
    """The workload's costs on this machine (see the module docstring); `cfg`: policy.execute settled."""
    import os

    import torch
    from omegaconf import OmegaConf

    from ebrl.envs.worker import SimWorkerPool
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer
    from ebrl.rl.rollout import ChunkStep, stack_steps
    from ebrl.runs.init import init_file
    from ebrl.runtime.checkpoint import adopt_norm_stats, load_checkpoint, load_policy_checkpoint, restore_weights

    # subnormals flushed before torch's first parallel work, as a run does (experiment.py): the flag is per thread,
    # and the thread pool made here, which later runs in this process (--validate) train on, keeps the one it is
    # made with (docs/internals/schedules.md, "Measured choices")
    flush = torch.set_flush_denormal(True)
    conf = OmegaConf.to_container(cfg, resolve=True)
    torch.manual_seed(cfg.seed)
    algo = reference_algo(cfg)  # (PPO's shape of the update, whatever the run's algorithm)
    n, chunks = cfg.env.num_envs, chunks or int(algo.rollout_chunks)
    cores = sorted(os.sched_getaffinity(0))[: bench_cores(cfg)]
    init = init_file(cfg)  # the run's first weights act here too: its actions set the physics' cost and episodes
    with (
        tempfile.TemporaryDirectory(prefix="ebrl-at-scale-") as tmp,
        SimWorkerPool(env_cfg=conf["env"], num_envs=n, seed=cfg.seed, group_size=group_size(cfg)) as pool,
    ):
        if init is not None:
            adopt_norm_stats(load_checkpoint(init), conf, Path(tmp))
        policy = build_policy(
            conf["policy"], pool.spec, torch.device("cpu"), train=True, weights="given" if init is not None else "init"
        )
        if init is not None:
            restore_weights(policy, load_policy_checkpoint(init, conf["policy"], "init", resume=False), "init")
        pool.attach(policy.execute)
        pool.reset_all()
        H, workers = policy.execute, pool.workers
        tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([w.spec.instruction for w in workers]))
        steps: list[list[float]] = [[] for _ in range(n)]
        lengths: list[int] = []
        replay: list[np.ndarray] = []  # each chunk's actions
        for i, worker in enumerate(workers):
            worker.bind([cores[i % len(cores)]])
        for c in range(EPISODE_CHUNKS * chunks):  # (the first `chunks` warm up; every episode's end is kept)
            obs = pool.stacked_obs()  # (the last one is what generation and training are timed on)
            with torch.inference_mode():
                actions = policy.sample(policy_batch(obs, tokens, mask)).chunk[:, :H].float().numpy()
            replay.append(actions)
            for start in range(0, n, len(cores)):  # waves: one env per core, none time-sliced
                wave = range(start, min(start + len(cores), n))
                for i in wave:
                    workers[i].actions[:H] = actions[i]
                    workers[i].submit(H)
                for i in wave:
                    report = workers[i].wait()
                    if c >= chunks:
                        steps[i] += report.step_times.tolist()
                    if report.episode is not None:
                        lengths.append(int(report.episode["length"]))
        # time-slicing: the last rollout's chunks again with every env runnable at once on every core, as a lockstep
        # rollout runs them, against their cheapest placement (`placed_sim_cpu`: one env per core; it leaves every
        # env on every core); CPU seconds of the workers per env step
        replay = replay[-chunks:]
        placed = placed_sim_cpu(pool, replay)
        pids = [w.pid for w in workers]
        c0, executed = process_cpu_s(pids), 0
        for actions in replay:
            pool.submit_all(H, actions)
            executed += sum(r.executed for r in pool.wait_all())
        timeslice = max(0.0, (process_cpu_s(pids) - c0) / executed / placed - 1)
        t0 = time.perf_counter()
        pool.reset(list(range(n)), list(range(n)))
        reset_s = (time.perf_counter() - t0) / n * min(n, len(cores))  # (the reset runs in parallel over the cores)
        for worker in workers:
            worker.bind(cores)
        spec = pool.spec

    def timed(work: Any, reps: int = 5) -> float:
        """The median of `reps` timings: a prediction wants the typical cost (the limit takes the least)."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    trainer = PPOTrainer(policy, algo)
    sizes = sorted({1, max(1, n // 2), n})
    batches = {b: policy_batch({k: v[:b] for k, v in obs.items()}, tokens[:b], mask[:b]) for b in sizes}
    out = {}
    with torch.no_grad():
        for threads in (1, len(cores)):
            with torch_threads(threads):
                for b in sizes:
                    policy.sample(batches[b])
                    out[("sample", threads, b)] = timed(lambda: policy.sample(batches[b]))
                    out[("value", threads, b)] = timed(lambda: policy.value(batches[b]))
    gen = torch.Generator().manual_seed(0)
    executed = (torch.arange(policy.chunk_len) < H).expand(n, -1)
    full = policy_batch(obs, tokens, mask)
    with torch.no_grad():
        sampled = policy.sample(full)
    rollout = stack_steps(
        [
            ChunkStep(
                obs=full,
                chunk=sampled.chunk,
                extras=sampled.extras,
                log_prob=sampled.log_prob,
                value=sampled.value,
                reward=torch.randn(n, generator=gen),
                done=torch.zeros(n, dtype=torch.bool),
                mask=executed,
                cutoff_value=torch.zeros(n),
            )
            for _ in range(chunks)
        ],
        sampled.value,
    )
    train = {}
    for threads in (1, len(cores)):
        with torch_threads(threads):
            trainer.update(rollout)  # (warm-up)
            train[threads] = timed(lambda: trainer.update(rollout), reps=3)
    with torch_threads(1):
        decoupled = timed(lambda: trainer.update(rollout, decoupled=True), reps=3)
    if flush:
        torch.set_flush_denormal(False)
    fit = lambda kind: tuple(np.polyfit(sizes, [out[(kind, 1, b)] for b in sizes], 1)[::-1].tolist())  # noqa: E731
    k = len(cores)
    efficiency = {
        "generate": {str(k): out[("sample", 1, n)] / (k * out[("sample", k, n)])},
        "train": {str(k): train[1] / (k * train[k])},
    }
    return MeasuredCosts(
        steps=steps,
        generate_fit=fit("sample"),
        value_fit=fit("value"),
        train_per_row=train[1] / (n * chunks),
        train_decoupled_per_row=decoupled / (n * chunks),
        efficiencies=efficiency,
        reset_s=reset_s,
        max_episode_steps=int(spec.max_episode_steps),
        execute=H,
        chunk_len=int(policy.chunk_len),
        action_dim=int(spec.action_dim),
        lengths=lengths,
        init=str(init) if init else None,
        timeslice=timeslice,
        source=f"measured here {time.strftime('%Y-%m-%d')}, {k} cores",
    )


# --- modelled: a GPU node --------------------------------------------------------------------
def lognormal(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and 99th percentile: sigma solves z sigma - sigma^2 / 2 =
    ln(p99 / mean), z the normal's 99th percentile, the smaller root."""
    z = 2.3263478740408408
    ratio = math.log(p99 / mean)
    if not 0 < ratio < z * z / 2:
        raise ValueError(
            f"no lognormal has mean {mean} and 99th percentile {p99}: needs mean < p99 < "
            f"{math.exp(z * z / 2):.1f} x mean"
        )
    sigma = z - math.sqrt(z * z - 2 * ratio)
    return math.log(mean) - sigma * sigma / 2, sigma


@dataclass
class ModelledCosts:
    """The costs of a node this machine is not (see docs/internals/at-scale.md): each simulator step drawn from a
    lognormal of `sim_mean_s` and `sim_p99_s` (each step on its own), or from `steps` (each env's, measured here:
    `MeasuredCosts`), an episode `max_episode_steps` long unless `lengths` says otherwise, a reset of `reset_s`; the
    GPU stages from the policy's operations on `gpu`'s roofline (ebrl/forecast/gpu_cost.py), each operation at least
    `host_s`; `sources` name where each figure comes from."""

    sim_mean_s: float
    sim_p99_s: float
    reset_s: float
    max_episode_steps: int
    execute: int
    chunk_len: int
    action_dim: int
    ops: Any  # ebrl.forecast.gpu_cost.PolicyOps
    gpu: Any  # ebrl.forecast.gpu_cost.GpuSpec
    host_s: float
    shape: Any  # ebrl.forecast.gpu_cost.UpdateShape
    sources: dict[str, str] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    timeslice: float = 0.0
    envs: int = 0
    steps: list[list[float]] = field(default_factory=list)
    measured_gpu: dict[str, Any] | None = None  # gpu_check's "costs" (full's): they replace the roofline's

    def sim_steps(self, env: int, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.steps:
            return drawn_steps(self.steps, self.envs, env, n, rng)
        mu, sigma = lognormal(self.sim_mean_s, self.sim_p99_s)
        return rng.lognormal(mu, sigma, n)

    def episode_length(self, env: int, rng: np.random.Generator) -> int:
        return drawn_length(self.lengths, self.max_episode_steps, rng)

    def on_gpu(self, kind: str, rows: int, share: float, proximal: int = 0) -> Any:
        from ebrl.forecast.gpu_cost import GpuTime, roofline, train_time

        if kind == "train":
            modelled = train_time(self.ops, rows, self.shape, self.gpu, share, self.host_s, proximal)
        else:
            modelled = roofline(
                self.ops.sample if kind == "sample" else self.ops.value, rows, self.gpu, share, self.host_s
            )
        m = self.measured_gpu
        if m is None or kind == "value":
            return modelled
        # measured on the whole GPU: at a share, as much longer as the roofline says; the SMs' busy share the
        # roofline's (gpu_check measures no occupancy)
        if kind == "train":
            # (gpu_check's update takes no proximal pass: one that does as much longer as the roofline says too)
            seconds = m["train_s_per_row_epoch"] * rows * int(self.shape.algo.epochs)
            whole = train_time(self.ops, rows, self.shape, self.gpu, 1.0, self.host_s)
        else:
            xs, ts = zip(*sorted((int(b), float(t)) for b, t in m["sample_s"].items()))
            if rows <= xs[-1]:  # (between the measured batches linear; below the least its time)
                seconds = float(np.interp(rows, xs, ts))
            else:  # (above the largest, the last two's slope)
                seconds = ts[-1] + (ts[-1] - ts[-2]) / (xs[-1] - xs[-2]) * (rows - xs[-1])
            whole = roofline(self.ops.sample, rows, self.gpu, 1.0, self.host_s)
        return GpuTime(seconds * modelled.seconds / whole.seconds, modelled.sm_busy)

    def reset(self) -> float:
        return self.reset_s

    def efficiency(self, stage: str, threads: int) -> float:
        return 1.0

    def generate(self, batch: int) -> float:
        raise NotImplementedError("modelled costs are a GPU node's: generation runs on the GPU (on_gpu)")

    value = train = generate


def modelled_costs(
    cfg: Any,
    sim_ms: Sequence[float] | None,
    reset_ms: float,
    cameras: int,
    measured: MeasuredCosts | None = None,
    gpu_costs: dict[str, Any] | None = None,
    sim_label: str = "--sim-step-ms",
    sharded: bool = False,
) -> ModelledCosts:
    """A GPU node's costs for `cfg` (its policy, policy.execute settled, algo and hw.gpu_name): see `ModelledCosts`;
    the simulators' steps, episode lengths and resets from `measured` where given (else `sim_ms`, where `sim_label`
    says they come from), sampling and training from `gpu_costs` (gpu_check's); `sharded`: the trainers hold the
    training state under FSDP."""
    from omegaconf import OmegaConf

    from ebrl.bench.memory import env_spec
    from ebrl.forecast.gpu_cost import PolicyOps, UpdateShape, gpu_spec, host_seconds_per_op
    from ebrl.policies.build import executed_actions

    gpu = gpu_spec(cfg.hw.gpu_name)
    nodes = int(cfg.hw.get("nodes") or 1)
    policy_cfg = OmegaConf.to_container(cfg.policy, resolve=True)
    spec = env_spec(cameras, action_dim=ACTION_DIMS.get(cfg.env.name, 7))
    ops = PolicyOps.of(policy_cfg, spec)
    host_s, host_source = host_seconds_per_op()  # (ebrl/forecast/gpu_cost.py)
    if measured is not None:
        every = np.concatenate([np.asarray(s) for s in measured.steps])
        mean, p99, reset_ms = float(every.mean()), float(np.percentile(every, 99)), 1e3 * measured.reset_s
        steps = {
            "simulator steps": f"{measured.source}: mean {1e3 * mean:.2f} ms, 99th percentile "
            f"{1e3 * p99:.2f} ms (--sim-costs)",
            "resets": f"{reset_ms:.1f} ms (measured)",
        }
    else:
        mean, p99 = (float(sim_ms[0]) / 1e3, float(sim_ms[-1]) / 1e3)
        steps = {
            "simulator steps": f"lognormal, mean {1e3 * mean:g} ms, 99th percentile {1e3 * p99:g} ms ({sim_label})",
            "resets": f"{reset_ms:g} ms each (--reset-ms)",
        }
    sources = {
        **steps,
        "GPU": gpu.source,
        "policy": f"{cfg.policy.name} {cfg.policy.preset}, {ops.parameters / 1e9:.2f} B parameters, "
        f"{cameras} cameras at 224 px: {ops.sample.count} operations per sample, traced on the meta "
        "device (ebrl/forecast/gpu_cost.py)",
        "host per operation": host_source,
    }
    if gpu_costs is not None:
        sources["GPU"] = (
            f"measured on {gpu_costs['gpu']} by gpu_check ({gpu_costs['policy']}): sample and update; "
            f"values and SM occupancy from {gpu.source}"
        )
    return ModelledCosts(
        sim_mean_s=mean,
        sim_p99_s=p99,
        reset_s=reset_ms / 1e3,
        max_episode_steps=int(cfg.env.max_episode_steps),
        execute=executed_actions(policy_cfg, ops.chunk_len),
        chunk_len=ops.chunk_len,
        action_dim=ops.action_dim,
        ops=ops,
        gpu=gpu,
        host_s=host_s,
        shape=UpdateShape(cfg.algo, ranks=int(cfg.hw.gpus) * nodes, nodes=nodes, sharded=sharded),
        sources=sources,
        steps=measured.steps if measured else [],
        lengths=measured.lengths if measured else [],
        timeslice=measured.timeslice if measured else 0.0,
        measured_gpu=gpu_costs,
    )


# --- predicting ------------------------------------------------------------------------------
def predict(cfg: Any, costs: Any, iterations: int, envs: int | None = None, cores: int | None = None) -> dict[str, Any]:
    """Run `cfg`'s schedule in virtual time on `costs` (virtual.py's `Costs`, with MeasuredCosts' action_dim,
    max_episode_steps, execute, chunk_len and timeslice; on a GPU node `GpuCosts`): env steps/s after the first
    iteration, each stage's busy share and CPU share, each core's busy share, and on a GPU node the SMs' busy share
    and the time no GPU call ran. On a node of several GPUs this is one rank (one GPU, its share of the cores, its
    env.num_envs); `node_env_steps_per_s` is the ranks' sum over every node (hw.nodes)."""
    import torch
    from omegaconf import OmegaConf

    from ebrl.envs.base import ArraySpec, EnvSpec
    from ebrl.forecast.virtual import (
        ModelGeneration,
        ModelPolicy,
        ModelTrainer,
        VirtualDispatcher,
        VirtualPlacement,
        VirtualPool,
        World,
    )
    from ebrl.node import Ranks
    from ebrl.runtime.placement import Placement
    from ebrl.runtime.schedule import Scheduler

    gpus = int(cfg.hw.gpus or 0)
    ranks = max(gpus, 1) * int(cfg.hw.get("nodes") or 1)  # (one per GPU, on every node alike)
    n = envs or cfg.env.num_envs
    k = cores or (int(cfg.hw.cpu_cores) // gpus if gpus else bench_cores(cfg))  # (a rank per GPU)
    costs.envs = n
    conf = OmegaConf.to_container(cfg, resolve=True)
    conf["env"]["num_envs"] = n
    spec = EnvSpec(
        obs={"state": ArraySpec((1,), "float32")},
        action_dim=costs.action_dim,
        instruction="",
        max_episode_steps=costs.max_episode_steps,
    )
    world = World(k, timeslice=costs.timeslice)
    device = torch.device("cuda" if gpus else "cpu")
    with tempfile.TemporaryDirectory(prefix="ebrl-at-scale-") as tmp:
        placement = type("Placement", (VirtualPlacement, Placement), {})(cfg, list(range(k)), device, tmp, Ranks())
        s = cfg.scheduler
        if gpus and placement.allocator is not None:  # (what a run's placement takes from the roofline)
            shape = RolloutShape.of(cfg, ranks, costs.max_episode_steps, costs.execute, envs=n)
            placement.allocator.size_by_kernels(
                {
                    "generate": costs.on_gpu("sample", shape.envs_per_group, 1.0).sm_busy,
                    "train": costs.on_gpu("train", shape.rows, 1.0).sm_busy,
                },
                "the cost model's",
            )
        pool = VirtualPool(
            world, costs, spec, n, costs.execute, cfg.seed, placement.cpus("simulate") + placement.spare(), s.sim_nice
        )
        policy = ModelPolicy(spec, costs.execute, costs.chunk_len)

        def stages(conf: dict, pool: Any, policy: Any, placement: Any, cores: Any, *_: Any) -> tuple:
            trainer = ModelTrainer(world, costs, placement)
            return (
                trainer,
                ModelGeneration(world, costs, policy, trainer, placement),
                VirtualDispatcher(world, pool, cores),
            )

        scheduler = Scheduler(pool, policy, conf, placement, seed=cfg.seed, stages=stages, clock=world.clock)
        placement.runtime = scheduler
        if placement.allocator is not None and placement.allocator.current is not None:
            scheduler.regroup(placement.allocator.current.groups)
        rates, t_start, steps, busy = [], None, 0, []
        before: dict[str, Any] = {}
        sim_cores = len(placement.cpus("simulate"))
        decisions, loop_t0, model0, all_steps = [], time.perf_counter(), world.model_s, 0

        def tally() -> dict[str, Any]:
            return {
                "cpu": dict(world.cpu.spent),
                "gpu": dict(world.gpu.spent),
                "cores": list(world.cpu.core_busy),
                "active": world.gpu.active,
            }

        for it in range(iterations):
            mark, t0, spent0 = scheduler.trace.mark(), world.now, dict(world.cpu.spent)
            stats, _ = scheduler.next_iteration()
            wall = world.now - t0
            rates.append(stats.env_steps / wall)
            all_steps += stats.env_steps
            it_busy = scheduler.trace.busy(t0, world.now, sim_cores, since=mark)
            if it == 0:
                t_start, before = world.now, tally()
            else:
                steps += stats.env_steps
                busy.append(it_busy)
            if placement.allocator is not None:  # (the Replan hook: the allocator reads the iteration, may re-plan)
                used = {
                    stage: (world.cpu.spent.get(stage, 0.0) - spent0.get(stage, 0.0)) / (k * wall)
                    for stage in ("simulate", "generate", "train")
                }
                shares = {"simulate": used["simulate"], "main": used["generate"], "trainer": used["train"]}
                line, _ = placement.observe(placement.measured(rates[-1], shares, it_busy))
                if line is not None:
                    decisions.append(f"iteration {it + 1}: {line}")
        # the real code's own seconds (Scheduler, loop, core pool, placement, allocator, the modelled stages' calls):
        # what a supervisor spends per env step besides IPC, at this many envs
        runtime_s = time.perf_counter() - loop_t0 - (world.model_s - model0)
        elapsed = world.now - t_start
        after = tally()
        spent = {
            stage: (after["cpu"].get(stage, 0.0) - before["cpu"].get(stage, 0.0)) / (k * elapsed)
            for stage in ("simulate", "generate", "train")
        }
        out = {
            "env_steps_per_s": steps / elapsed,
            "per_iteration": rates,
            "cpu_share": spent,
            "busy": {stage: float(np.mean([b[stage] for b in busy])) for stage in busy[0]},
            "core_busy": [(a - b) / elapsed for a, b in zip(after["cores"], before["cores"])],
            "virtual_seconds": world.now,
            "envs": n,
            "cores": k,
            "decisions": decisions,
            "runtime_us_per_env_step": 1e6 * runtime_s / all_steps,
            "events_per_s": world.events.count / runtime_s,
            "model_s": world.model_s - model0,
            "ranks": ranks,
            "node_env_steps_per_s": steps / elapsed * ranks,
        }
        if gpus:
            out["gpu_sm_busy"] = {
                stage: (after["gpu"].get(stage, 0.0) - before["gpu"].get(stage, 0.0)) / elapsed
                for stage in ("generate", "train")
            }
            out["gpu_idle"] = max(0.0, 1 - (after["active"] - before["active"]) / elapsed)
        scheduler.close()
    return out


# --- the command -----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py")
    parser.add_argument("--modes", nargs="+", default=["colocated", "ebrl", "async"])
    # the scheduler benchmark's workload (python -m ebrl.bench.schedulers): what --validate measures
    parser.add_argument("--task", default="Lift")
    parser.add_argument("--num-envs", type=int, default=8, help="envs measured (and run, with --validate)")
    parser.add_argument("--policy-preset", default="tiny")
    parser.add_argument("--stragglers", type=float, default=0.0, help="fraction of the envs that step slower")
    parser.add_argument("--straggler-task", default=None)
    parser.add_argument("--straggler-slowdown", type=int, default=3)
    parser.add_argument(
        "--envs",
        type=int,
        nargs="+",
        default=None,
        help="envs to predict for, one prediction each (default: --num-envs; on a GPU node, per rank: env.num_envs)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=None,
        help="the virtual node's cores (default: this machine's; on a GPU node hw.cpu_cores / hw.gpus per rank)",
    )
    parser.add_argument("--iterations", type=int, default=4, help="iterations per prediction (the first warms up)")
    parser.add_argument("--validate", action="store_true", help="run each mode for real too, beside its prediction")
    parser.add_argument(
        "--repeats", type=int, default=2, help="real runs per mode with --validate (the median; modes in ABBA order)"
    )
    parser.add_argument("--costs", help="a costs file from --save-costs (default: measure them now)")
    parser.add_argument("--save-costs", help="write the measured costs here")
    # a GPU node (hw=... with GPUs): modelled costs
    parser.add_argument(
        "--testbed",
        action="store_true",
        help="the paper's testbed: " + " ".join(TESTBED) + " with its step distribution (overrides after it win)",
    )
    parser.add_argument(
        "--sim-step-ms",
        type=float,
        nargs="+",
        default=None,
        metavar=("MEAN", "P99"),
        help="a GPU node's simulator step: mean and 99th percentile, ms (the testbed's: 40 60)",
    )
    parser.add_argument("--reset-ms", type=float, default=0.0, help="a GPU node's reset, ms")
    parser.add_argument(
        "--gpu-costs",
        help="a GPU node's sampling and update times from gpu_check's --out JSON "
        "(its full check's costs, in --part 1's file), in place of the roofline",
    )
    parser.add_argument(
        "--sim-costs",
        help="a GPU node's simulator steps, episode lengths and resets from a costs "
        "file measured here (--save-costs), in place of --sim-step-ms",
    )
    parser.add_argument("--cameras", type=int, default=2, help="cameras the policy reads at 224 px (GPU node)")
    args = parser.parse_args(argv)
    from ebrl.runtime.errors import exit_cleanly

    with exit_cleanly("the benchmark at_scale"):
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ebrl.bench.schedulers import compose_overrides

    overrides = (TESTBED if args.testbed else []) + list(args.overrides)
    cfg = compose_overrides(overrides)
    if cfg.hw.gpus:
        return run_gpu_node(args, overrides, cfg)
    return run_here(args)


def run_gpu_node(args: argparse.Namespace, overrides: list[str], cfg: Any) -> dict[str, Any]:
    """Every mode on a GPU node this machine is not, on modelled costs (`ModelledCosts`), at each --envs; then the
    capacity line: the env steps/s the GPU bounds a rank to, and the cores and envs it takes to reach it."""
    from ebrl.bench.schedulers import compose_overrides
    from ebrl.config import ConfigError
    from ebrl.policies.build import settle_execute

    if args.validate or args.costs or args.save_costs:
        raise ConfigError(
            "--validate, --costs and --save-costs measure or replay this machine's costs; a GPU node's "
            "are modelled (drop them, or predict hw=cpu)"
        )
    published = PUBLISHED_SIM_MS.get(cfg.env.name)
    sim_ms, sim_label = (
        (args.sim_step_ms, "--sim-step-ms")
        if args.sim_step_ms
        else (TESTBED_SIM_MS, "--testbed")
        if args.testbed
        else published or (None, "")
    )
    measured = read_costs(args.sim_costs) if args.sim_costs else None
    if measured is None and (not sim_ms or len(sim_ms) > 2):
        raise ConfigError(
            f"env={cfg.env.name} has no published step distribution and a GPU node's simulator steps are "
            "not measured here: give --sim-step-ms MEAN P99 (ms), e.g. the paper's RoboCasa 40 60, or "
            "--sim-costs FILE (--save-costs on hw=cpu)"
        )
    t0 = time.perf_counter()
    gpu_costs = read_gpu_costs(args.gpu_costs) if args.gpu_costs else None
    settle_execute(cfg)  # (the actions of each chunk a run executes, as a run settles them)
    strategy, memory_line = gpu_memory(cfg, max(args.envs or [int(cfg.env.num_envs)]), args.cameras)
    costs = modelled_costs(
        cfg, sim_ms, args.reset_ms, args.cameras, measured, gpu_costs, sim_label, sharded=strategy == "fsdp"
    )
    print(
        f"costs ({LABEL}; modelled in {time.perf_counter() - t0:.0f} s): "
        + "; ".join(f"{k}: {v}" for k, v in costs.sources.items())
    )
    rows = []
    print(
        f"| mode | envs per rank | cores per rank | {LABEL} env steps/s ({int(cfg.hw.get('nodes') or 1)} x "
        f"{cfg.hw.gpus} GPUs) | cores' CPU share | busy gen / train | GPU SM busy gen / train | GPU idle | "
        "cores > 50% busy (all) | driver s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for envs in args.envs or [None]:
        for mode in args.modes:
            mode_cfg = compose_overrides(overrides, mode)
            mode_cfg.policy.execute = costs.execute
            t0 = time.perf_counter()
            predicted = predict(mode_cfg, costs, args.iterations, envs, args.cores)
            predicted["driver_s"] = time.perf_counter() - t0
            busy = (
                f"{predicted['cpu_share']['simulate']:.0%} | {predicted['busy']['generate']:.0%} / "
                f"{predicted['busy']['train']:.0%}"
            )
            sm = " / ".join(f"{v:.0%}" for v in predicted["gpu_sm_busy"].values())
            hot = sum(b > 0.5 for b in predicted["core_busy"]) * predicted["ranks"]
            print(
                f"| {mode} | {predicted['envs']} | {predicted['cores']} | {predicted['node_env_steps_per_s']:.1f} | "
                f"{busy} | {sm} | {predicted['gpu_idle']:.0%} | {hot} of {predicted['cores'] * predicted['ranks']} "
                f"| {predicted['driver_s']:.1f} |",
                flush=True,
            )
            for line in predicted["decisions"]:  # (the allocator's plan: calibrated, then any re-plan)
                print(f"  {mode} at {predicted['envs']} envs: {line}")
            rows.append({"mode": mode, LABEL: predicted})
    capacity = gpu_capacity(costs, rows, cfg)
    print(capacity["line"])
    capacity["memory"] = memory_line
    print(capacity["memory"])
    return {"costs": costs.sources, "rows": rows, "capacity": capacity}


def gpu_capacity(costs: ModelledCosts, rows: list[dict], cfg: Any) -> dict[str, Any]:
    """What bounds a rank: its GPU's kernels per env step (generation at the largest batch predicted, one
    iteration's update without a proximal pass (its rows' forward passes add to it); the SM-seconds, whatever
    the shares) against the simulators' (the mean step over the rank's cores). One process issuing the same kernels
    one after another (the host's time per operation counted) is slower: generation and training side by side under
    MPS overlap their hosts' gaps."""
    envs = max(r[LABEL]["envs"] for r in rows)
    cores = rows[0][LABEL]["cores"]
    shape = RolloutShape.of(cfg, envs=envs, max_episode_steps=costs.max_episode_steps, execute=costs.execute)
    chunks = shape.chunks  # (a sample per chunk step; values once an iteration, for the bootstrap)
    decisions = shape.rows
    calls = {
        "generate": [costs.on_gpu("sample", envs, 1.0)] * chunks + [costs.on_gpu("value", envs, 1.0)],
        "train": [costs.on_gpu("train", decisions, 1.0)],
    }
    per = {"generate": decisions * costs.execute, "train": decisions * costs.execute}
    kernels = {stage: sum(c.seconds * c.sm_busy for c in cs) / per[stage] for stage, cs in calls.items()}
    serial = {stage: sum(c.seconds for c in cs) / per[stage] for stage, cs in calls.items()}
    gpu_rate, serial_rate = 1 / sum(kernels.values()), 1 / sum(serial.values())
    need = costs.sim_mean_s * gpu_rate
    sim_rate = cores / costs.sim_mean_s
    best = max(rows, key=lambda r: r[LABEL]["env_steps_per_s"])
    bound = "the GPU" if gpu_rate < sim_rate else f"the simulators ({cores} cores)"
    rate = best[LABEL]["env_steps_per_s"]
    # the fewest envs per rank whose best schedule comes within 5% of the best prediction
    enough = min(r[LABEL]["envs"] for r in rows if r[LABEL]["env_steps_per_s"] >= 0.95 * rate)
    line = (
        f"capacity ({LABEL}): per env step a GPU's kernels take {1e3 * kernels['generate']:.2f} ms to generate "
        f"(batch {envs}) and {1e3 * kernels['train']:.2f} ms to train ({1e3 * serial['generate']:.2f} and "
        f"{1e3 * serial['train']:.2f} ms issued one after another): at most {gpu_rate:.1f} env steps/s per GPU "
        f"({serial_rate:.1f} serially), which {need:.1f} cores simulate at {1e3 * costs.sim_mean_s:.3g} ms a step; "
        f"with {cores} cores per GPU ({sim_rate:.1f} env steps/s) {bound} bounds a rank. Best predicted: "
        f"{best['mode']} at {best[LABEL]['envs']} envs per rank, {rate:.1f} env steps/s per rank "
        f"({rate / min(gpu_rate, sim_rate):.0%} of that bound); from {enough} envs per rank within 5% of it"
    )
    return {
        "gpu_s_per_env_step": kernels,
        "serial_s_per_env_step": serial,
        "gpu_rate": gpu_rate,
        "cores_needed": need,
        "sim_rate": sim_rate,
        "envs_enough": enough,
        "line": line,
    }


def gpu_memory(cfg: Any, envs: int, cameras: int) -> tuple[str, str]:
    """How the ranks' trainers hold the training state (distributed.strategy, settled as a run settles it:
    `fitting_strategy`) and the memory model's line for one GPU of a pipelined run at `envs` envs per rank
    (ebrl/alloc/memory.py): what it holds, or the line a run would stop with."""
    from omegaconf import OmegaConf

    from ebrl.alloc.memory import GiB, MemoryModel, fitting_strategy
    from ebrl.bench.memory import env_spec
    from ebrl.config import ConfigError

    spec = env_spec(cameras, action_dim=ACTION_DIMS.get(cfg.env.name, 7))
    model = MemoryModel.of(
        OmegaConf.to_container(cfg.policy, resolve=True),
        spec,
        cfg.algo.optimizer_dtype,
        cache_prefix=cfg.algo.cache_prefix,
    )
    ranks = int(cfg.hw.gpus) * int(cfg.hw.get("nodes") or 1)
    shape = RolloutShape.of(cfg, ranks, int(cfg.env.max_episode_steps), model.execute, envs=envs)
    chunks, micro = shape.chunks, shape.micro_rows  # (micro-batches of the trainer's size)
    have = int(cfg.hw.gpu_memory_gb * GiB)
    try:
        strategy, _ = fitting_strategy(
            model,
            have,
            envs,
            micro,
            chunks,
            False,
            f"hw={cfg.hw.name}",
            ranks,
            cfg.distributed.strategy,
            trainer_process=True,
        )
    except ConfigError as e:
        return cfg.distributed.strategy, f"memory (predicted): {e}"
    need = model.gpu(micro, envs, chunks, rendering=False, shards=ranks if strategy == "fsdp" else 1)
    held = "its training state sharded over the ranks (FSDP)" if strategy == "fsdp" else "a replica per GPU (DDP)"
    try:  # (colocated trains where it generates: nothing to shard)
        fitting_strategy(model, have, envs, micro, chunks, False, f"hw={cfg.hw.name}", ranks, "auto", False)
    except ConfigError:
        held += "; colocated's one process would not fit (its row is for comparison)"
    return strategy, (
        f"memory (predicted, ebrl/alloc/memory.py): {need.total / GiB:.1f} of {have / GiB:.0f} GiB per "
        f"GPU at {envs} envs per rank, micro-batch {micro}, {held} (trainer "
        f"{sum(v for k, v in need.parts.items() if k.startswith('trainer')) / GiB:.1f}, generation "
        f"{sum(v for k, v in need.parts.items() if k.startswith('generation')) / GiB:.1f}); it fits"
    )


def measured_now(cfg: Any) -> MeasuredCosts:
    """`measure_costs`, and a line saying what it found."""
    t0 = time.perf_counter()
    costs = measure_costs(cfg)
    print(
        f"costs {costs.source} in {time.perf_counter() - t0:.0f} s: sim step mean "
        f"{1e3 * np.mean([np.mean(s) for s in costs.steps]):.2f} ms (per env "
        f"{', '.join(f'{1e3 * np.mean(s):.1f}' for s in costs.steps)}), generate {1e3 * costs.generate(1):.2f} + "
        f"{1e3 * costs.generate_fit[1]:.3f} x batch ms, value {1e3 * costs.value(1):.2f} + "
        f"{1e3 * costs.value_fit[1]:.3f} x batch ms, train {1e3 * costs.train_per_row:.3f} ms per decision "
        f"({1e3 * costs.train_decoupled_per_row:.3f} decoupled), "
        f"efficiency {costs.efficiencies}, time-slicing +{costs.timeslice:.1%} CPU, "
        f"reset {1e3 * costs.reset_s:.1f} ms",
        flush=True,
    )
    return costs


def run_here(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler benchmark's workload: costs measured here (or read back), every mode predicted, and with
    --validate run for real beside."""
    from ebrl.bench.schedulers import Workload, compose, round_order, run_mode
    from ebrl.policies.build import settle_execute

    workload = Workload(
        preset=args.policy_preset,
        task=args.task,
        num_envs=args.num_envs,
        iterations=args.iterations,
        overrides=list(args.overrides),
        stragglers=args.stragglers,
        straggler_task=args.straggler_task,
        straggler_slowdown=args.straggler_slowdown,
    )
    cfg = compose(workload)
    settle_execute(cfg)  # (the actions of each chunk a run executes, as a run settles them)
    # with --validate, each round measures the costs again right before its runs (this machine's speed varies
    # through a day: a prediction is checked against runs made minutes after its own costs), and a prediction is the
    # median of the rounds'
    rounds: list[MeasuredCosts] = []
    measured: dict[str, list[float]] = {mode: [] for mode in args.modes}
    busy_measured: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for r in range(max(1, args.repeats if args.validate else 1)):
        if not (args.costs and rounds):
            rounds.append(read_costs(args.costs) if args.costs else measured_now(cfg))
        for mode in round_order(args.modes, r) if args.validate else []:
            rate, _, real_busy = run_mode(compose(workload, mode))
            measured[mode].append(rate)
            busy_measured[mode].append(real_busy)
    costs = rounds[0]
    if args.save_costs:
        Path(args.save_costs).write_text(json.dumps(asdict(costs)))
    rows = []
    print(
        f"| mode | envs | {LABEL} env steps/s | "
        + ("measured (runs) | predicted / measured | " if args.validate else "")
        + "busy sim / gen / train | CPU share sim / gen / train | driver s (model s) | runtime code us per env step, "
        "events/s |"
    )
    print("|---|---|---|" + ("---|---|" if args.validate else "") + "---|---|---|---|")
    for envs, mode in [(e, m) for e in args.envs or [None] for m in args.modes]:
        mode_cfg = compose(workload, mode)
        t0 = time.perf_counter()
        per_round = [predict(mode_cfg, c, args.iterations, envs, args.cores) for c in rounds]
        predicted = sorted(per_round, key=lambda p: p["env_steps_per_s"])[(len(per_round) - 1) // 2]
        predicted["driver_s"] = (time.perf_counter() - t0) / len(rounds)
        predicted["rounds"] = [p["env_steps_per_s"] for p in per_round]
        predicted["env_steps_per_s"] = float(np.median(predicted["rounds"]))
        row = {"mode": mode, LABEL: predicted}
        real_cell, busy = "", " / ".join(f"{v:.0%}" for v in predicted["busy"].values())
        if measured[mode]:
            real = float(np.median(measured[mode]))
            row["measured"], row["measured_runs"] = real, measured[mode]
            real_cell = (
                f"{real:.1f} ({', '.join(f'{x:.1f}' for x in measured[mode])}) | "
                f"{predicted['env_steps_per_s'] / real:.2f} | "
            )
            busy += (
                " (measured "
                + " / ".join(
                    f"{np.median([b.get(f'busy_{s}', math.nan) for b in busy_measured[mode]]):.0%}"
                    for s in ("simulate", "generate", "train")
                )
                + ")"
            )
        share = " / ".join(f"{v:.0%}" for v in predicted["cpu_share"].values())
        each = f" ({', '.join(f'{x:.1f}' for x in predicted['rounds'])})" if len(rounds) > 1 else ""
        print(
            f"| {mode} | {predicted['envs']} | {predicted['env_steps_per_s']:.1f}{each} | {real_cell}{busy} "
            f"| {share} | {predicted['driver_s']:.1f} ({predicted['model_s']:.1f}) | "
            f"{predicted['runtime_us_per_env_step']:.1f}, {predicted['events_per_s']:,.0f} |",
            flush=True,
        )
        rows.append(row)
    return {"costs": costs.source, "rows": rows}


if __name__ == "__main__":
    main()
