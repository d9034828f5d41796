"""PPO and GRPO with the tiny pi0-style policy raise the return on a real MuJoCo task (robosuite Lift, shaped reward)
from scratch, and PPO raises the success of the SFT checkpoint the repository ships.

From scratch: the embedded defaults of `python run.py` with init=null and env.reward=dense (8 envs, 40-step episodes,
lr 1e-4): about 2 minutes on 2 cores.
Measured (python -m ebrl.bench.learning --seeds 0 1 2 3 4): mean return per episode over iterations 1-3 and
21-24, seed 0, colocated 0.61 -> 2.81, ebrl 0.64 -> 3.70; over seeds 0-4 colocated ends at 2.6-4.8, ebrl at
0.9-5.2 (seed 4 started late). Before the first policy's mean action was centred (FlowPolicy.centre_actions) the
seed decided which way the gripper drifted, and only seed 0 learned.
GRPO (`algo=grpo`, groups of 4, one 40-step episode per env per iteration, so 320 env steps per iteration):
0.71 -> 1.85 after 7,680 env steps, having peaked at 2.85 (iteration 20); deterministic, but it holds the 2.5x
bound by a small margin (1.85 against 1.78), so a change of numerics (threads, kernels) can move it.
"""

import json

import numpy as np
import pytest

from ebrl.runs.experiment import Experiment
from tests.conftest import compose_config

SCRATCH = ("init=null", "env.reward=dense")  # the shaped reward, from the family's initialisation
# Success over iterations 31-40 minus that over 1-5, from the shipped checkpoint, measured with
# `python -m ebrl.bench.learning --algos ppo --seeds 0 1 2 --iterations 100`: colocated 0.21, 0.13, 0.31; ebrl 0.16,
# 0.24, 0.035 (seed 2 started high, at 32%). The least colocated gain is 0.13; this test runs colocated seed 0.
MARGIN = 0.1


@pytest.mark.slow
def test_ppo_learns_to_reach_on_lift(tmp_path):
    cfg = compose_config(*SCRATCH, "iterations=24", "progress=false", "seed=0")
    Experiment.from_config(cfg, run_dir=tmp_path).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    returns = [r["env/return"] for r in rows]
    first, last = np.mean(returns[:3]), np.mean(returns[-4:])
    print(f"return first 3 iterations {first:.2f}, last 4 {last:.2f}: {[round(r, 2) for r in returns]}")
    assert last > 2.5 * first and last - first > 0.8, returns


@pytest.mark.slow
def test_ppo_learns_to_reach_on_lift_under_the_ebrl_schedule(tmp_path):
    """Training overlaps the rollout (chunks up to 2 versions stale, decoupled PPO), groups pipelined, cores
    rebound: the same task is learned as under the colocated schedule, by the same bound.

    Unlike colocated, this schedule is not deterministic: timing decides which chunks a weight update reaches
    first. Seed 0 went 0.64 -> 3.70 in the learning benchmark; the bound needs 1.6."""
    cfg = compose_config(*SCRATCH, "scheduler=ebrl", "iterations=24", "progress=false", "seed=0")
    Experiment.from_config(cfg, run_dir=tmp_path).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    returns = [r["env/return"] for r in rows]
    first, last = np.mean(returns[:3]), np.mean(returns[-4:])
    print(f"return first 3 iterations {first:.2f}, last 4 {last:.2f}: {[round(r, 2) for r in returns]}")
    assert max(r["sched/staleness_mean"] for r in rows) > 0  # the overlap was real
    assert last > 2.5 * first and last - first > 0.8, returns


@pytest.mark.slow
def test_grpo_learns_to_reach_on_lift(tmp_path):
    cfg = compose_config(*SCRATCH, "algo=grpo", "iterations=24", "progress=false", "seed=0")
    Experiment.from_config(cfg, run_dir=tmp_path).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/episodes"] == 8 for r in rows)  # one episode per env per iteration
    returns = [r["env/return"] for r in rows]
    first, last = np.mean(returns[:3]), np.mean(returns[-4:])
    print(f"return first 3 iterations {first:.2f}, last 4 {last:.2f}: {[round(r, 2) for r in returns]}")
    assert last > 2.5 * first and last - first > 0.8, returns


@pytest.mark.slow
def test_ppo_raises_the_success_of_the_shipped_sft_checkpoint(tmp_path):
    """The embedded defaults: init=auto fine-tunes the shipped SFT checkpoint on the sparse success reward. The
    rollouts' success over iterations 31-40 against that over iterations 1-5 (the first two only warm the critic up, so
    these are the SFT policy's own). MARGIN is below the least gain over the benchmark's seeds (see its value)."""
    cfg = compose_config("iterations=40", "progress=false", "seed=0")
    run = Experiment.from_config(cfg, run_dir=tmp_path)
    run.train()
    assert run.conf["init"].endswith("ebrl/assets/openpi-tiny_robosuite-Lift_sft.pt")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    wins, episodes = np.array([r["env/successes"] for r in rows]), np.array([r["env/episodes"] for r in rows])
    first, last = wins[:5].sum() / episodes[:5].sum(), wins[-10:].sum() / episodes[-10:].sum()
    print(f"success first 5 iterations {first:.2f}, last 10 {last:.2f}: {np.round(wins / episodes, 2).tolist()}")
    assert last - first > MARGIN, (first, last)
