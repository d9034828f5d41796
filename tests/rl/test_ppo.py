"""PPO maths on hand-computed cases, and the decoupled (staleness-corrected) loss and update."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ebrl.policies.build import build_policy
from ebrl.rl.ppo import PPOTrainer, compute_gae, ppo_loss
from ebrl.rl.rollout import ChunkStep, RolloutBatch, stack_steps
from tests.conftest import compose_config
from tests.policies.test_precision import policy_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout, policy_of


def test_gae_by_hand():
    # two chunk steps, one env; the episode ends in the second chunk, so last_value is ignored
    reward = torch.tensor([[1.0], [2.0]])
    value = torch.tensor([[0.5], [1.0]])
    done = torch.tensor([[False], [True]])
    last_value = torch.tensor([10.0])
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(reward, value, done, last_value, gamma, lam)
    d1 = 2.0 - 1.0  # terminal: no bootstrap
    d0 = 1.0 + 0.9 * 1.0 - 0.5
    assert torch.allclose(adv[1], torch.tensor([d1]))
    assert torch.allclose(adv[0], torch.tensor([d0 + gamma * lam * d1]))
    assert torch.allclose(ret, adv + value)


def test_gae_bootstraps_when_alive():
    adv, _ = compute_gae(
        torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.tensor([[False]]), torch.tensor([2.0]), 0.5, 1.0
    )
    assert torch.allclose(adv, torch.tensor([[1.0]]))


def test_ppo_loss_by_hand():
    # two chunks of two actions; the second action of chunk 1 was never executed (masked)
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = ppo_loss(new, old, adv, mask, clip=0.2)
    # chunk 0, action 0: ratio 1.5, adv +1 -> min(1.5, 1.2) = 1.2
    # chunk 0, action 1: ratio 0.5, adv +1 -> min(0.5, 0.8) = 0.5
    # chunk 1, action 0: ratio 1.1, adv -2 -> min(-2.2, -2.2) = -2.2
    expected = -(1.2 + 0.5 - 2.2) / 3
    assert abs(loss.item() - expected) < 1e-6
    assert abs(stats["train/clipfrac"].item() - 2 / 3) < 1e-6


def test_ppo_loss_gradient_zero_when_clipped():
    new = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, _ = ppo_loss(new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), clip=0.2)
    loss.backward()
    assert new.grad.abs().item() == 0.0


def test_gae_bootstraps_a_cut_off_episode_from_its_last_obs():
    # the episode hit its step limit in the only chunk: bootstrap from the value of the obs it was cut off on,
    # never from the next episode's first obs (last_value)
    reward, value, done = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[True]])
    adv, _ = compute_gae(reward, value, done, torch.tensor([100.0]), 0.9, 0.95, cutoff_value=torch.tensor([[2.0]]))
    assert torch.allclose(adv, torch.tensor([[1.0 + 0.9 * 2.0 - 0.5]]))


def test_decoupled_loss_with_behaviour_equal_to_proximal_is_the_plain_loss():
    g = torch.Generator().manual_seed(0)
    new = (0.3 * torch.randn(4, 3, generator=g)).requires_grad_()
    old = 0.3 * torch.randn(4, 3, generator=g)
    adv, mask = torch.randn(4, generator=g), torch.rand(4, 3, generator=g) > 0.3
    plain, plain_stats = ppo_loss(new, old, adv, mask, clip=0.2)
    (plain_grad,) = torch.autograd.grad(plain, new)
    decoupled, stats = ppo_loss(new, old, adv, mask, clip=0.2, behaviour_log_prob=old.clone())
    (grad,) = torch.autograd.grad(decoupled, new)
    assert torch.equal(decoupled, plain) and torch.equal(grad, plain_grad)
    assert all(torch.equal(stats[k], v) for k, v in plain_stats.items())
    assert stats["train/is_weight_mean"].item() == 1.0 and stats["train/is_truncated"].item() == 0.0


def test_decoupled_weight_truncates_at_is_clip():
    # proximal = new (ratio 1, surrogate = advantage); the behaviour policy was less likely on some actions
    old = torch.zeros(2, 2)
    behaviour = torch.tensor([[-1.0, 0.0], [-0.1, -5.0]])  # raw weights e, 1, e^0.1, e^5 (never executed)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = ppo_loss(old.clone(), old, adv, mask, clip=0.2, behaviour_log_prob=behaviour, is_clip=2.0)
    w = [2.0, 1.0, math.exp(0.1)]  # e -> 2: truncated
    assert abs(loss.item() - -(w[0] * 1.0 + w[1] * 1.0 + w[2] * -2.0) / 3) < 1e-6
    assert abs(stats["train/is_weight_mean"].item() - sum(w) / 3) < 1e-6
    assert abs(stats["train/is_truncated"].item() - 1 / 3) < 1e-6  # the masked e^5 does not count
    with pytest.raises(ValueError, match="is_clip=0"):
        ppo_loss(old, old, adv, mask, clip=0.2, behaviour_log_prob=behaviour, is_clip=0)


def test_decoupled_gradient_is_the_plain_gradient_scaled_by_the_weight():
    # one chunk of two actions inside the clip range, advantage 1: d loss / d new_i = -ratio_i / 2 unweighted
    new = torch.tensor([[math.log(1.1), math.log(0.9)]], requires_grad=True)
    old = torch.zeros(1, 2)
    behaviour = torch.tensor([[math.log(0.5), math.log(2.0)]], requires_grad=True)  # raw weights 2 and 0.5
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool)
    loss, _ = ppo_loss(new, old, adv, mask, clip=0.2, behaviour_log_prob=behaviour, is_clip=1.5)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-1.5 * 1.1 / 2, -0.5 * 0.9 / 2]]))  # 2 truncated to 1.5
    assert behaviour.grad is None  # the weight is a constant


def test_decoupled_update_on_a_real_policy():
    # the rollout's log-probs come from these weights: no staleness, so the weights are ~1 and none truncates
    policy = policy_of("openpi")
    batch = one_episode_rollout(policy)
    algo = compose_config("algo=ppo", "algo.epochs=1", "algo.minibatches=2").algo
    trainer = PPOTrainer(policy, algo)
    flat = (
        {k: v.flatten(0, 1) for k, v in batch.obs.items()},
        batch.chunk.flatten(0, 1),
        {k: v.flatten(0, 1) for k, v in batch.extras.items()},
    )
    with torch.no_grad():
        whole_lp, _, whole_value = policy.evaluate(*flat)
    log_prob, value = trainer.proximal(*flat, rows=3)  # 8 rows in 3 + 3 + 2
    assert torch.allclose(log_prob, whole_lp, atol=1e-5) and torch.allclose(value, whole_value, atol=1e-5)
    out = trainer.update(batch, decoupled=True)
    assert abs(out["train/is_weight_mean"] - 1.0) < 1e-2 and out["train/is_truncated"] == 0.0, out
    assert all(math.isfinite(v) for v in out.values()), out
    # the same data, as if sampled by weights that made every action e times less likely: all truncated at 2
    policy = policy_of("openpi")
    batch.log_prob -= 1.0
    out = PPOTrainer(policy, algo).update(batch, decoupled=True, is_clip=2.0)
    assert abs(out["train/is_weight_mean"] - 2.0) < 1e-5 and out["train/is_truncated"] == 1.0, out
    assert "train/is_weight_mean" not in PPOTrainer(policy, algo).update(batch)


def test_decoupled_update_takes_advantages_from_the_current_critic():
    # values recorded by an older critic (here: absurd ones) do not reach the advantages of a decoupled update
    policy = policy_of("openpi")
    batch = one_episode_rollout(policy)
    algo = compose_config("algo=ppo", "algo.epochs=1", "algo.minibatches=2").algo
    with torch.no_grad():
        current = policy.evaluate(
            {k: v.flatten(0, 1) for k, v in batch.obs.items()},
            batch.chunk.flatten(0, 1),
            {k: v.flatten(0, 1) for k, v in batch.extras.items()},
        )[2]
    batch.value += 100.0
    rows = batch.mask.any(-1)  # (the metrics are over the rows in the loss)
    out = PPOTrainer(policy, algo).update(batch, decoupled=True)
    assert abs(out["train/value_mean"] - float(current[rows.flatten()].mean())) < 1e-4, out
    plain = PPOTrainer(policy_of("openpi"), algo).update(batch)  # synchronous: the recorded values are current
    assert abs(plain["train/value_mean"] - float(batch.value[rows].mean())) < 1e-4


def test_rows_that_executed_nothing_do_not_move_the_advantage_normalisation():
    """Env 0's episode ends in the first chunk: its later rows execute nothing, so their advantages (here made huge
    through their values, which reach no other row's) must not shift or scale the others'."""
    results = []
    for masked_value in (None, 100.0):
        torch.manual_seed(0)
        policy = build_policy(policy_config("openpi"), LIFT_SPEC, train=True)
        batch = one_episode_rollout(policy, chunks=3, num_envs=4)
        if masked_value is not None:
            batch.value[1:, 0] = masked_value
        torch.manual_seed(1)
        PPOTrainer(policy, compose_config("algo.minibatches=1", "algo.epochs=1").algo).update(batch)
        results.append([p.detach().clone() for p in policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def rollout_with_bootstraps(policy, recorded: float):
    """Two chunk steps of 4 envs that never end, except env 1's episode, cut off at its step limit in the first;
    `recorded` stands for the bootstrap values generation recorded (by other weights than the trainer's)."""
    gen = torch.Generator().manual_seed(2)
    n, spec = 4, policy.env_spec
    tokens, token_mask = (torch.from_numpy(a) for a in policy.tokenize([spec.instruction] * n))

    def obs():
        return {
            "state": torch.randn(n, spec.obs["state"].shape[0], generator=gen),
            "tokens": tokens,
            "token_mask": token_mask,
        }

    torch.manual_seed(3)
    steps = []
    for t in range(2):
        o = obs()
        out = policy.sample(o)
        step = ChunkStep(
            obs=o,
            chunk=out.chunk,
            extras=out.extras,
            log_prob=out.log_prob,
            value=out.value,
            reward=torch.rand(n, generator=gen),
            done=torch.tensor([False, t == 0, False, False]),
            mask=torch.ones(n, policy.chunk_len, dtype=torch.bool),
            cutoff_value=torch.zeros(n),
        )
        if t == 0:
            step.cut, step.cutoff_obs = [1], {k: v[[1]] for k, v in obs().items()}
            step.cutoff_value[1] = recorded
        steps.append(step)
    return stack_steps(steps, torch.full((n,), recorded), last_obs=obs())


def test_decoupled_update_takes_the_bootstrap_values_from_the_current_critic_too():
    # GAE mixes no critics: the values after the last chunk and where an episode was cut off come from the critic
    # that values the chunk steps, not from what generation recorded
    algo = compose_config("algo=ppo", "algo.epochs=1", "algo.minibatches=2").algo
    policy = policy_of("openpi")
    batch = rollout_with_bootstraps(policy, recorded=0.0)
    assert batch.cutoff_at.tolist() == [[0, 1]] and batch.bootstrap_obs()["state"].shape[0] == 4 + 1
    values = PPOTrainer(policy, algo).values(batch.bootstrap_obs())
    fixed = batch.with_bootstrap_values(values)
    assert torch.equal(fixed.last_value, values[:4]) and fixed.cutoff_value[0, 1] == values[4]
    assert fixed.cutoff_value[0, [0, 2, 3]].eq(0).all() and fixed.cutoff_value[1].eq(0).all()
    returns = [
        PPOTrainer(policy_of("openpi"), algo).update(rollout_with_bootstraps(policy, recorded), decoupled=True)[
            "train/return_mean"
        ]
        for recorded in (0.0, 100.0)
    ]
    assert returns[0] == pytest.approx(returns[1])
    plain = [
        PPOTrainer(policy_of("openpi"), algo).update(rollout_with_bootstraps(policy, recorded))["train/return_mean"]
        for recorded in (0.0, 100.0)
    ]
    assert plain[1] > plain[0] + 10  # synchronous: generation's weights are the trainer's, and its values count


def rlinf_actor_loss(logprobs, old_logprobs, advantages, mask, clip, clip_c=None):
    """RLinf's compute_ppo_actor_loss (rlinf/algorithms/losses.py, a3816b5) for one ratio per row, as its
    chunk_level log-probs give it: max(-A r, -A clip(r)), capped at c |A| (clip_ratio_c), the masked mean."""
    ratio = torch.where(mask, (logprobs - old_logprobs).exp(), 0)
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    if clip_c is not None:
        loss = torch.min(loss, torch.sign(advantages) * clip_c * advantages)
    return (loss * mask).sum() / mask.sum()


def test_chunk_level_loss_is_rlinfs_one_ratio_per_chunk_over_its_executed_actions_and_chain_over_all():
    # three chunks of four actions, the env executes the first two (policy.execute=2); chunk 2's episode ended after
    # its first action; chunk 1 has a negative advantage with a large ratio, which the dual clip caps
    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(3, 4, generator=g) * 0.3, torch.randn(3, 4, generator=g) * 0.3
    new[1, :2] = old[1, :2] + 1.5
    adv = torch.tensor([0.7, -1.2, 0.4])
    mask = torch.tensor([[True, True, False, False], [True, True, False, False], [True, False, False, False]])
    chunk_new, chunk_old = (new * mask).sum(-1), (old * mask).sum(-1)  # RLinf: logprobs summed over dims [1, 2]
    for clip_c in (None, 3.0):
        loss, stats = ppo_loss(new, old, adv, mask, clip=0.2, level="chunk", dual_clip=clip_c)
        want = rlinf_actor_loss(chunk_new, chunk_old, adv, torch.ones(3, dtype=torch.bool), 0.2, clip_c)
        assert abs(loss.item() - want.item()) < 1e-6
    assert stats["train/clipfrac"].item() == pytest.approx(
        sum(abs(r - 1) > 0.2 for r in (chunk_new - chunk_old).exp().tolist()) / 3
    )
    # the actions never executed do not count: changing their log-probs changes nothing
    other = new.clone()
    other[~mask] += 5.0
    assert (
        ppo_loss(other, old, adv, mask, clip=0.2, level="chunk")[0]
        == ppo_loss(new, old, adv, mask, clip=0.2, level="chunk")[0]
    )

    # chain: one ratio per chunk that executed any action, over all four actions of the chain it was sampled as
    mask[2] = False  # (a padded row: no loss)
    loss = ppo_loss(new, old, adv, mask, clip=0.2, level="chain")[0]
    want = rlinf_actor_loss(new.sum(-1), old.sum(-1), adv, mask.any(-1), 0.2)
    assert abs(loss.item() - want.item()) < 1e-6
    assert ppo_loss(other, old, adv, mask, clip=0.2, level="chain")[0] != loss


def test_dual_clip_caps_a_negative_advantages_loss_per_action_too():
    new, old = torch.tensor([[math.log(5.0)], [math.log(5.0)]]), torch.zeros(2, 1)
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 1, dtype=torch.bool)
    loss, _ = ppo_loss(new, old, adv, mask, clip=0.2, dual_clip=3.0)
    # row 0: -A r = 5 -> capped at 3; row 1: min(5, 1.2) = 1.2 gains, a loss of -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert loss.item() == pytest.approx(rlinf_actor_loss(new[:, 0], old[:, 0], adv, mask[:, 0], 0.2, 3.0).item())


