"""Checks shared by the adapter tests."""
import numpy as np


def assert_matches_spec(env, obs):
    assert set(obs) == set(env.spec.obs)
    for key, array_spec in env.spec.obs.items():
        assert obs[key].shape == array_spec.shape, key
        assert obs[key].dtype == np.dtype(array_spec.dtype), key


def random_chunk(n, dim, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (n, dim)).astype(np.float32)
