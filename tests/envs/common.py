"""Checks shared by the adapter tests."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def assert_matches_spec(env, obs):
    assert set(obs) == set(env.spec.obs)
    for key, array_spec in env.spec.obs.items():
        assert obs[key].shape == array_spec.shape, key
        assert obs[key].dtype == np.dtype(array_spec.dtype), key


def random_chunk(n, dim, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (n, dim)).astype(np.float32)


def run_in_interpreter(python, code: str, timeout: float = 240) -> dict:
    """Run `code` under another interpreter (a benchmark's venv) with this repo importable and stdin
    closed; it prints one JSON line of findings last, which is returned."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LIBERO_CONFIG_PATH", None)
    proc = subprocess.run(
        [str(python), "-c", code],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- rendering at the chunk boundary against rendering at every step (test_render_gate, test_libero) ---
CHUNKS = (5, 5, 5, 4)  # with a step limit of 12 the third chunk ends the episode at its second step


def read_over_chunks(env, every_step: bool, seed: int = 3) -> tuple[list, int]:
    """What a policy reads over CHUNKS, and the frames rendered for it."""
    env.render_every_step = every_step
    read = [env.begin_episode(seed=seed)]
    for k, n in enumerate(CHUNKS):
        obs, result = env.run_chunk(random_chunk(n, env.spec.action_dim, seed=k))
        read += [obs, result.rewards, result.successes, result.terminated, result.truncated]
        if result.final_obs is not None:
            read.append(result.final_obs)
    return read, frames(env)


def frames(env) -> int:
    return env.gate.frames if hasattr(env, "gate") else env.frames


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for key in x:
                assert np.array_equal(x[key], y[key]), key
        else:
            assert np.array_equal(x, y)


# --- the fast control step against the stock one (test_fast_step, in each benchmark's interpreter) ---
def trajectory(env, sim, steps: int, seeds=(5, 6), scale: float = 1.0) -> list:
    """What a run reads at every control step over two episodes (the second from a reset), and the sim's state:
    MuJoCo's qpos, qvel and ctrl, or `sim()`'s arrays (or dicts of them). Actions uniform in +-scale."""
    state = sim if callable(sim) else lambda: (sim.data.qpos, sim.data.qvel, sim.data.ctrl)
    out = []
    for seed in seeds:
        out.append(env.begin_episode(seed))
        actions = np.random.default_rng(seed).uniform(-scale, scale, (steps, env.spec.action_dim))
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(action)
            out.append(
                (
                    obs,
                    reward,
                    terminated,
                    truncated,
                    info["success"],
                    *({k: np.array(v) for k, v in x.items()} if isinstance(x, dict) else np.array(x) for x in state()),
                )
            )
    return out


def assert_identical(fast: list, stock: list) -> None:
    """Bit for bit, step by step (observation dicts key by key)."""
    assert len(fast) == len(stock)
    for step, (a, b) in enumerate(zip(fast, stock)):
        if isinstance(a, dict):
            a, b = (a,), (b,)
        for x, y in zip(a, b):
            if isinstance(x, dict):
                assert x.keys() == y.keys()
                for key in x:
                    assert np.array_equal(x[key], y[key]), (step, key, np.abs(x[key] - y[key]).max())
            else:
                assert np.array_equal(x, y), (step, x, y)


def robosuite_state(env) -> callable:
    """`trajectory`'s state for a robosuite 1.5 env: MuJoCo's qpos, qvel and ctrl, then every array the robot's
    proprioception buffers and its part controllers hold (what the stock step leaves besides the physics), by name."""
    sim, robot = env.sim, env.robots[0]

    def arrays(owner, prefix):
        return {f"{prefix}.{name}": value for name, value in vars(owner).items() if isinstance(value, np.ndarray)}

    def state():
        out = {"qpos": sim.data.qpos, "qvel": sim.data.qvel, "ctrl": sim.data.ctrl}
        for name, value in vars(robot).items():
            buffers = value if isinstance(value, dict) else {"": value}
            for part, buffer in buffers.items():
                if name.startswith("recent_") and hasattr(buffer, "push"):
                    out.update(arrays(buffer, f"{name}{part}"))
        for part, controller in robot.composite_controller.part_controllers.items():
            out.update(arrays(controller, part))
        return (dict(sorted(out.items())),)

    return state