def test_global_batch_sets_the_rows_of_an_optimizer_step():
    from ebrl.rl.ppo import minibatch_rows

    cfg = compose_config("algo.minibatches=4").algo
    assert minibatch_rows(cfg, 80) == 20
    cfg = compose_config("algo.global_batch=32").algo
    assert minibatch_rows(cfg, 128) == 32 and minibatch_rows(cfg, 128, ranks=2) == 16
    assert minibatch_rows(cfg, 20) == 20  # a rollout smaller than the global batch is one step


def test_explained_variance_counts_only_the_rows_in_the_loss():
    # env 0's episode ends in the first chunk: its later rows execute nothing (as padded, stale and discarded rows),
    # so the values they hold (here absurd) must move no metric of the critic
    policy = policy_of("openpi")
    batch = one_episode_rollout(policy, chunks=3, num_envs=4)
    batch.value[1:, 0] = 100.0
    _, ret, metrics = PPOTrainer(policy, compose_config("algo=ppo").algo).advantages(batch)
    rows = batch.mask.any(-1)
    r, v = ret[rows].double(), batch.value[rows].double()
    assert metrics["train/explained_variance"] == pytest.approx(float(1 - (r - v).var() / r.var()))
    assert (metrics["train/value_mean"], metrics["train/return_mean"]) == pytest.approx(
        (float(v.mean()), float(r.mean()))
    )


