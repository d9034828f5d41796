"""PPO over action chunks, readable top to bottom (CleanRL style).

One transition = one decision: the observation at a chunk boundary, the chunk the policy
sampled, the reward summed over the env steps the chunk executed (its first `policy.execute`
actions, or fewer where the episode ended inside it), and whether the episode ended inside it.
GAE runs over these chunk steps. The ratio is taken per executed action of the chunk (each
action's log-density under the denoising chain; algo.logprob_level=action), once per chunk
over the sum of its executed actions' log-densities (chunk: RLinf's chunk_level), or once per
chunk over all H actions of the chain it was sampled as (chain); actions the env never executed
are in no loss but chain's.

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL) for
asynchronous schedules, where a rollout may come from weights older than the trainer's: the clip
is taken around the proximal policy (the trainer's weights when the update starts), not around the
stale behaviour policy, and each action's surrogate is reweighted by the truncated importance
weight proximal / behaviour, so stale data neither widens the trust region nor biases the gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ebrl.checks import LOGPROB_LEVELS, PROXIMAL
from ebrl.config import AlgoConfig
from ebrl.policies.base import Policy
from ebrl.policies.layers import cat_rows, map_tensors
from ebrl.policies.training import is_sharded, trained_parameters
from ebrl.rl.optim import make_optimizer
from ebrl.rl.rollout import RolloutBatch
from ebrl.shape import micro_rows, minibatch_rows


def compute_gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    done: torch.Tensor,
    last_value: torch.Tensor,
    gamma: float,
    lam: float,
    cutoff_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over chunk steps; returns (advantages, returns), each (T, N).

    An episode that ended is not bootstrapped from the next episode's first value; one cut off by
    its step limit (not by the task) is bootstrapped from `cutoff_value`, the value of the obs it
    was cut off on, since the task itself would have gone on.
    """
    T = reward.shape[0]
    adv = torch.zeros_like(reward)
    next_adv = torch.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(T)):
        alive = 1.0 - done[t].float()
        bootstrap = next_value * alive + (0.0 if cutoff_value is None else cutoff_value[t])
        delta = reward[t] + gamma * bootstrap - value[t]
        next_adv = delta + gamma * lam * alive * next_adv
        adv[t] = next_adv
        next_value = value[t]
    return adv, adv + value


def by_level(log_prob: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H) per-action log-probs and executed-action mask as the units one ratio is taken over: as they are
    (action); or (B, 1), one per chunk that executed any action: the sum over its executed actions (chunk), or over
    all H actions of the chain, the ones the env never ran included (chain: the density the chain was sampled
    from, which was drawn jointly over all H; docs/internals/design.md, "The chain's log-prob")."""
    if level == "action":
        return log_prob, mask
    if level == "chunk":
        return (log_prob * mask).sum(-1, keepdim=True), mask.any(-1, keepdim=True)
    if level == "chain":
        return log_prob.sum(-1, keepdim=True), mask.any(-1, keepdim=True)
    raise ValueError(f"algo.logprob_level={level!r}; accepted: {', '.join(LOGPROB_LEVELS)}")


def ppo_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    behaviour_log_prob: torch.Tensor | None = None,
    is_clip: float = 2.0,
    count: torch.Tensor | None = None,
    clip_high: float | None = None,
    level: str = "action",
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate per unit (an executed action, or a chunk: `level`, see `by_level`), averaged over the units
    (over `count` of them: a micro-batch's share of its minibatch's mean, so that the micro-batches' losses and stats
    add up to the minibatch's).

    new/old_log_prob, behaviour_log_prob and mask: (B, H); advantage: (B,), shared by the actions of a chunk.
    With `behaviour_log_prob` (decoupled PPO) `old_log_prob` is the proximal policy's: the ratio is clipped around
    it, and each unit's surrogate is scaled by w = min(proximal / behaviour, is_clip), a constant, truncated
    so that one very stale action cannot dominate the step. The ratio is clipped to [1 - clip, 1 + clip_high]
    (clip_high None: clip); with `dual_clip` c, a negative advantage's loss is at most c |A| (dual-clip PPO, as
    RLinf's clip_ratio_c).
    """
    high = clip if clip_high is None else clip_high
    new_log_prob, units = by_level(new_log_prob, mask, level)
    old_log_prob = by_level(old_log_prob, mask, level)[0]
    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    adv = advantage.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + high) * adv)
    if dual_clip is not None:  # (a positive advantage's surrogate is never below -c |A|)
        surrogate = torch.maximum(surrogate, -dual_clip * adv.abs())
    m = units.float()
    n = m.sum().clamp_min(1.0) if count is None else count
    if behaviour_log_prob is not None:
        if not is_clip > 0:
            raise ValueError(f"is_clip={is_clip} must be > 0 (the cap on the importance weight; 2.0 is usual)")
        with torch.no_grad():
            raw = (old_log_prob - by_level(behaviour_log_prob, mask, level)[0]).exp()
            weight = raw.clamp(max=is_clip)
        surrogate = surrogate * weight
    loss = -(surrogate * m).sum() / n
    with torch.no_grad():
        stats = {
            "train/approx_kl": (((ratio - 1.0) - log_ratio) * m).sum() / n,
            "train/clipfrac": (((ratio < 1.0 - clip) | (ratio > 1.0 + high)).float() * m).sum() / n,
        }
        if behaviour_log_prob is not None:
            stats["train/is_weight_mean"] = (weight * m).sum() / n
            stats["train/is_truncated"] = ((raw >= is_clip).float() * m).sum() / n
    return loss, stats


