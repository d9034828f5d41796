"""The rollout's data, from what the simulators report to the batch a trainer trains on.

A chunk step is one decision of a group of envs: the observations the policy saw at a chunk boundary and what it
sampled (`ChunkStep`), then, once every env ran its chunk, what the simulators reported (`ChunkStep.record`). The
chunk steps of one iteration stack into a (T, N, ...) `RolloutBatch`; a pipelined schedule's groups collect theirs
apart and are put side by side (`concat_envs`). `RolloutStats` keeps what the envs reported for the metrics.

Observations are the bulk (camera images, uint8 throughout): a policy batch is copied once out of the simulators'
shared slots (`batch_obs`), and an iteration's observations once more, straight into their (T, N, ...) place
(`stack_group_obs`). Where a process reads them (generation's, the trainer's) they are allocated in shared memory
(`new_tensor`), so that sending one passes a handle instead of a copy.

Every schedule builds its batches with these functions (docs/internals/design.md, "Data").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ebrl.envs.worker import ChunkReport
from ebrl.telemetry.metrics import wilson_interval


@dataclass
class RolloutBatch:
    """T chunk steps x N envs of experience, flattened to B = T*N rows by the trainer."""

    obs: dict[str, torch.Tensor]  # each (T, N, ...)
    chunk: torch.Tensor  # (T, N, H, A)
    extras: dict[str, torch.Tensor]  # each (T, N, ...)
    log_prob: torch.Tensor  # (T, N, H) behaviour log-prob of each action
    value: torch.Tensor  # (T, N)
    reward: torch.Tensor  # (T, N) summed over the executed steps
    done: torch.Tensor  # (T, N) the episode ended inside this chunk
    mask: torch.Tensor  # (T, N, H) the action was executed
    last_value: torch.Tensor  # (N,) value of the observation after the last chunk
    cutoff_value: torch.Tensor  # (T, N) value of the obs an episode was truncated on (its step limit), else 0
    version: torch.Tensor | None = None  # (T, N) int64 published weight version that sampled each chunk; None: unknown
    # (T, N) bool: the env's simulator failed in this chunk step, so the episode it ends was discarded (its actions
    # masked out); None: none failed. A mask cleared by staleness leaves the episode finished, this one does not
    failed: torch.Tensor | None = None
    # The observations the bootstrap values were taken on (pipelined schedules), so that a trainer that values the
    # chunk steps with its own critic (decoupled PPO) values these with the same one: last_obs (N, ...), after the
    # last chunk; cutoff_obs (K, ...), the obs K episodes were cut off on, at chunk step and env cutoff_at (K, 2)
    last_obs: dict[str, torch.Tensor] | None = None
    cutoff_obs: dict[str, torch.Tensor] | None = None
    cutoff_at: torch.Tensor | None = None

    def bootstrap_obs(self) -> dict[str, torch.Tensor] | None:
        """last_obs then cutoff_obs as one batch of N + K rows (None where the batch has no last_obs)."""
        if self.last_obs is None:
            return None
        if self.cutoff_obs is None:
            return self.last_obs
        return {k: torch.cat([v, self.cutoff_obs[k]]) for k, v in self.last_obs.items()}

    def with_bootstrap_values(self, values: torch.Tensor) -> "RolloutBatch":
        """This batch with last_value and cutoff_value replaced by `values` of `bootstrap_obs()`'s rows."""
        n = self.last_value.shape[0]
        cutoff = self.cutoff_value.clone()
        if self.cutoff_at is not None and len(self.cutoff_at):
            cutoff[self.cutoff_at[:, 0], self.cutoff_at[:, 1]] = values[n:].to(cutoff)
        return dataclasses.replace(self, last_value=values[:n].to(self.last_value), cutoff_value=cutoff)


BOOTSTRAP_FIELDS = ("last_obs", "cutoff_obs", "cutoff_at")