def envs_of(batch: RolloutBatch, envs: slice) -> RolloutBatch:
    """The batch's chunk steps of some envs only (a rank's share of the global batch)."""
    return dataclasses.replace(
        batch,
        obs={k: v[:, envs] for k, v in batch.obs.items()},
        chunk=batch.chunk[:, envs],
        extras={k: v[:, envs] for k, v in batch.extras.items()},
        log_prob=batch.log_prob[:, envs],
        value=batch.value[:, envs],
        reward=batch.reward[:, envs],
        done=batch.done[:, envs],
        mask=batch.mask[:, envs],
        last_value=batch.last_value[envs],
        cutoff_value=batch.cutoff_value[:, envs],
    )


def rank_statistics(rank: int, batch: RolloutBatch, folder: Path) -> None:
    """Rank `rank` of 2 (gloo): its half of `batch`'s envs through a data-parallel trainer's advantages and their
    normalisation, written to folder/rank<rank>.pt."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=2)
    try:
        trainer = PPOTrainer(policy_of("openpi"), compose_config("algo=ppo").algo, group=dist.group.WORLD)
        half = envs_of(batch, slice(2 * rank, 2 * rank + 2))
        adv, _, metrics = trainer.advantages(half)
        normalized = trainer.normalized(adv.flatten(), half.mask.any(-1).flatten()).view_as(adv)
        torch.save({"adv": normalized, "metrics": metrics}, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_normalise_over_the_global_batch(tmp_path):
    # the recipe's values assume the global batch: 2 ranks with 2 envs each normalise, and measure the critic, as one
    # trainer with all 4 envs does (rank 0's env 0 has rows outside the loss, rank 1's envs none)
    policy = policy_of("openpi")
    batch = one_episode_rollout(policy, chunks=3, num_envs=4)
    batch.reward[:, 2:] += 1.0
    trainer = PPOTrainer(policy, compose_config("algo=ppo").algo)
    adv, _, metrics = trainer.advantages(batch)
    whole = trainer.normalized(adv.flatten(), batch.mask.any(-1).flatten()).view_as(adv)
    ctx = torch.multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=rank_statistics, args=(rank, batch, tmp_path)) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(out["adv"], whole[:, 2 * rank : 2 * rank + 2], atol=1e-5)
        assert out["metrics"] == pytest.approx(metrics)
