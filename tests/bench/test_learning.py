"""The learning benchmark's arithmetic: success over a moving window of iterations, and the time to a target."""

from __future__ import annotations

import math

import numpy as np

from ebrl.bench.learning import WINDOW, Run


def a_run(successes: list[int], episodes: list[int]) -> Run:
    n = len(successes)
    return Run(
        "ppo",
        "colocated",
        0,
        env_steps=[320.0 * (i + 1) for i in range(n)],
        seconds=[2.0 * (i + 1) for i in range(n)],
        successes=successes,
        episodes=episodes,
        approx_kl=0.0,
        clipfrac=0.0,
        explained_variance=0.0,
        env_steps_per_s=160.0,
    )


def test_success_is_pooled_over_the_windows_episodes_and_the_target_is_its_first_crossing():
    run = a_run([1] * WINDOW + [4] * WINDOW, [10] * WINDOW + [5] * WINDOW)
    moving = run.moving()
    assert np.isnan(moving[: WINDOW - 1]).all() and moving[WINDOW - 1] == 0.1
    assert moving[WINDOW] == (4 * 1 + 4) / (4 * 10 + 5)  # episodes, not iterations, are averaged
    assert moving[-1] == 0.8
    seconds, steps = run.to_target(0.5)
    first = int(np.flatnonzero(moving >= 0.5)[0])
    assert (seconds, steps) == (2.0 * (first + 1), 320.0 * (first + 1))
    assert all(math.isnan(x) for x in run.to_target(0.9))
    rate, low, high = run.rate(0, WINDOW)
    assert rate == 0.1 and low < 0.1 < high


def test_stragglers_slow_whole_grpo_groups_of_the_same_task():
    from ebrl.bench.learning import run_config
    from ebrl.bench.schedulers import compose_overrides
    from ebrl.runs.init import shipped_for

    start = shipped_for(compose_overrides([]))
    plain = run_config("grpo", "ebrl", 0, start, 3, [])
    assert plain.env._target_ != "ebrl.bench.stragglers.StragglerEnv"
    cfg = run_config("grpo", "ebrl", 0, start, 3, ["scheduler.max_ahead=2", "scheduler.max_staleness=1"], (0.5, 4))
    assert cfg.env._target_ == "ebrl.bench.stragglers.StragglerEnv" and cfg.env.inner_target == plain.env._target_
    assert cfg.env.straggler_envs == 8 * 0.5 / 4 and cfg.env.straggler_task is None  # one group of 4, same task
    assert (cfg.env.straggler_slowdown, cfg.scheduler.max_ahead, cfg.scheduler.max_staleness) == (4, 2, 1)
