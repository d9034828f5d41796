"""How far is a simulator's control step from the physics inside it? `python -m ebrl.bench.sim_speed`.

For each task: our adapter's control step with the stock simulator's code and with the fast step (`env.fast_step`,
ebrl/envs/fast_step.py and maniskill_fast.py; where it does not cover the task, the reason), the physics of a control
step, their ratios, and a reset each way. The physics: for the robosuite family the same number of raw `mj_step` calls
on the same model and data (x the substeps of a control step); for ManiSkill SAPIEN's `px.step` calls timed inside the
stock control steps, since PhysX puts bodies at rest to sleep (a raw loop after an episode costs 4 us a step, a moving
scene 40-50 us). Each benchmark runs under its own
interpreter (LIBERO's and RoboCasa's venvs): this module's measuring half imports numpy and the simulator only.

    python -m ebrl.bench.sim_speed [--benchmarks robosuite libero maniskill] [--tasks Lift ...] [--steps 200]
                                   [--repeats 3] [--resets 5]

Actions are uniform in half the action range from a seeded generator (the arm moves as a policy's would; zeros keep
it still and cost the physics less); an episode that ends is reset outside the timing. Times are the median over
`--repeats` passes of `--steps` control steps, one process per task, one thread.
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


def measure(name: str, env_cfg: dict[str, Any], steps: int, repeats: int, resets: int, seed: int = 0) -> dict:
    """The control step of `env_cfg`'s adapter with the stock code and with the fast step (env.fast_step), the
    physics of one (`raw_physics`; ManiSkill's timed inside the stock steps), and a reset, in ms (medians over repeats;
    the two steps' passes alternate)."""
    from ebrl.envs.process import build_adapter

    adapters = {way: build_adapter({**env_cfg, "fast_step": way == "fast"}, seed) for way in ("stock", "fast")}
    spec = adapters["stock"].spec
    rng = np.random.default_rng(seed)
    span = (spec.action_high - spec.action_low) / 2
    actions = (rng.uniform(-0.5, 0.5, (steps, spec.action_dim)) * 2 * span).astype(np.float32)
    step_ms: dict[str, list[float]] = {"stock": [], "fast": []}
    physics_ms: list[float] = []
    reset_ms: dict[str, list[float]] = {"stock": [], "fast": []}
    inside = _time_physics_inside(adapters["stock"]) if name == "maniskill" else None
    for r in range(repeats):
        for way, adapter in adapters.items():  # (the same episodes and actions for both)
            episode = 0
            adapter.begin_episode(seed * 1000 + 100 * r)
            elapsed = 0.0
            for action in actions:
                t0 = time.perf_counter()
                _, _, terminated, truncated, _ = adapter.step(action)
                elapsed += time.perf_counter() - t0
                if terminated or truncated:
                    episode += 1
                    adapter.begin_episode(seed * 1000 + 100 * r + episode)
            step_ms[way].append(1e3 * elapsed / steps)
        if inside is not None:
            substeps = int(adapters["stock"].env.unwrapped._sim_steps_per_control)  # noqa: SLF001
            physics_ms.append(1e3 * inside[0] / steps)
            inside[0] = 0.0
            continue
        physics, substeps = raw_physics(name, adapters["stock"])
        t0 = time.perf_counter()
        for _ in range(steps * substeps):
            physics()
        physics_ms.append(1e3 * (time.perf_counter() - t0) / steps)
    for k in range(resets):
        for way, adapter in adapters.items():
            t0 = time.perf_counter()
            adapter.reset(seed * 1000 + 500 + k)
            reset_ms[way].append(1e3 * (time.perf_counter() - t0))
    fast_off = getattr(adapters["fast"], "fast_step_off", "the adapter has no fast step")
    for adapter in adapters.values():
        adapter.close()
    return {"step_ms": statistics.median(step_ms["stock"]), "fast_ms": statistics.median(step_ms["fast"]),
            "fast_off": fast_off, "physics_ms": statistics.median(physics_ms), "substeps": substeps,
            "reset_ms": statistics.median(reset_ms["stock"]), "fast_reset_ms": statistics.median(reset_ms["fast"])}


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
def env_config(benchmark: str, task: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The resolved env config `python run.py env=<benchmark> env.task=<task>` composes, state observations."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ebrl.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("config", overrides=[f"env={benchmark}", f"env.task={task}", "env.cameras=[]",
                                           *(f"env.{k}={v}" for k, v in extra.items())])
    return OmegaConf.to_container(cfg.env, resolve=True)


def run_task(benchmark: str, env_cfg: dict[str, Any], args: argparse.Namespace) -> dict:
    """`measure` in a process of the benchmark's interpreter, one thread; its figures."""
    from ebrl.envs.setup import worker_python
    from ebrl.envs.worker import REPO_ROOT

    job = json.dumps({"name": benchmark, "env": env_cfg, "steps": args.steps, "repeats": args.repeats,
                      "resets": args.resets})
    env = {**os.environ, **ONE_THREAD,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([worker_python(benchmark, env_cfg.get("python")), "-m", "ebrl.bench.sim_speed", "--job",
                           job], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"{benchmark} {env_cfg['task']}: {lines[-1] if lines else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def label(benchmark: str, env_cfg: dict[str, Any]) -> str:
    return f"{env_cfg['suite']} {env_cfg['task']}" if benchmark == "libero" else env_cfg["task"]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmarks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--tasks", nargs="+", default=None, help="only these tasks (names or LIBERO indices)")
    parser.add_argument("--steps", type=int, default=200, help="control steps per pass")
    parser.add_argument("--repeats", type=int, default=3, help="passes per task (the median is reported)")
    parser.add_argument("--resets", type=int, default=5)
    parser.add_argument("--job", help=argparse.SUPPRESS)  # the measuring half, under the benchmark's interpreter
    args = parser.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(measure(job["name"], job["env"], job["steps"], job["repeats"], job["resets"])))
        return []
    from ebrl.runtime.errors import exit_cleanly

    rows = []
    print(f"{args.steps} control steps x {args.repeats} passes per task, one thread, state observations "
          "(ms; the median pass)")
    print("| benchmark | task | stock step | fast step | physics (substeps) | stock / physics | fast / physics "
          "| speed-up | reset stock / fast |")
    print("|---|---|---|---|---|---|---|---|---|")
    with exit_cleanly("the benchmark sim_speed"):
        for benchmark in args.benchmarks:
            for task, extra in TASKS[benchmark]:
                if args.tasks and task not in args.tasks:
                    continue
                cfg = env_config(benchmark, task, extra)
                try:
                    r = run_task(benchmark, cfg, args)
                except RuntimeError as e:  # (a benchmark not set up: its line, and the others go on)
                    print(f"| {benchmark} | {label(benchmark, cfg)} | not measured: {e} | | | | | | |", flush=True)
                    continue
                rows.append({"benchmark": benchmark, "task": label(benchmark, cfg), **r})
                fast = f"{r['fast_ms']:.2f}" + (f" (stock: {r['fast_off']})" if r["fast_off"] else "")
                physics = r["physics_ms"]
                print(f"| {benchmark} | {label(benchmark, cfg)} | {r['step_ms']:.2f} | {fast} | {physics:.2f} "
                      f"({r['substeps']}) | {r['step_ms'] / physics:.1f}x | {r['fast_ms'] / physics:.1f}x "
                      f"| {r['step_ms'] / r['fast_ms']:.2f}x | {r['reset_ms']:.1f} / {r['fast_reset_ms']:.1f} |",
                      flush=True)
    return rows


if __name__ == "__main__":
    main()
