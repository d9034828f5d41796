"""LIBERO for real, in its own interpreter (built by `python -m ebrl.envs.setup libero`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ebrl.envs.base import EnvSetupError
from ebrl.envs.libero_env import LiberoEnv
from ebrl.envs.setup import SETUP_COMMAND, benchmark_python
from tests.envs.common import run_in_interpreter

REPO = Path(__file__).resolve().parents[2]
PYTHON = benchmark_python("libero")
needs_venv = pytest.mark.skipif(PYTHON is None, reason=f"no LIBERO venv: run `{SETUP_COMMAND.format(name='libero')}`")

# Runs under the venv's interpreter; prints one JSON line of findings as its last line.
PRELUDE = """
import json, sys
import numpy as np
from ebrl.envs.base import EnvSetupError
from ebrl.envs.libero_env import LiberoEnv
from tests.envs.common import assert_matches_spec, random_chunk
"""


def run_in_venv(code: str, timeout: float = 240) -> dict:
    return run_in_interpreter(PYTHON, PRELUDE + code, timeout)


@needs_venv
def test_task_resets_and_steps():
    out = run_in_venv("""
env = LiberoEnv(task="0", suite="libero_spatial", max_episode_steps=50, seed=0)
a = env.reset(seed=7); b = env.reset(seed=7); c = env.reset(seed=8)
assert_matches_spec(env, a)
obs, result = env.run_chunk(random_chunk(5, env.spec.action_dim))
assert_matches_spec(env, obs)
print(json.dumps({"same": bool(np.array_equal(a["state"], b["state"])),
                  "other": bool(not np.array_equal(a["state"], c["state"])),
                  "executed": result.executed, "successes": result.successes.tolist(),
                  "instruction": env.spec.instruction, "language": env.task.language, "name": env.task.name,
                  "action_dim": env.spec.action_dim, "state_dim": env.spec.obs["state"].shape[0]}))
""")
    assert out["same"] and out["other"]
    assert out["executed"] == 5 and out["successes"] == [False] * 5
    assert (
        out["instruction"]
        == out["language"]
        == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    )
    assert out["name"].startswith("pick_up_the_black_bowl")
    assert out["action_dim"] == 7 and out["state_dim"] > 8  # proprio (8) + object state


@needs_venv
def test_camera_image():
    out = run_in_venv("""
env = LiberoEnv(task="0", suite="libero_spatial", cameras=["agentview"], image_size=64, seed=0)
obs = env.reset(seed=0)
assert_matches_spec(env, obs)
image = obs["image/agentview"]
print(json.dumps({"shape": list(image.shape), "dtype": str(image.dtype), "std": float(image.std())}))
""")
    assert out["shape"] == [64, 64, 3] and out["dtype"] == "uint8"
    assert out["std"] > 10  # a rendered scene, not a blank frame


@needs_venv
def test_unknown_task_and_suite_say_what_exists():
    out = run_in_venv("""
found = {}
for kw in ({"task": "99"}, {"task": "no_such_task"}, {"suite": "libero_nope"}):
    try:
        LiberoEnv(**kw)
    except EnvSetupError as e:
        found[list(kw.values())[0]] = str(e)
print(json.dumps(found))
""")
    assert set(out) == {"99", "no_such_task", "libero_nope"}
    for message in out.values():
        assert "\n" not in message
    assert "0: pick_up_the_black_bowl" in out["99"]
    assert "libero_spatial, libero_object, libero_goal, libero_10" in out["libero_nope"]


def test_main_interpreter_says_run_setup():
    """The main interpreter has robosuite 1.5.2 and no LIBERO: one line naming the setup command."""
    code = (
        "from ebrl.envs.libero_env import LiberoEnv\n"
        "from ebrl.envs.base import EnvSetupError\n"
        "try:\n    LiberoEnv(task='0')\nexcept EnvSetupError as e:\n    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and not lines:
        pytest.skip("this interpreter has LIBERO installed")
    assert len(lines) == 1
    assert lines[0].startswith("env=libero needs its own interpreter: run `python -m ebrl.envs.setup libero`")


def test_bad_reward_is_one_line():
    with pytest.raises(EnvSetupError, match="env.reward='shaped'"):
        LiberoEnv(reward="shaped")


@needs_venv
def test_libero_and_robosuite_15_workers_side_by_side():
    """Two simulator stacks that cannot share an interpreter, in one process tree, through shared memory."""
    from ebrl.envs.worker import SimWorkerPool
    from tests.envs.test_worker import LIFT

    libero_cfg = dict(
        _target_="ebrl.envs.libero_env.LiberoEnv",
        name="libero",
        task="0",
        suite="libero_spatial",
        num_envs=1,
        max_episode_steps=20,
        cameras=[],
        image_size=64,
        reward="dense",
        terminate_on_success=True,
        python=None,
    )
    with (
        SimWorkerPool(libero_cfg, num_envs=1, seed=0, execute=4) as libero,
        SimWorkerPool(LIFT, num_envs=1, seed=0, execute=4) as robosuite,
    ):
        for pool, python in ((libero, str(PYTHON)), (robosuite, sys.executable)):
            with open(f"/proc/{pool.workers[0].pid}/cmdline", "rb") as f:
                assert f.read().split(b"\0")[0].decode() == python
            pool.reset_all()
            pool.submit_all(4, np.zeros((1, 4, 7), np.float32))
        reports = [libero.wait_all()[0], robosuite.wait_all()[0]]
        assert [r.executed for r in reports] == [4, 4]
        assert libero.spec.instruction.startswith("pick up the black bowl")
        assert robosuite.spec.instruction == "lift the red cube"


@needs_venv
def test_cameras_render_at_the_chunk_boundary_as_at_every_step():
    """LIBERO's robosuite 1.4 gets the same gate as 1.5 (tests/envs/test_render_gate.py): the frames read at the
    boundaries are those of rendering every step, bit for bit, from a frame per chunk and per reset."""
    out = run_in_venv("""
from tests.envs.common import CHUNKS, assert_same, read_over_chunks
make = lambda: LiberoEnv(task="0", suite="libero_spatial", max_episode_steps=12, cameras=["agentview"],
                         image_size=48, seed=0)
every, gated = make(), make()
before = every.gate.frames, gated.gate.frames
want, n_every = read_over_chunks(every, every_step=True)
got, n_gated = read_over_chunks(gated, every_step=False)
assert_same(want, got)
print(json.dumps({"every": n_every - before[0], "gated": n_gated - before[1], "chunks": len(CHUNKS)}))
""")
    # gated, a reset renders its last settling step only; every step renders 16 steps and each reset's own frames
    assert out["gated"] == out["chunks"] + 2 and out["every"] > 16 + 2 * 10, out
