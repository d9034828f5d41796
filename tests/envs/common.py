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
    proc = subprocess.run([str(python), "-c", code], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
