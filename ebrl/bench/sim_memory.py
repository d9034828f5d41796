"""Memory of one simulator process, with and without what its build leaves behind given back:
`python -m ebrl.bench.sim_memory`.

Each row starts real simulator workers (`SimWorker`, under the benchmark's own interpreter where it has one), resets
them and runs three chunks of 8 zero actions, then reads the worker's unique set size (private pages, MiB) from
`/proc/<pid>/smaps_rollup`. The control keeps the build's leftovers (EBRL_KEEP_BUILD_MEMORY=1: MuJoCo's compile cache
and the heap's free pages, see `ebrl.envs.process.release_build_memory`); both run side by side in one invocation.
The model's own sizes (its buffer, textures, mesh vertices, shadow map) say what the rest is.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ebrl.envs.base import EnvSetupError
from ebrl.envs.process import KEEP_BUILD_MEMORY
from ebrl.envs.worker import SimWorker

CAMERAS = {"robosuite": ("agentview", "robot0_eye_in_hand"), "libero": ("agentview", "robot0_eye_in_hand")}


def env_config(env: str, cameras: int, image_size: int) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from ebrl.bench.memory import compose

    cams = ",".join(CAMERAS[env][:cameras])
    cfg = compose(f"env={env}", f"env.cameras=[{cams}]", f"env.image_size={image_size}")
    return OmegaConf.to_container(cfg.env, resolve=True)


def uss_mib(pid: int) -> float:
    kib = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                kib += int(line.split()[1])
    return kib / 1024


def measure(env_cfg: dict[str, Any], keep: bool) -> float:
    worker = SimWorker(env_cfg, seed=0, execute=8, process_env={KEEP_BUILD_MEMORY: "1"} if keep else None)
    try:
        worker.start()
        worker.reset()
        for _ in range(3):
            worker.submit(8)
            report = worker.wait(120)
            if report.failed:
                raise EnvSetupError(f"the simulator failed a chunk: {report.failed}")
        return uss_mib(worker.pid)
    finally:
        worker.close()


def model_sizes(env_cfg: dict[str, Any]) -> str:
    """The compiled model's sizes, read by `--sizes` in a child under the env's interpreter (state only: no GL)."""
    import subprocess

    from ebrl.envs.worker import REPO_ROOT, worker_python

    python = worker_python(env_cfg.get("name", ""), env_cfg.get("python"))
    out = subprocess.run(
        [python, "-m", "ebrl.bench.sim_memory", "--sizes", json.dumps({**env_cfg, "cameras": []})],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
    )
    try:
        return out.stdout.strip().splitlines()[-1]
    except IndexError:
        return f"? ({out.stderr.strip().splitlines()[-1:]})"


def print_sizes(env_cfg: dict[str, Any]) -> None:
    from ebrl.envs.process import build_adapter

    env = build_adapter(env_cfg, 0).env
    m = (env.sim if hasattr(env, "sim") else env.env.sim).model._model  # LIBERO wraps robosuite's env
    print(
        f"model {m.nbuffer / 2**20:.0f} MiB, textures {m.ntexdata / 2**20:.0f} MiB, {m.nmeshvert / 1000:.0f}k mesh "
        f"vertices, shadow map {m.vis.quality.shadowsize}^2"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["robosuite", "libero"], choices=sorted(CAMERAS))
    parser.add_argument("--cameras", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sizes:
        return print_sizes(json.loads(args.sizes))
    rows = []
    for env in args.envs:
        for cameras in args.cameras:
            cfg = env_config(env, cameras, args.image_size)
            try:
                kept, released = measure(cfg, keep=True), measure(cfg, keep=False)
            except EnvSetupError as e:
                print(f"{env}: skipped ({e})", file=sys.stderr)
                break
            rows.append((env, cameras, kept, released))
            print(
                f"{env:10s} cameras {cameras}: kept {kept:6.0f} MiB  given back {released:6.0f} MiB  "
                f"({1 - released / kept:.0%} less)",
                flush=True,
            )
        if rows and rows[-1][0] == env:
            print(f"{env:10s} {model_sizes(cfg)}", flush=True)
    print("\n| env | cameras | USS kept (MiB) | USS given back (MiB) | less |\n|---|---|---|---|---|")
    for env, cameras, kept, released in rows:
        print(f"| {env} | {cameras} | {kept:.0f} | {released:.0f} | {1 - released / kept:.0%} |")
    print(f"({args.image_size} px cameras)")


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "sim_memory")
