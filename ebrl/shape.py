"""The rollout's shape, worked out once from a run's config (docs/internals/design.md, "Layers"): how many envs, how
they group, how many chunk steps an iteration collects and how an update walks them. Every reader (the checks, the
allocator, the placement's memory check, the schedule's loop, the trainer, the cost models, the benchmarks) takes
its sizes from here rather than working them out again.

A config here is the composed one or its resolved plain copy (`conf`): both are read by key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def minibatch_rows(algo: Any, rows: int, ranks: int = 1) -> int:
    """Rows of one optimizer step on this rank: the rank's share of algo.global_batch (all of its `rows` when the
    rollout is smaller), else `rows` / algo.minibatches."""
    global_batch = algo.get("global_batch")
    if global_batch is None:
        return max(1, rows // algo["minibatches"])
    return max(1, min(rows, global_batch // ranks))


def micro_rows(algo: Any, minibatch: int) -> int:
    """Rows of one forward/backward pass of an optimizer step of `minibatch` rows: algo.micro_batch, at most the
    minibatch (null: the whole minibatch at once)."""
    return min(algo.get("micro_batch") or minibatch, minibatch)


def group_size(cfg: Any) -> int:
    """The envs built from one seed: a GRPO group's (algo.group_size), else 1."""
    algo = cfg["algo"]
    return int(algo["group_size"]) if algo["name"] == "grpo" else 1


@dataclass(frozen=True)
class RolloutShape:
    """One rank's rollout and update sizes (see the module docstring). Where the episode is not known yet (the checks,
    before the simulators say their spec), a GRPO run's chunks and what follows from them are None. Nothing is
    checked here: the checks (ebrl/checks.py) reject the sizes that cannot work."""

    envs: int  # env.num_envs: this rank's simulators
    group_size: int  # envs that start from one seeded reset: algo.group_size under GRPO, else 1
    groups: int  # scheduler.groups: the generation batches the envs split into
    ranks: int  # the data-parallel ranks an optimizer step's rows are shared over
    # chunk steps per env per iteration: algo.rollout_chunks, or under GRPO one whole episode,
    # ceil(max_episode_steps / policy.execute); none under SFT
    chunks: int | None
    rows: int | None  # the rollout's chunk steps: envs x chunks
    minibatch_rows: int | None  # rows of one optimizer step (minibatch_rows)
    micro_rows: int | None  # rows of one forward/backward pass (micro_rows)

    @property
    def envs_per_group(self) -> int:
        """One generation batch: envs / groups."""
        return self.envs // self.groups

    @property
    def units(self) -> int:
        """What the envs split into for tasks and the schedule's groups: envs, or GRPO groups."""
        return self.envs // self.group_size

    @classmethod
    def of(
        cls,
        cfg: Any,
        ranks: int = 1,
        max_episode_steps: int | None = None,
        execute: int | None = None,
        envs: int | None = None,
    ) -> "RolloutShape":
        """The shape of `cfg`'s rollout on one of `ranks` ranks; a GRPO run's chunks need the episode's length (the
        env spec's max_episode_steps) and the actions executed of each chunk (policy.execute). `envs`: this rank's
        envs where they are not env.num_envs (a benchmark's prediction at other counts)."""
        algo = cfg["algo"]
        envs = int(cfg["env"]["num_envs"] if envs is None else envs)
        chunks: int | None = None  # (sft: no rollout)
        if algo["name"] == "ppo":
            chunks = int(algo["rollout_chunks"])
        elif algo["name"] == "grpo" and max_episode_steps is not None and execute is not None:
            chunks = math.ceil(max_episode_steps / execute)
        rows = None if chunks is None else envs * chunks
        minibatch = None if rows is None else minibatch_rows(algo, rows, ranks)
        return cls(
            envs=envs,
            group_size=group_size(cfg),
            groups=int(cfg["scheduler"]["groups"]),
            ranks=ranks,
            chunks=chunks,
            rows=rows,
            minibatch_rows=minibatch,
            micro_rows=None if minibatch is None else micro_rows(algo, minibatch),
        )