def batch_shapes(batch: RolloutBatch) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a batch (the versions and bootstrap observations aside, which only pipelined
    schedules record)."""
    out: dict[str, tuple[int, ...]] = {}
    for name in RolloutBatch.__dataclass_fields__:
        if name in BOOTSTRAP_FIELDS:
            continue
        value = getattr(batch, name)
        if isinstance(value, dict):
            out.update({f"{name}/{k}": tuple(v.shape) for k, v in value.items()})
        elif isinstance(value, torch.Tensor) and name != "version":
            out[name] = tuple(value.shape)
    return out


class RolloutStats:
    """What the rollout saw: env steps, finished episodes and simulator step latencies."""

    def __init__(self) -> None:
        self.env_steps = 0
        self.returns: list[float] = []
        self.lengths: list[float] = []
        self.successes: list[float] = []
        self.tasks: list[str | None] = []  # each episode's task in a multi-task run (env.tasks), else None
        self.step_times: list[np.ndarray] = []
        self.failures = 0  # simulators replaced (died, hung or failed in a chunk)
        self.discarded_steps = 0  # env steps of the partial episodes they were in, dropped from the loss

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "env/episodes": float(len(self.returns)),
            "sim/failures": float(self.failures),
            "sim/discarded_steps": float(self.discarded_steps),
        }
        if self.returns:
            out["env/return"] = float(np.mean(self.returns))
            out["env/episode_length"] = float(np.mean(self.lengths))
            out["env/success_rate"] = float(np.mean(self.successes))
            out["env/successes"] = float(np.sum(self.successes))
            out["env/success_low"], out["env/success_high"] = wilson_interval(
                int(np.sum(self.successes)), len(self.successes)
            )
        out.update(self.task_metrics())
        if self.step_times:
            t = np.concatenate(self.step_times) * 1e3
            out["env/step_ms_mean"] = float(t.mean())
            out["env/step_ms_p99"] = float(np.percentile(t, 99))
        return out

    def task_metrics(self) -> dict[str, float]:
        """env/<task>/success (rate), env/<task>/return and env/<task>/episodes over the episodes of each task."""
        out: dict[str, float] = {}
        for task in sorted({t for t in self.tasks if t is not None}):
            rows = [i for i, t in enumerate(self.tasks) if t == task]
            out[f"env/{task}/success"] = float(np.mean([self.successes[i] for i in rows]))
            out[f"env/{task}/return"] = float(np.mean([self.returns[i] for i in rows]))
            out[f"env/{task}/episodes"] = float(len(rows))
        return out

    @classmethod
    def merged(cls, parts: Sequence["RolloutStats"]) -> "RolloutStats":
        """The stats of several groups' rollouts as one."""
        out = cls()
        for s in parts:
            out.env_steps += s.env_steps
            out.returns += s.returns
            out.lengths += s.lengths
            out.successes += s.successes
            out.tasks += s.tasks
            out.step_times += s.step_times
            out.failures += s.failures
            out.discarded_steps += s.discarded_steps
        return out


@dataclass
class ChunkStep:
    """One decision of a group of N envs: what the policy saw and sampled at a chunk boundary, and, once `record`ed,
    what the simulators reported. Rows are the group's envs in order."""

    obs: dict[str, torch.Tensor]  # each (N, ...)
    chunk: torch.Tensor  # (N, H, A)
    extras: dict[str, torch.Tensor]
    log_prob: torch.Tensor  # (N, H)
    value: torch.Tensor  # (N,)
    version: torch.Tensor | None = None  # (N,) int64 weight version that sampled (pipelined schedules)
    failed: torch.Tensor | None = None  # (N,) bool: the env's simulator failed in this chunk (its episode discarded)
    reward: torch.Tensor | None = None  # (N,) summed over the executed steps
    done: torch.Tensor | None = None  # (N,) bool
    mask: torch.Tensor | None = None  # (N, H) bool: the action was executed
    cutoff_value: torch.Tensor | None = None  # (N,) value of the obs an episode was truncated on, else 0
    cut: list[int] = field(default_factory=list)  # rows whose episode hit its step limit here, with a final obs
    cutoff_obs: dict[str, torch.Tensor] | None = None  # (len(cut), ...) those final obs as valued (pipelined)

    def record(self, reports: Sequence[ChunkReport], stats: RolloutStats, earlier: list["ChunkStep"]) -> None:
        """Each env's reward (summed over the steps it executed), done and executed-action mask; what the envs
        reported goes into `stats`. An env whose simulator failed in this chunk has its partial episode discarded
        from `earlier`, the chunk steps recorded before this one."""
        n, chunk_len = len(reports), self.chunk.shape[1]
        reward, done, mask = np.zeros(n, np.float32), np.zeros(n, bool), np.zeros((n, chunk_len), bool)
        for i, r in enumerate(reports):
            reward[i] = r.rewards.sum()
            done[i] = r.done  # (a failed chunk ends the episode: the replacement simulator starts a new one)
            mask[i, : r.executed] = True
            if r.failed:
                discard_partial_episode(earlier, i, stats)
            stats.failures += r.failed is not None
            stats.env_steps += r.executed
            stats.step_times.append(r.step_times)
            if r.episode is not None:
                stats.returns.append(r.episode["return"])
                stats.lengths.append(r.episode["length"])
                stats.successes.append(r.episode["success"])
                stats.tasks.append(r.episode.get("task"))
        self.reward, self.done, self.mask = torch.from_numpy(reward), torch.from_numpy(done), torch.from_numpy(mask)
        self.failed = torch.tensor([r.failed is not None for r in reports])
        self.cutoff_value = torch.zeros(n)
        self.cut = [i for i, r in enumerate(reports) if r.truncated and r.final_obs is not None]


