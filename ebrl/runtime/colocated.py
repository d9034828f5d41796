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

from ebrl.envs.worker import SimWorkerPool
from ebrl.policies.base import Policy
from ebrl.rl.rollout import ChunkStep, RolloutBatch, RolloutStats, batch_obs, batch_shapes, stack_steps
from ebrl.telemetry.timers import StageTimers
from ebrl.telemetry.trace import Trace


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
        steps: list[ChunkStep] = []
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
            for i, r in enumerate(reports):
                if r.executed:
                    self.trace.add(f"simulate/env{i}", "chunk", r.started, r.ended, steps=r.executed,
                                   step_s=float(r.step_times.sum()), cpus=list(r.cpus))
            step = ChunkStep(obs=obs, chunk=out.chunk.cpu(), extras={k: v.cpu() for k, v in out.extras.items()},
                             log_prob=out.log_prob.cpu(), value=out.value.cpu())
            step.record(reports, stats, steps)
            if step.cut and not one_episode:
                with self.timers.stage("generate"):
                    final = self.batch_obs([reports[i].final_obs for i in step.cut], step.cut)
                    step.cutoff_value[step.cut] = policy.value({k: v.to(self.device)
                                                                for k, v in final.items()}).float().cpu()
            steps.append(step)
            if one_episode:
                ended |= step.done.numpy()
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
