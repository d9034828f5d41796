"""Under the dense (shaped) reward, succeeding is worth more than hovering just short of success: the real simulators'
rewards, driven by the scripted expert, as the run's config builds them (docs/use/environments.md, "Dense reward and
success")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ebrl.envs.experts import make_expert
from ebrl.envs.process import build_adapter
from ebrl.policies.openpi import PRESETS
from ebrl.rl.ppo import compute_gae
from tests.conftest import compose_config


def expert_episode(env: str) -> tuple[list[float], list[bool], bool, int, int, float]:
    """The scripted expert's episode in the adapter `env=<env> env.reward=dense` builds: each step's reward and
    success, whether the episode ended by the task (not its step limit), the step limit, the actions per chunk
    (the default policy's) and the discount per chunk."""
    cfg = compose_config(f"env={env}", "env.reward=dense", "env.num_envs=1")
    adapter = build_adapter(OmegaConf.to_container(cfg.env, resolve=True), seed=0)
    try:
        adapter.begin_episode(seed=0)
        expert = make_expert(cfg.env.name, cfg.env.task, adapter)
        rewards, successes = [], []
        while True:
            _, result = adapter.run_chunk(expert.act()[None])
            rewards.append(float(result.rewards[0]))
            successes.append(bool(result.successes[0]))
            if result.done:
                return (
                    rewards,
                    successes,
                    result.terminated,
                    adapter.spec.max_episode_steps,
                    PRESETS[cfg.policy.preset].chunk,
                    cfg.algo.gamma,
                )
    finally:
        adapter.close()


def discounted_return(rewards: list[float], terminated: bool, chunk: int, gamma: float, bootstrap: bool) -> float:
    """The return of an episode's first chunk step, as GAE takes it (lambda 1, no critic along the way). An episode
    cut off by its step limit is bootstrapped (with `bootstrap`) from the value of staying as its last step was: its
    reward at every step from then on."""
    per_chunk = torch.tensor([sum(rewards[i : i + chunk]) for i in range(0, len(rewards), chunk)]).view(-1, 1)
    T = per_chunk.shape[0]
    done = torch.zeros(T, 1, dtype=torch.bool)
    done[-1] = True
    cutoff = torch.zeros(T, 1)
    if not terminated:
        cutoff[-1] = rewards[-1] * chunk / (1.0 - gamma)
    _, ret = compute_gae(per_chunk, torch.zeros(T, 1), done, torch.zeros(1), gamma, 1.0, cutoff if bootstrap else None)
    return float(ret[0, 0])


@pytest.mark.parametrize("env", ["robosuite", "maniskill"])
def test_succeeding_is_worth_more_than_hovering_short_of_success(env):
    rewards, successes, terminated, limit, chunk, gamma = expert_episode(env)
    first = successes.index(True)  # (the expert succeeds)
    # the same episode, except that instead of succeeding it stays at its best reward short of success to the limit
    hover = rewards[:first] + [max(rewards[:first])] * (limit - first)
    for bootstrap in (False, True):
        succeeded = discounted_return(rewards, terminated, chunk, gamma, bootstrap)
        hovered = discounted_return(hover, False, chunk, gamma, bootstrap)
        assert succeeded >= hovered, (env, bootstrap, succeeded, hovered, np.round(rewards, 3).tolist())