def discard_partial_episode(steps: Sequence[ChunkStep], env: int, stats: RolloutStats) -> None:
    """Mask out env `env`'s chunk steps back to its last episode end: the episode its simulator failed in is never
    finished, so it teaches nothing (its steps before this rollout were trained on, bootstrapped, as any cut-off
    segment is). Episodes that ended are kept."""
    for rec in reversed(steps):
        if rec.done[env]:
            break
        stats.discarded_steps += int(rec.mask[env].sum())
        rec.mask[env] = False


def new_tensor(shape: Sequence[int], dtype: torch.dtype, shared: bool = False) -> torch.Tensor:
    """An uninitialised tensor; `shared`: allocated in shared memory, so that sending it to another process passes
    a handle (torch pickles a tensor that is not shared by copying it into a new shared segment first)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not shared or nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, tuple(shape))


def batch_obs(
    per_env: list[dict[str, np.ndarray]],
    tokens: torch.Tensor,
    token_mask: torch.Tensor,
    envs: list[int],
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """Observations of the given envs as a policy batch (one copy: each env's arrays straight into their row), with
    each env's instruction tokens; `shared`: in shared memory (`new_tensor`), for a process to read."""
    obs = {}
    for k, first in per_env[0].items():
        out = new_tensor((len(per_env), *first.shape), torch.from_numpy(np.empty(0, first.dtype)).dtype, shared)
        np.stack([o[k] for o in per_env], out=out.numpy())
        obs[k] = out
    for k, table in (("tokens", tokens), ("token_mask", token_mask)):
        obs[k] = new_tensor((len(envs), *table.shape[1:]), table.dtype, shared)
        torch.index_select(table, 0, torch.tensor(envs, dtype=torch.long), out=obs[k])
    return obs


def stack_group_obs(
    groups: Sequence[Sequence[dict[str, torch.Tensor]]], steps: int, shared: bool = False
) -> dict[str, torch.Tensor]:
    """Each group's chunk-step observations (oldest first; each (N_g, ...)) as one (steps, N, ...) tensor per key,
    the groups side by side in order and a group with fewer chunk steps padded with its last (as `pad_steps`): one
    copy each, straight into place; `shared`: in shared memory, for the trainer's process."""
    first = groups[0][0]
    sizes = [len(next(iter(g[0].values()))) for g in groups]
    out = {k: new_tensor((steps, sum(sizes), *v.shape[1:]), v.dtype, shared) for k, v in first.items()}
    start = 0
    for g, n in zip(groups, sizes):
        for t in range(steps):
            for k, v in g[min(t, len(g) - 1)].items():
                out[k][t, start : start + n] = v
        start += n
    return out


def stack_steps(
    steps: Sequence[ChunkStep],
    last_value: torch.Tensor,
    last_obs: dict[str, torch.Tensor] | None = None,
    with_obs: bool = True,
) -> RolloutBatch:
    """Recorded chunk steps -> one (T, N, ...) batch (with their versions where every step has one); with
    `last_obs`, the obs `last_value` was taken on, and the cut-off obs the steps kept, as bootstrap observations.
    with_obs=False leaves the chunk steps' observations out (obs={}: `stack_group_obs` puts them in place later)."""

    def stack(name: str) -> torch.Tensor:
        return torch.stack([getattr(s, name) for s in steps])

    cutoff_obs = cutoff_at = None
    if last_obs is not None:
        kept = [(t, s) for t, s in enumerate(steps) if s.cut and s.cutoff_obs is not None]
        cutoff_at = torch.tensor([(t, i) for t, s in kept for i in s.cut], dtype=torch.long).view(-1, 2)
        if kept:
            cutoff_obs = {k: torch.cat([s.cutoff_obs[k] for _, s in kept]) for k in kept[0][1].cutoff_obs}

    return RolloutBatch(
        obs={k: torch.stack([s.obs[k] for s in steps]) for k in steps[0].obs} if with_obs else {},
        chunk=stack("chunk"),
        extras={k: torch.stack([s.extras[k] for s in steps]) for k in steps[0].extras},
        log_prob=stack("log_prob"),
        value=stack("value"),
        reward=stack("reward"),
        done=stack("done"),
        mask=stack("mask"),
        last_value=last_value,
        cutoff_value=stack("cutoff_value"),
        version=stack("version") if all(s.version is not None for s in steps) else None,
        failed=stack("failed") if all(s.failed is not None for s in steps) else None,
        last_obs=last_obs,
        cutoff_obs=cutoff_obs,
        cutoff_at=cutoff_at,
    )


def concat_envs(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Groups' batches (T, N_g, ...) side by side -> one (T, N, ...) batch, envs in group order."""

    def cat(get: object, dim: int = 1) -> torch.Tensor:
        return torch.cat([get(b) for b in batches], dim)  # type: ignore[operator]

    first = batches[0]
    last_obs = cutoff_obs = cutoff_at = None
    if all(b.last_obs is not None for b in batches):
        last_obs = {k: torch.cat([b.last_obs[k] for b in batches]) for k in first.last_obs}
        offsets = np.cumsum([0] + [b.last_value.shape[0] for b in batches[:-1]])
        cutoff_at = torch.cat([b.cutoff_at + torch.tensor([0, int(o)]) for b, o in zip(batches, offsets)])
        cut = [b.cutoff_obs for b in batches if b.cutoff_obs is not None]
        cutoff_obs = {k: torch.cat([c[k] for c in cut]) for k in cut[0]} if cut else None
    return RolloutBatch(
        obs={k: cat(lambda b, k=k: b.obs[k]) for k in first.obs},
        chunk=cat(lambda b: b.chunk),
        extras={k: cat(lambda b, k=k: b.extras[k]) for k in first.extras},
        log_prob=cat(lambda b: b.log_prob),
        value=cat(lambda b: b.value),
        reward=cat(lambda b: b.reward),
        done=cat(lambda b: b.done),
        mask=cat(lambda b: b.mask),
        last_value=cat(lambda b: b.last_value, 0),
        cutoff_value=cat(lambda b: b.cutoff_value),
        version=cat(lambda b: b.version),
        failed=None if any(b.failed is None for b in batches) else cat(lambda b: b.failed),
        last_obs=last_obs,
        cutoff_obs=cutoff_obs,
        cutoff_at=cutoff_at,
    )


def pad_steps(batch: RolloutBatch, steps: int) -> RolloutBatch:
    """The batch with chunk steps appended up to `steps` (T), copies of its last one that executed nothing: no
    reward, no done, every action masked out. Episodic groups (GRPO) end after different numbers of chunk steps and
    are put side by side."""
    extra = steps - batch.reward.shape[0]
    if extra <= 0:
        return batch

    def pad(x: torch.Tensor, fill: float | bool | None = None) -> torch.Tensor:
        tail = x[-1:].expand(extra, *x.shape[1:]).clone()
        if fill is not None:
            tail.fill_(fill)
        return torch.cat([x, tail])

    return dataclasses.replace(
        batch,
        obs={k: pad(v) for k, v in batch.obs.items()},
        chunk=pad(batch.chunk),
        extras={k: pad(v) for k, v in batch.extras.items()},
        log_prob=pad(batch.log_prob),
        value=pad(batch.value),
        reward=pad(batch.reward, 0.0),
        done=pad(batch.done, False),
        mask=pad(batch.mask, False),
        cutoff_value=pad(batch.cutoff_value, 0.0),
        version=None if batch.version is None else pad(batch.version),
        failed=None if batch.failed is None else pad(batch.failed, False),
    )


def drop_stale(batch: RolloutBatch, train_version: int, max_staleness: int) -> tuple[int, float]:
    """Mask out (in place) the chunk steps made more than `max_staleness` versions before `train_version`.

    Returns (dropped chunk steps, the mean staleness), both over the chunk steps that executed an action. The steps stay
    in the batch for GAE (their rewards and recorded values still chain the episode) but carry no policy loss.
    """
    staleness = train_version - batch.version
    live = batch.mask.any(-1)
    stale = (staleness > max_staleness) & live
    batch.mask[stale] = False
    return int(stale.sum()), float(staleness[live].float().mean()) if bool(live.any()) else 0.0