def proximal_rows(
    batch: RolloutBatch, decoupled: bool, version: int | None, how: str, low_precision: bool
) -> torch.Tensor:
    """(B,) the rows an update's proximal pass values (under the weights it starts from, `version`). Decoupled: those
    older weights sampled (every row with algo.proximal=all, or where the versions are not known); the others take
    their behaviour log-prob and value, which these weights gave. Otherwise the data's weights are these, but a
    low-precision (bfloat16) forward pass in other batch shapes (generation's) differs from the trainer's by ~0.1 in
    log-prob per action: every row, so that the ratio (and the value clip) is taken against the trainer's own numbers;
    none in float32."""
    rows = batch.chunk.shape[0] * batch.chunk.shape[1]
    if how not in PROXIMAL:
        raise ValueError(f"algo.proximal={how!r}; accepted: {', '.join(PROXIMAL)}")
    if not decoupled:
        return torch.full((rows,), low_precision, dtype=torch.bool)
    if how == "all" or version is None or batch.version is None:
        return torch.ones(rows, dtype=torch.bool)
    return _flat(batch.version) != version


def value_loss(
    value: torch.Tensor, ret: torch.Tensor, old_value: torch.Tensor, clip: float | None, huber_delta: float | None
) -> torch.Tensor:
    """(B,) loss of each row's value against its return: squared error / 2, or Huber at `huber_delta` (the same
    below it); with `clip`, the larger of that and the loss of the value kept within `clip` of the rollout's
    `old_value` (PPO2's value clip, as RLinf's critic loss)."""

    def loss(err: torch.Tensor) -> torch.Tensor:
        if huber_delta is None:
            return 0.5 * err.pow(2)
        return torch.nn.functional.huber_loss(err, torch.zeros_like(err), reduction="none", delta=huber_delta)

    out = loss(ret - value)
    if clip is not None:
        out = torch.maximum(out, loss(ret - (old_value + (value - old_value).clamp(-clip, clip))))
    return out


CRITIC = "value_head."  # every family's value head (Policy.value): the critic


def param_groups(policy: Policy, cfg: AlgoConfig) -> list[dict]:
    """The trained parameters as AdamW groups: the policy's at algo.lr, the value head's at algo.critic_lr (RLinf's
    value_lr), each group only where it has parameters. An algorithm without a critic (GRPO, SFT: no critic_lr) gives
    the value head no gradient, so its group, at algo.lr, never steps; it is kept for the optimizer state's layout."""
    named = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in named if not name.startswith(CRITIC)], "lr": cfg.lr},
        {"params": [p for name, p in named if name.startswith(CRITIC)], "lr": cfg.get("critic_lr", cfg.lr)},
    ]
    return [g for g in groups if g["params"]]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _rows(tree: Any, index: torch.Tensor | slice) -> Any:
    """The rows `index` picks of every tensor of a nested structure (None stays None)."""
    return map_tensors(tree, lambda t: t[index])


def _batch_rows(obs: dict[str, torch.Tensor]) -> int:
    return next(iter(obs.values())).shape[0]


