"""`python -m ebrl.demos record env=<benchmark> env.task=<task> episodes=N`: a scripted expert's successful episodes
(ebrl/envs/experts.py), written to `<out>/demo.hdf5` in robomimic's layout, or with format=lerobot as the LeRobot
dataset `<out>` (docs/internals/design.md, "Demonstrations, SFT, RL"; docs/use/demos.md).

The simulator is the adapter RL runs (same config, same action space), built in this process because the expert
reads its state. Attempt j resets with seed SEED_BASE + 1000 x `seed` + j, apart from the seeds RL's envs draw, and
the seed is stored with the episode, so the episode replays from it. An episode ends at the task's first success,
or is dropped at env.max_episode_steps; the last `valid` share of the kept ones is the file's mask/valid (a LeRobot
dataset's `valid` split).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ebrl.demos.dataset import write_demos
from ebrl.demos.episodes import DemosError, Episode, held_out
from ebrl.demos.lerobot import write_lerobot
from ebrl.envs.base import EnvAdapter, use_headless_gl
from ebrl.envs.experts import WaypointExpert, expert_for, make_expert
from ebrl.envs.process import NOT_ADAPTER_ARGS, build_adapter
from ebrl.telemetry.report import ProgressBar, console

SEED_BASE = 30_000
FORMATS = ("hdf5", "lerobot")


def run_episode(adapter: EnvAdapter, expert: WaypointExpert, seed: int) -> Episode:
    """One episode of the expert from the reset of `seed`, to its first success or the step limit."""
    obs = adapter.begin_episode(seed)
    expert.reset()
    seen: dict[str, list[np.ndarray]] = {k: [] for k in obs}
    actions, rewards, success = [], [], False
    for _ in range(adapter.spec.max_episode_steps):
        action = np.clip(expert.act(), adapter.spec.action_low, adapter.spec.action_high).astype(np.float32)
        for key, value in obs.items():
            seen[key].append(value)
        obs, reward, terminated, truncated, info = adapter.step(action)
        actions.append(action)
        rewards.append(reward)
        success = bool(info.get("success", False))
        if success or terminated or truncated:
            break
    return Episode(
        {k: np.stack(v) for k, v in seen.items()}, np.stack(actions), np.asarray(rewards, np.float32), success, seed
    )


def record(cfg: DictConfig) -> Path:
    """Record `cfg.episodes` successful episodes; one line where the env has no expert or the expert falls short."""
    conf: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)
    env = conf["env"]
    expert_for(env["name"], env["task"])  # (before a simulator is built)
    if cfg.episodes < 1 or cfg.max_attempts < cfg.episodes:
        raise DemosError(
            f"episodes={cfg.episodes} and max_attempts={cfg.max_attempts}: give episodes >= 1 and "
            "max_attempts >= episodes"
        )
    if not 0 <= cfg.valid < 1:
        raise DemosError(f"valid={cfg.valid} must be in [0, 1) (the share of episodes held out)")
    if cfg.format not in FORMATS:
        raise DemosError(f"format={cfg.format}: give one of {', '.join(FORMATS)}")
    if env.get("cameras"):
        use_headless_gl()
    adapter = build_adapter(env, int(cfg.seed))
    expert = make_expert(env["name"], env["task"], adapter)
    kept: list[Episode] = []
    attempts, t0 = 0, time.perf_counter()
    bar = ProgressBar(total=cfg.episodes, enabled=cfg.progress, label="record")
    try:
        while len(kept) < cfg.episodes and attempts < cfg.max_attempts:
            episode = run_episode(adapter, expert, SEED_BASE + 1000 * int(cfg.seed) + attempts)
            attempts += 1
            if episode.success:
                kept.append(episode)
                bar.advance(f"{attempts} attempts, {len(episode)} steps")
    finally:
        bar.close()
        adapter.close()
    if len(kept) < cfg.episodes:
        raise DemosError(
            f"the {type(expert).__name__} succeeded in {len(kept)} of {attempts} episodes on env="
            f"{env['name']} env.task={env['task']}; raise max_attempts or env.max_episode_steps "
            f"(now {env.get('max_episode_steps')})"
        )
    valid = range(len(kept) - held_out(cfg.valid, len(kept)), len(kept))
    env_args = {
        "env_name": env["task"],
        "benchmark": env["name"],
        "env_kwargs": {k: v for k, v in env.items() if k not in NOT_ADAPTER_ARGS},
    }
    info = {
        "expert": type(expert).__name__,
        "attempts": attempts,
        "build_seed": int(cfg.seed),
        "seed_base": SEED_BASE,
        "env": env,
    }
    if cfg.format == "lerobot":
        path = write_lerobot(
            Path(cfg.out), kept, adapter.spec.instruction, int(cfg.fps), len(valid), info, env.get("robot")
        )
    else:
        path = write_demos(Path(cfg.out) / "demo.hdf5", kept, adapter.spec.instruction, env_args, valid, info)
    lengths = [len(e) for e in kept]
    console.print(
        f"recorded {len(kept)} episodes of the {type(expert).__name__} on env={env['name']} env.task="
        f"{env['task']} ({len(kept)} of {attempts} attempts succeeded; {sum(lengths)} steps, "
        f"{np.mean(lengths):.0f} per episode; {len(valid)} held out) in {time.perf_counter() - t0:.0f} s "
        f"-> {path}",
        soft_wrap=True,
        markup=False,
    )
    return path
