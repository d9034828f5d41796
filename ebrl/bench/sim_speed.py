"""What a simulator's control step costs a run, part by part, against the physics inside it.
`python -m ebrl.bench.sim_speed`.

The step is timed on the path a run takes: the adapter's `run_chunk` over chunks of the run's `policy.execute`
actions (the composed config's, or the policy's whole chunk), the observation the policy reads at each chunk's end,
rewards and success at every step, and the resets at the env's episode length (`env.max_episode_steps`), all inside
the timing. Per task: that step with the stock simulator's code and with the fast step (`env.fast_step`,
ebrl/envs/fast_step.py and maniskill_fast.py; where it does not cover the task, the reason), the physics of a step,
their ratios, and each part's share of the step (ebrl/bench/sim_parts.py: controller, physics, observables, reward
and success, reset, the rest; the robosuite family). Then the same chunks through one simulator process as a run
runs it (SimWorker: the pipe, the shared-memory slot), as that process's CPU ms per env step, the process's CPU
outside the adapter's run_chunk being the plumbing's share; and through the run's `env.num_envs` processes at once,
sharing the machine's cores as a run's simulators do (several on a core evict each other's caches): what the run's
summary reports as "simulation, CPU per env step" (perf/sim_cpu_s). The physics: for the robosuite family the same
number of raw `mj_step` calls on the same model and data (x the substeps of a control step); for ManiSkill SAPIEN's
`px.step` calls timed inside the stock steps, since PhysX puts bodies at rest to sleep (a raw loop after an episode
costs 4 us a step, a moving scene 40-50 us). Each benchmark runs under its own interpreter (LIBERO's and RoboCasa's
venvs): this module's measuring half imports numpy and the simulator only.

    python -m ebrl.bench.sim_speed [--benchmarks robosuite libero maniskill] [--tasks Lift ...] [--steps 400]
                                   [--repeats 3] [overrides ...]

Overrides are the run's (`policy.execute=4`, `env.max_episode_steps=100`); they apply to every task. Actions are
uniform in half the action range from a seeded generator (the arm moves as a policy's would; zeros keep it still and
cost the physics less). Times are CPU time, the median over `--repeats` passes of `--steps` env steps, one process per
task, one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import numpy as np

from ebrl.envs.base import EnvSetupError, one_line

# (benchmark, task, extra env keys): the tasks
TASKS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "robosuite": [(t, {}) for t in ("Lift", "Stack", "NutAssemblySquare", "Door", "PickPlaceCan")],
    "libero": [("0", {"suite": "libero_spatial"}), ("5", {"suite": "libero_spatial"}), ("0", {"suite": "libero_10"})],
    "maniskill": [(t, {}) for t in ("PushCube-v1", "PickCube-v1")],
}
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# --- the measuring half: this benchmark's interpreter, numpy and the simulator only ---------------------------------
def raw_physics(name: str, adapter: Any) -> tuple[Callable[[], None], int]:
    """One raw physics step of a robosuite-family adapter's MuJoCo model and data, and how many make a control step."""
    env = adapter.env.env if name == "libero" else adapter.env  # (LIBERO's ControlEnv wraps robosuite's env)
    import mujoco

    model, data = env.sim.model._model, env.sim.data._data
    return (lambda: mujoco.mj_step(model, data)), int(round(env.control_timestep / env.model_timestep))