def _parts(total: int, rows: int) -> list[slice]:
    return [slice(start, start + rows) for start in range(0, total, rows)]


class PPOTrainer:
    """Adam over the parameters the policy trains (`policy.train`); `update` runs epochs x minibatches on one rollout,
    each minibatch one optimizer step over `algo.micro_batch` rows at a time.

    Subclasses change how advantages are made by overriding `advantages` (GRPO: group-relative
    returns, no critic); the clipped loss, epochs, minibatches and early stop stay this one.
    """

    def __init__(
        self,
        policy: Policy,
        cfg: AlgoConfig,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.policy = policy
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.group = group  # data-parallel over this group's ranks (DDP, or FSDP when the policy is sharded)
        self.sharded = is_sharded(policy)  # FSDP reduces the gradients itself
        self.model: torch.nn.Module = _Evaluate(policy)
        if group is not None and not self.sharded:
            # DDP starts from rank 0's weights and averages the gradients of every backward over the ranks. Parts of a
            # policy may get no gradient (GRPO: the value head), hence find_unused_parameters (torch warns once where
            # there are none). static_graph=True instead left GRPO's replicas with different weights after one update.
            ids = [self.device] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(
                self.model, device_ids=ids, process_group=group, find_unused_parameters=True
            )
        self.optimizer = make_optimizer(
            param_groups(policy, cfg),
            cfg.lr,
            cfg.get("optimizer_dtype", "float32"),
            cfg.adam_betas,
            cfg.adam_eps,
            cfg.weight_decay,
        )
        self.trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        critic = {id(p) for name, p in policy.named_parameters() if name.startswith(CRITIC)}
        self.actor = [p for p in self.trained if id(p) not in critic]  # what a critic-only step leaves as it is
        self.pace: Callable[[], None] = lambda: None  # called before each step (a trainer process: its threads)
        # polled after each step: true, the update ends there (the run is stopping: its state is then whole)
        self.stop_asked: Callable[[], bool] = lambda: False

    def load_optimizer_state(self, state: dict) -> None:
        """Continue from a checkpoint's Adam moments, at this config's hyperparameters (a resumed run may change
        them). Either layout loads: torch's (by parameter index) or the sharded trainers' (by parameter name); one
        saved before the value head had a group of its own is regrouped."""
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        by_name = any(isinstance(k, str) for k in state.get("state", {}))
        if self.sharded or by_name:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.policy, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(self._regrouped(state))
        for group, hyper in zip(self.optimizer.param_groups, configured):
            group.update(hyper)

    def _regrouped(self, state: dict) -> dict:
        """A torch-layout state whose one group held every trained parameter, in this optimizer's groups."""
        saved = state["param_groups"]
        if len(saved) == len(self.optimizer.param_groups) or len(saved) != 1:
            return state
        position = {id(p): i for i, p in enumerate(trained_parameters(self.policy))}
        ids = saved[0]["params"]  # (in the order of trained_parameters when it was saved)
        groups = [
            {**saved[0], "params": [ids[position[id(p)]] for p in group["params"]]}
            for group in self.optimizer.param_groups
        ]
        return {**state, "param_groups": groups}

    def optimizer_state(self) -> dict:
        """The Adam state for a checkpoint; a sharded trainer's gathered whole, by parameter name, on rank 0 (a
        collective: every rank calls it)."""
        if not self.sharded:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.policy, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Advantages (T, N), value targets (T, N) or None when there is no critic, and their metrics."""
        cfg = self.cfg
        cutoff = batch.cutoff_value if cfg.get("bootstrap_truncated", True) else None
        reward = batch.reward * cfg.get("reward_scale", 1.0)
        adv, ret = compute_gae(reward, batch.value, batch.done, batch.last_value, cfg.gamma, cfg.gae_lambda, cutoff)
        rows = batch.mask.any(-1)  # the value loss's rows: padded, stale and discarded ones have no return to learn
        _, (ret_mean, _, value_mean), (ret_var, error_var, _) = self.row_moments(
            torch.stack([ret[rows], ret[rows] - batch.value[rows], batch.value[rows]], 1)
        )
        metrics = {
            "train/explained_variance": float(1.0 - error_var / ret_var) if ret_var > 0 else 0.0,
            "train/value_mean": float(value_mean),
            "train/return_mean": float(ret_mean),
        }
        return adv, ret, metrics

    def row_moments(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count, mean and (unbiased) variance of each column of (rows, k) `columns`, over the rows of every
        data-parallel rank: the global batch's, which the recipes' values assume (sums all-reduced, in float64)."""
        x = columns.detach().double().cpu()
        sums = torch.stack([torch.full((x.shape[1],), float(x.shape[0]), dtype=x.dtype), x.sum(0), x.pow(2).sum(0)])
        if self.group is not None:
            sums = sums.to(self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(sums, group=self.group)
            sums = sums.cpu()
        n, total, squares = sums
        mean = total / n.clamp_min(1.0)
        return n, mean, ((squares - n * mean.pow(2)) / (n - 1.0).clamp_min(1.0)).clamp_min(0.0)

    def normalized(self, adv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(B,) advantages less their mean, over their std, both over the rows in the loss of every rank (`rows`,
        (B,) bool: rows that executed an action; the others are in no loss, nor in the statistics)."""
        n, mean, var = self.row_moments(adv[rows].unsqueeze(1))
        if n <= 1:
            return adv
        return (adv - mean.to(adv)) / (var.sqrt().to(adv) + 1e-8)

    @torch.no_grad()
    def prefixes(self, obs: dict[str, torch.Tensor], rows: int) -> Any:
        """Every row's frozen prefix (`Policy.prefix`), computed once for the update, `rows` at a time: every epoch,
        micro-batch and the proximal pass reuse it (docs/internals/design.md, "The frozen prefix"). None where the
        policy trains its prefix or algo.cache_prefix is off: each pass runs it again."""
        if not self.cfg.get("cache_prefix", True) or not self.policy.frozen_prefix():
            return None
        with self.policy.precision():
            parts = [self.policy.prefix(_rows(obs, part)) for part in _parts(_batch_rows(obs), rows)]
        return cat_rows(parts)

    @torch.no_grad()
    def proximal(
        self,
        obs: dict[str, torch.Tensor],
        chunk: torch.Tensor,
        extras: dict[str, torch.Tensor],
        rows: int,
        prefix: Any = None,
        which: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, H) log-prob and (n,) value under the current weights of the rows `which` picks (all of them by
        default), `rows` at a time to bound activation memory; `prefix`: every row's frozen prefix (`prefixes`).

        Call it in the mode the epochs run in, so that with unchanged weights it is what the first epoch evaluates. A
        sharded policy's ranks make the same number of passes (its layers gather their shards together): a rank with
        fewer rows to value runs its last row again, and drops it.
        """
        picked = torch.arange(chunk.shape[0], device=chunk.device) if which is None else which.nonzero()[:, 0]
        passes = self._max_over_ranks(math.ceil(len(picked) / rows)) if self.sharded else math.ceil(len(picked) / rows)
        if not passes:  # (sharded, and no rank has a row to value)
            return chunk.new_zeros(0, chunk.shape[1]), chunk.new_zeros(0)
        lp, value = [], []
        for i in range(passes):
            part = picked[i * rows : (i + 1) * rows]
            kept = len(part)
            if not kept:  # (sharded, and this rank has valued all it has: a pass to keep pace, dropped)
                part = torch.zeros(1, dtype=torch.long, device=chunk.device)
            # (the policy itself, not DDP's wrapper, whose forward is a collective: ranks value different rows)
            out = evaluate(self.policy, _rows(obs, part), chunk[part], _rows(extras, part), _rows(prefix, part))
            lp.append(out[0][:kept])
            value.append(out[2][:kept])
        return torch.cat(lp), torch.cat(value)

    @torch.no_grad()
    def values(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) values of these observations under the current weights, on the CPU, in one forward pass (a sharded
        policy's every rank makes the same number of calls however many rows it values)."""
        return self.policy.value({k: v.to(self.device) for k, v in obs.items()}).float().cpu()

    def update(
        self,
        batch: RolloutBatch,
        decoupled: bool = False,
        is_clip: float = 2.0,
        critic_only: bool = False,
        version: int | None = None,
    ) -> dict[str, float]:
        """Epochs x minibatches of the clipped loss on one rollout; returns the metrics averaged over minibatches.

        decoupled: the rollout may come from older weights (asynchronous schedules), so clip around the proximal
        policy (these weights, before the first step) and reweight by min(proximal / behaviour, is_clip). The
        proximal pass values the rows sampled by older weights; a row sampled by these (its `batch.version` is
        `version`, the weights' version) takes its behaviour log-prob and value as the proximal ones, unless
        algo.proximal=all.
        critic_only: the critic's warm-up after `init` (an SFT checkpoint's value head never learned): the value
        loss alone, and only the value head steps (the features it shares with the policy stay), so the policy
        acts as it was while its advantages become meaningful.
        """
        cfg = self.cfg
        dev = self.device
        obs = {k: _flat(v).to(dev) for k, v in batch.obs.items()}
        extras = {k: _flat(v).to(dev) for k, v in batch.extras.items()}
        chunk, old_lp, mask = _flat(batch.chunk).to(dev), _flat(batch.log_prob).to(dev), _flat(batch.mask).to(dev)
        B = chunk.shape[0]
        mb = minibatch_rows(cfg, B, 1 if self.group is None else dist.get_world_size(self.group))
        steps = math.ceil(B / mb)
        rows = micro_rows(cfg, mb)  # per forward/backward pass
        self.policy.train()
        prefix = self.prefixes(obs, rows)
        behaviour_lp = old_lp if decoupled else None  # (decoupled: the ratio's weight to the behaviour policy)
        old_value = _flat(batch.value).to(dev)  # where algo.value_clip holds the value to
        low_precision = self.policy.compute_dtype != torch.float32
        which = proximal_rows(batch, decoupled, version, cfg.get("proximal", "stale"), low_precision).to(dev)
        if which.any() or (self.sharded and (decoupled or low_precision)):  # (sharded: every rank takes part)
            old_lp, old_value = old_lp.clone(), old_value.clone()
            old_lp[which], old_value[which] = self.proximal(obs, chunk, extras, rows, prefix, which)
        if decoupled:
            # stale chunks' values came from an older critic: advantages from this one's, as for fresh chunks, and
            # the bootstrap values from this one too, where the batch has their observations (GAE mixes no critics)
            batch = dataclasses.replace(batch, value=old_value.view_as(batch.value).to(batch.value))
            bootstrap = batch.bootstrap_obs()
            if bootstrap is not None:
                batch = batch.with_bootstrap_values(self.values(bootstrap))
        adv, ret, metrics = self.advantages(batch)
        adv = _flat(adv).to(dev)
        critic = None if ret is None else (_flat(ret).to(dev), old_value)  # value targets and their clip anchor
        if cfg.normalize_advantages:
            adv = self.normalized(adv, mask.any(-1))

        sums: dict[str, float] = {}
        count = 0
        stopped_early = 0.0
        skipped = 0  # steps whose gradient held NaN/inf (a NaN loss gives one): not taken
        for _ in range(cfg.epochs):
            epoch_kl = 0.0
            for idx in torch.randperm(B, device=dev).split(mb):
                self.pace()
                self.optimizer.zero_grad(set_to_none=True)
                step = self._accumulate(
                    idx,
                    idx.split(rows),
                    obs,
                    chunk,
                    extras,
                    old_lp,
                    behaviour_lp,
                    adv,
                    critic,
                    mask,
                    is_clip,
                    critic_only,
                    prefix,
                )
                if critic_only:
                    for p in self.actor:
                        p.grad = None  # (AdamW leaves a parameter without a gradient as it is)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, cfg.max_grad_norm)
                if isinstance(grad_norm, DTensor):  # sharded: the norm over every rank's shards
                    grad_norm = grad_norm.full_tensor()
                step["train/grad_norm"] = grad_norm
                # (under DDP every rank sees the same averaged gradient, so all skip the same steps)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                for k, v in step.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
                epoch_kl += float(step["train/approx_kl"]) / steps
                if self.stop_asked():
                    break
            if self.stop_asked():
                stopped_early = 1.0  # a shorter update, whole: the checkpoint of a run stopping
                break
            if cfg.target_kl is not None and self._mean_over_ranks(epoch_kl) > cfg.target_kl:
                stopped_early = 1.0  # the policy moved far enough from the one that collected the data
                break
        self.policy.eval()
        out = {k: v / count for k, v in sums.items()}
        out["train/stopped_early"] = stopped_early
        out["train/nonfinite_steps"] = float(skipped)
        out["train/critic_only"] = float(critic_only)
        out["train/proximal_rows"] = float(which.sum())  # rows the proximal pass valued (of B)
        out["train/cached_prefix"] = float(prefix is not None)
        out.update(metrics)
        return out

    def _accumulate(
        self,
        idx: torch.Tensor,
        parts: tuple[torch.Tensor, ...],
        obs: dict[str, torch.Tensor],
        chunk: torch.Tensor,
        extras: dict[str, torch.Tensor],
        old_lp: torch.Tensor,
        behaviour_lp: torch.Tensor | None,
        adv: torch.Tensor,
        critic: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
        is_clip: float,
        critic_only: bool = False,
        prefix: Any = None,
    ) -> dict[str, torch.Tensor]:
        """The gradient of minibatch `idx`'s loss, one backward pass per part (micro-batch) adding up to it: every
        part's terms are divided by the whole minibatch's counts. `critic`: each row's value target and the value
        the clip holds it near (None: no critic); `prefix`: every row's frozen prefix (None: each pass runs it).
        Returns the minibatch's loss terms and stats."""
        cfg = self.cfg
        level = cfg.get("logprob_level", "action")
        m = mask[idx].float()
        actions = m.sum().clamp_min(1.0)
        units = by_level(m, mask[idx], level)[1].float().sum().clamp_min(1.0)  # what one ratio is over
        # without a critic the value head gets no loss (and no gradient); rows that executed no action (a failed
        # simulator's, a stale chunk's) have no return to learn from
        value_rows = m.amax(-1).sum().clamp_min(1.0)
        out: dict[str, torch.Tensor] = {}
        for i, part in enumerate(parts):
            with self._sync_gradients(i == len(parts) - 1):
                new_lp, entropy, value = self.model(
                    _rows(obs, part), chunk[part], _rows(extras, part), _rows(prefix, part)
                )
                pm = mask[part].float()
                pg_loss, stats = ppo_loss(
                    new_lp,
                    old_lp[part],
                    adv[part],
                    mask[part],
                    cfg.clip,
                    None if behaviour_lp is None else behaviour_lp[part],
                    is_clip,
                    units,
                    cfg.clip_high,
                    level,
                    cfg.get("dual_clip"),
                )
                ent = (entropy * pm).sum() / actions
                actor = 0.0 if critic_only else 1.0
                loss = actor * (pg_loss - cfg.entropy_coef * ent)
                if critic is not None:  # (GRPO's config has no value keys: it has no critic)
                    rows_loss = value_loss(value, critic[0][part], critic[1][part], cfg.value_clip, cfg.huber_delta)
                    v_loss = (rows_loss * pm.amax(-1)).sum() / value_rows
                    loss = loss + cfg.value_coef * v_loss
                loss.backward()
            terms = {"losses/policy": pg_loss.detach(), "losses/entropy": ent.detach(), **stats}
            if critic is not None:
                terms["losses/value"] = v_loss.detach()
            for k, v in terms.items():
                out[k] = out[k] + v if k in out else v
        return out

    def _sync_gradients(self, last: bool) -> contextlib.AbstractContextManager:
        """Under DDP, all-reduce the gradients at the minibatch's last backward pass only."""
        if last or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _max_over_ranks(self, value: int) -> int:
        """The largest `value` of the data-parallel ranks (this one's without a group)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def _mean_over_ranks(self, value: float) -> float:
        """`value` averaged over the data-parallel ranks, so that they all take the same decision (the same
        number of backward passes, which DDP needs)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, group=self.group)
        return float(t) / dist.get_world_size(self.group)


class _Evaluate(torch.nn.Module):
    """The policy's `evaluate` as a module's forward, so that DDP (which hooks forward) sees the training pass."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self, obs: dict[str, torch.Tensor], chunk: torch.Tensor, extras: dict[str, torch.Tensor], prefix: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return evaluate(self.policy, obs, chunk, extras, prefix)


def evaluate(
    policy: Policy,
    obs: dict[str, torch.Tensor],
    chunk: torch.Tensor,
    extras: dict[str, torch.Tensor],
    prefix: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`policy.evaluate`, given the rows' frozen prefix where there is one (a user's own policy class may take no
    `prefix`: docs/extend/own-classes.md)."""
    if prefix is None:
        return policy.evaluate(obs, chunk, extras)
    return policy.evaluate(obs, chunk, extras, prefix=prefix)
