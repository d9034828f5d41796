"""`scheduler=colocated`: RLinf's colocated mode, the baseline every other schedule is measured against.

Every environment executes its chunk in its own process, all of them wait at a barrier, one
batched generation produces the next chunks, and training runs after the rollout ends.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch

from ebrl.envs.worker import ChunkReport, SimWorkerPool
from ebrl.policies.base import Policy
from ebrl.rl.ppo import RolloutBatch, batch_shapes
from ebrl.telemetry.timers import StageTimers
from ebrl.telemetry.trace import Trace


class RolloutStats:
    """What the rollout saw: env steps, finished episodes and simulator step latencies."""

    def __init__(self) -> None:
        self.env_steps = 0
        self.returns: list[float] = []
        self.lengths: list[float] = []
        self.successes: list[float] = []
        self.step_times: list[np.ndarray] = []
        self.failures = 0  # simulators replaced (died, hung or failed in a chunk)
        self.discarded_steps = 0  # env steps of the partial episodes they were in, dropped from the loss

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"env/episodes": float(len(self.returns)), "sim/failures": float(self.failures),
                                 "sim/discarded_steps": float(self.discarded_steps)}
        if self.returns:
            out["env/return"] = float(np.mean(self.returns))
            out["env/episode_length"] = float(np.mean(self.lengths))
            out["env/success_rate"] = float(np.mean(self.successes))
        if self.step_times:
            t = np.concatenate(self.step_times) * 1e3
            out["env/step_ms_mean"] = float(t.mean())
            out["env/step_ms_p99"] = float(np.percentile(t, 99))
        return out


class ColocatedScheduler:
    """Lockstep rollout over a pool of simulator processes with one batched generation per chunk step."""

    def __init__(self, pool: SimWorkerPool, policy: Policy, timers: StageTimers, device: torch.device) -> None:
        self.pool = pool
        self.policy = policy
        self.timers = timers
        self.device = device
        n = len(pool.workers)
        tokens, mask = policy.tokenize([w.spec.instruction for w in pool.workers])
        self.tokens = torch.from_numpy(tokens)
        self.token_mask = torch.from_numpy(mask)
        self.num_envs = n
        self.sim_cpus = sorted(os.sched_getaffinity(0))  # the OS places the simulators on all of them
        self.trace = Trace()
        self.last_shapes: dict[str, tuple[int, ...]] = {}  # of the last batch collected

    def observe(self) -> dict[str, torch.Tensor]:
        """The current observation of every env as a policy batch (one copy out of shared memory)."""
        return self.batch_obs([w.obs for w in self.pool.workers], list(range(self.num_envs)))

    def batch_obs(self, per_env: list[dict[str, np.ndarray]], envs: list[int]) -> dict[str, torch.Tensor]:
        return batch_obs(per_env, self.tokens, self.token_mask, envs)

    def collect(self, chunks: int, reset_seeds: Sequence[int] | None = None) -> tuple[RolloutBatch, RolloutStats]:
        """`chunks` decisions per env; returns the batch for training (on CPU) and what the envs reported.

        With `reset_seeds` (GRPO), env i first starts an episode from reset_seeds[i] and runs that one
        episode only: once it ended the env is not stepped again, its later actions are masked and no
        steps are counted for it; the rollout stops early once every episode ended. `chunks` must then
        cover the episode step limit. Whole episodes need no bootstrap values: `cutoff_value` and
        `last_value` stay 0.
        """
        policy, stats = self.policy, RolloutStats()
        n, H = self.num_envs, policy.chunk_len
        one_episode = reset_seeds is not None
        if one_episode:
            with self.timers.stage("simulate"):
                before = len(self.pool.failures)
                self.pool.reset_all(reset_seeds)
                stats.failures += len(self.pool.failures) - before  # simulators replaced inside the reset
        ended = np.zeros(n, bool)  # envs whose one episode is over (one_episode only)
        steps: list[dict] = []
        for _ in range(chunks):
            t0 = time.perf_counter()
            with self.timers.stage("generate"):
                obs = self.observe()
                out = policy.sample({k: v.to(self.device) for k, v in obs.items()})
                actions = out.chunk.float().cpu().numpy()
            self.trace.add("generate", "sample", t0, time.perf_counter())
            with self.timers.stage("simulate"):
                for worker, a in zip(self.pool.workers, actions):
                    worker.actions[:H] = a
                self.pool.submit_all([0 if e else H for e in ended])
                reports = self.pool.wait_all()
            cutoff_value = torch.zeros(n)
            cut = [i for i, r in enumerate(reports) if r.truncated and r.final_obs is not None]
            if cut and not one_episode:
                with self.timers.stage("generate"):
                    final = self.batch_obs([reports[i].final_obs for i in cut], cut)
                    cutoff_value[cut] = policy.value({k: v.to(self.device) for k, v in final.items()}).float().cpu()
            for i, r in enumerate(reports):
                if r.executed:
                    self.trace.add(f"simulate/env{i}", "chunk", r.started, r.ended, steps=r.executed,
                                   step_s=float(r.step_times.sum()), cpus=list(r.cpus))
            outcome = chunk_outcome(reports, H, stats, steps)
            steps.append(
                dict(obs=obs, chunk=out.chunk.cpu(), extras={k: v.cpu() for k, v in out.extras.items()},
                     log_prob=out.log_prob.cpu(), value=out.value.cpu(), cutoff_value=cutoff_value, **outcome)
            )
            if one_episode:
                ended |= outcome["done"].numpy()
                if ended.all():  # every episode over: later chunks would all be masked
                    break
        if one_episode:
            if not ended.all():
                raise RuntimeError(f"{int((~ended).sum())} of {n} episodes did not end within {chunks} chunks of {H}")
            batch = stack_steps(steps, torch.zeros(n))
        else:
            with self.timers.stage("generate"):
                obs = self.observe()
                last_value = policy.value({k: v.to(self.device) for k, v in obs.items()}).float().cpu()
            batch = stack_steps(steps, last_value)
        self.last_shapes = batch_shapes(batch)
        return batch, stats


def batch_obs(per_env: list[dict[str, np.ndarray]], tokens: torch.Tensor, token_mask: torch.Tensor,
              envs: list[int]) -> dict[str, torch.Tensor]:
    """Observations of the given envs as a policy batch (one copy), with each env's instruction tokens."""
    obs = {k: torch.from_numpy(np.stack([o[k] for o in per_env])) for k in per_env[0]}
    obs["tokens"] = tokens[envs]
    obs["token_mask"] = token_mask[envs]
    return obs