def measure(name: str, env_cfg: dict[str, Any], execute: int, steps: int, repeats: int, seed: int = 0) -> dict:
    """The run's path (see the module docstring) with the stock code and with the fast step (env.fast_step): CPU ms
    per env step (this thread's), resets included; each part's share of it from a second pass with the parts timed
    (`Parts`; the robosuite family); the physics of one step (`raw_physics`; ManiSkill's timed inside the stock
    steps). Medians over repeats, the two ways' passes alternating over the same episodes and actions."""
    from ebrl.bench.sim_parts import PARTS, Parts
    from ebrl.envs.process import build_adapter

    adapters = {way: build_adapter({**env_cfg, "fast_step": way == "fast"}, seed) for way in ("stock", "fast")}
    spec = adapters["stock"].spec
    span = (spec.action_high - spec.action_low) / 2
    chunks = actions_for(spec.action_dim, span, max(1, steps // execute), execute, seed)

    def drive(
        adapter: Any, episode_seed: int, clock: Callable[[], float], parts: Parts | None = None
    ) -> tuple[float, int]:
        """Seconds on `clock` to run every chunk from a fresh episode, and the steps; with `parts`, each part's
        time in that stretch too."""
        adapter.begin_episode(episode_seed)
        if parts is not None:
            parts.install(name, adapter)
        try:
            executed, t0 = 0, clock()
            for chunk in chunks:
                executed += adapter.run_chunk(chunk)[1].executed
            return clock() - t0, executed
        finally:
            if parts is not None:
                parts.remove()

    step_ms: dict[str, list[float]] = {"stock": [], "fast": []}
    shares: dict[str, list[dict[str, float]]] = {"stock": [], "fast": []}
    physics_ms: list[float] = []
    inside = _time_physics_inside(adapters["stock"]) if name == "maniskill" else None
    for r in range(repeats):
        for way, adapter in adapters.items():
            elapsed, executed = drive(adapter, seed * 1000 + 100 * r, time.thread_time)
            step_ms[way].append(1e3 * elapsed / executed)
            if inside is None:
                timer = Parts()
                elapsed = drive(adapter, seed * 1000 + 100 * r + 50, time.perf_counter, timer)[0]
                shares[way].append(timer.shares(elapsed))
        if inside is not None:
            substeps = int(adapters["stock"].env.unwrapped._sim_steps_per_control)  # noqa: SLF001
            physics_ms.append(1e3 * inside[0] / executed)
            inside[0] = 0.0
            continue
        physics, substeps = raw_physics(name, adapters["stock"])
        t0 = time.thread_time()
        for _ in range(steps * substeps):
            physics()
        physics_ms.append(1e3 * (time.thread_time() - t0) / steps)
    fast_off = getattr(adapters["fast"], "fast_step_off", "the adapter has no fast step")
    for adapter in adapters.values():
        adapter.close()
    step = {way: statistics.median(ms) for way, ms in step_ms.items()}
    parts = {}
    for way, passes in shares.items():
        if passes:  # each part's median share of the step; the rest is what the parts' medians leave
            parts[way] = {part: step[way] * statistics.median(p[part] for p in passes) for part in PARTS[:-1]}
            parts[way][PARTS[-1]] = step[way] - sum(parts[way].values())
    return {
        "step_ms": step["stock"],
        "fast_ms": step["fast"],
        "fast_off": fast_off,
        "physics_ms": statistics.median(physics_ms),
        "substeps": substeps,
        "parts": parts,
    }


def actions_for(action_dim: int, span: float, chunks: int, execute: int, seed: int) -> np.ndarray:
    """(chunks, execute, action_dim) actions uniform in half the action range, the same for every measurement."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(-0.5, 0.5, (chunks, execute, action_dim)) * 2 * span).astype(np.float32)


def _time_physics_inside(adapter: Any) -> list[float]:
    """Time ManiSkill's `px.step` calls inside the adapter's control steps (its scene's `step`, wrapped): the list
    holds the seconds spent since it was last cleared."""
    scene = adapter.env.unwrapped.scene
    px, spent = scene.px, [0.0]

    def step() -> None:
        t0 = time.perf_counter()
        px.step()
        spent[0] += time.perf_counter() - t0

    scene.step = step
    return spent


# --- the driver: composes each benchmark's config and runs the measuring half under its interpreter ----------------
def run_config(benchmark: str, task: str, extra: dict[str, Any], overrides: Sequence[str]) -> tuple[dict, dict]:
    """The resolved env and policy configs `python run.py env=<benchmark> env.task=<task> <overrides>` composes, state
    observations, with `policy.execute` settled as a run settles it (None: the policy's whole chunk)."""
    from omegaconf import OmegaConf

    from ebrl.bench.schedulers import compose_overrides
    from ebrl.policies.build import settle_execute

    cfg = compose_overrides(
        [
            f"env={benchmark}",
            f"env.task={task}",
            "env.cameras=[]",
            *(f"env.{k}={v}" for k, v in extra.items()),
            *overrides,
        ]
    )
    settle_execute(cfg)
    return OmegaConf.to_container(cfg.env, resolve=True), OmegaConf.to_container(cfg.policy, resolve=True)


def execute_of(policy_cfg: dict[str, Any], spec: Any) -> int:
    """The actions a run executes of each chunk: policy.execute, else the policy's chunk (built on the meta
    device, as the run's policy is for this env)."""
    if policy_cfg.get("execute") is not None:
        return int(policy_cfg["execute"])
    from ebrl.policies.build import build_policy

    return int(build_policy(policy_cfg, spec, "meta").execute)


def through_processes(
    env_cfg: dict[str, Any], policy_cfg: dict[str, Any], steps: int, repeats: int, n: int = 1, seed: int = 0
) -> tuple[int, float, float]:
    """The run's chunks through `n` simulator processes at once (SimWorker, one thread each), as a run's simulate
    stage drives them: each chunk's actions written to every shared-memory slot, sent down every pipe, the replies
    and the obs read back. Returns the chunk's executed actions, the processes' CPU ms per env step, and the share of
    it outside the adapter's run_chunk (the pipe, the slot, the worker's loop; medians over repeats). With `n` the
    run's `env.num_envs`, the processes share the machine's cores as the run's simulators do."""
    from ebrl.envs.worker import SimWorker, process_cpu_seconds

    workers = [SimWorker(env_cfg, seed + i, process_env=ONE_THREAD) for i in range(n)]
    try:
        for worker in workers:
            worker.start(wait=False)
        spec = [worker.receive_spec() for worker in workers][0]
        execute = execute_of(policy_cfg, spec)
        for worker in workers:
            worker.attach(execute)
        chunks = actions_for(
            spec.action_dim, (spec.action_high - spec.action_low) / 2, max(1, steps // execute), execute, seed
        )
        cpu_ms, outside = [], []
        for r in range(repeats):
            for i, worker in enumerate(workers):
                worker.reset(seed * 1000 + 100 * r + i)
            executed, inside = 0, 0.0
            cpu = sum(process_cpu_seconds(worker.pid) for worker in workers)
            for chunk in chunks:
                for worker in workers:
                    worker.actions[:execute] = chunk
                    worker.submit(execute)
                for worker in workers:
                    report = worker.wait()
                    executed, inside = executed + report.executed, inside + report.cpu_s
            cpu = sum(process_cpu_seconds(worker.pid) for worker in workers) - cpu
            cpu_ms.append(1e3 * cpu / executed)
            outside.append(1 - inside / cpu)
    finally:
        for worker in workers:
            worker.close()
    return execute, statistics.median(cpu_ms), statistics.median(outside)


def run_task(benchmark: str, env_cfg: dict[str, Any], execute: int, args: argparse.Namespace) -> dict:
    """`measure` in a process of the benchmark's interpreter, one thread; its figures."""
    from ebrl.envs.setup import worker_python
    from ebrl.envs.worker import REPO_ROOT

    job = json.dumps(
        {"name": benchmark, "env": env_cfg, "execute": execute, "steps": args.steps, "repeats": args.repeats}
    )
    env = {
        **os.environ,
        **ONE_THREAD,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [worker_python(benchmark, env_cfg.get("python")), "-m", "ebrl.bench.sim_speed", "--job", job],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"{benchmark} {env_cfg['task']}: {lines[-1] if lines else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def label(benchmark: str, env_cfg: dict[str, Any]) -> str:
    return f"{env_cfg['suite']} {env_cfg['task']}" if benchmark == "libero" else env_cfg["task"]


def share(ms: float, total: float) -> str:
    return f"{ms:.2f} ({ms / total:.0%})"


def print_parts(rows: list[dict]) -> None:
    """Each part's ms per env step and share of the in-process step; then the process's CPU ms and the plumbing."""
    from ebrl.bench.sim_parts import PARTS

    print(
        f"\nWhere the step goes, ms per env step (share of the in-process step), the way the run steps "
        f"(env.fast_step); the process: one simulator process's CPU ms per env step, the same chunks, and its CPU "
        f"outside run_chunk (share of the process's)"
    )
    print(f"| benchmark | task | way | {' | '.join(PARTS)} | in-process step | the process | pipes and shared memory |")
    print("|---|---|---|" + "---|" * (len(PARTS) + 3))
    for r in rows:
        for way in ("stock", "fast"):
            parts = r["parts"].get(way)
            if not parts:
                continue
            total = r["fast_ms" if way == "fast" else "step_ms"]
            process = r["process_ms"] if way == r["run_way"] else None
            tail = f"{process:.2f} | {share(process * r['plumbing'], process)}" if process is not None else "- | -"
            print(
                f"| {r['benchmark']} | {r['task']} | {way} | {' | '.join(share(parts[p], total) for p in PARTS)} | "
                f"{total:.2f} | {tail} |",
                flush=True,
            )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmarks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--tasks", nargs="+", default=None, help="only these tasks (names or LIBERO indices)")
    parser.add_argument("--steps", type=int, default=400, help="env steps per pass")
    parser.add_argument("--repeats", type=int, default=3, help="passes per task (the median is reported)")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # the measuring half, under the benchmark's interpreter
    parser.add_argument("overrides", nargs="*", help="the run's Hydra overrides (policy.execute=4 ...)")
    args = parser.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(measure(job["name"], job["env"], job["execute"], job["steps"], job["repeats"])))
        return []
    from ebrl.runtime.errors import exit_cleanly

    rows = []
    print(
        f"{args.steps} env steps x {args.repeats} passes per task as a run takes them (run_chunk, resets "
        "included), one thread, state observations (ms per env step; the median pass)"
    )
    print(
        "| benchmark | task | execute | stock step | fast step | physics (substeps) | stock / physics "
        "| fast / physics | speed-up | the process (CPU) | the run's processes at once (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with exit_cleanly("the benchmark sim_speed"):
        for benchmark in args.benchmarks:
            for task, extra in TASKS[benchmark]:
                if args.tasks and task not in args.tasks:
                    continue
                env_cfg, policy_cfg = run_config(benchmark, task, extra, args.overrides)
                name = label(benchmark, env_cfg)
                try:
                    execute, process_ms, plumbing = through_processes(env_cfg, policy_cfg, args.steps, args.repeats)
                    run_ms = (
                        process_ms
                        if env_cfg["num_envs"] == 1
                        else through_processes(env_cfg, policy_cfg, args.steps, args.repeats, env_cfg["num_envs"])[1]
                    )
                    r = run_task(benchmark, env_cfg, execute, args)
                except (RuntimeError, EnvSetupError) as e:  # (a benchmark not set up: its line, and the others go on)
                    print(f"| {benchmark} | {name} | not measured: {one_line(e)} | | | | | | | | |", flush=True)
                    continue
                r.update(
                    benchmark=benchmark,
                    task=name,
                    execute=execute,
                    process_ms=process_ms,
                    plumbing=plumbing,
                    run_ms=run_ms,
                    num_envs=env_cfg["num_envs"],
                    run_way="fast" if env_cfg.get("fast_step", True) else "stock",
                )
                rows.append(r)
                fast = f"{r['fast_ms']:.2f}" + (f" (stock: {r['fast_off']})" if r["fast_off"] else "")
                physics = r["physics_ms"]
                print(
                    f"| {benchmark} | {name} | {execute} | {r['step_ms']:.2f} | {fast} | {physics:.2f} "
                    f"({r['substeps']}) | {r['step_ms'] / physics:.1f}x | {r['fast_ms'] / physics:.1f}x "
                    f"| {r['step_ms'] / r['fast_ms']:.2f}x | {process_ms:.2f} | {run_ms:.2f} ({r['num_envs']}) |",
                    flush=True,
                )
        print_parts(rows)
    return rows


if __name__ == "__main__":
    main()