def chunk_outcome(reports: Sequence[ChunkReport], chunk_len: int, stats: RolloutStats,
                  steps: list[dict]) -> dict[str, torch.Tensor]:
    """One chunk step's reward (summed over executed steps), done and executed-action mask per env, as
    tensors; what the envs reported goes into `stats`. An env whose simulator failed in this chunk has its
    partial episode discarded from `steps`, the chunk steps recorded before this one."""
    n = len(reports)
    reward, done, mask = np.zeros(n, np.float32), np.zeros(n, bool), np.zeros((n, chunk_len), bool)
    for i, r in enumerate(reports):
        reward[i] = r.rewards.sum()
        done[i] = r.done  # (a failed chunk ends the episode: the replacement simulator starts a new one)
        mask[i, : r.executed] = True
        if r.failed:
            discard_partial_episode(steps, i, stats)
        stats.failures += r.failed is not None
        stats.env_steps += r.executed
        stats.step_times.append(r.step_times)
        if r.episode is not None:
            stats.returns.append(r.episode["return"])
            stats.lengths.append(r.episode["length"])
            stats.successes.append(r.episode["success"])
    return dict(reward=torch.from_numpy(reward), done=torch.from_numpy(done), mask=torch.from_numpy(mask))


def discard_partial_episode(steps: list[dict], env: int, stats: RolloutStats) -> None:
    """Mask out env `env`'s chunk steps back to its last episode end: the episode its simulator failed in is never
    finished, so it teaches nothing (its steps before this rollout were trained on, bootstrapped, as any cut-off
    segment is). Episodes that ended are kept."""
    for rec in reversed(steps):
        if rec["done"][env]:
            break
        stats.discarded_steps += int(rec["mask"][env].sum())
        rec["mask"][env] = False


def stack_steps(steps: list[dict], last_value: torch.Tensor) -> RolloutBatch:
    """Per-chunk-step records -> one (T, N, ...) batch."""
    return RolloutBatch(
        obs={k: torch.stack([s["obs"][k] for s in steps]) for k in steps[0]["obs"]},
        chunk=torch.stack([s["chunk"] for s in steps]),
        extras={k: torch.stack([s["extras"][k] for s in steps]) for k in steps[0]["extras"]},
        log_prob=torch.stack([s["log_prob"] for s in steps]),
        value=torch.stack([s["value"] for s in steps]),
        reward=torch.stack([s["reward"] for s in steps]),
        done=torch.stack([s["done"] for s in steps]),
        mask=torch.stack([s["mask"] for s in steps]),
        last_value=last_value,
        cutoff_value=torch.stack([s["cutoff_value"] for s in steps]),
    )
