"""GRPO: group-relative advantages by hand, grouped seeds, config checks, an update with every
policy family and a real run.py end to end."""

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ebrl.checks import ALGOS, validate
from ebrl.config import ConfigError
from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.envs.worker import ChunkReport
from ebrl.policies.build import build_policy
from ebrl.rl.grpo import GRPOTrainer, first_episode, group_advantages, group_seeds
from ebrl.rl.rollout import ChunkStep, RolloutBatch, RolloutStats, drop_stale, stack_steps
from tests.conftest import compose_config, group_options
from tests.runs.test_run import SMALL_GRPO, metrics, run_py

LIFT_SPEC = EnvSpec(
    obs={"state": ArraySpec((60,), "float32")}, action_dim=7, instruction="lift the red cube", max_episode_steps=24
)


def test_group_advantages_by_hand():
    # 3 chunk steps x 4 envs, groups {0, 1} and {2, 3}; env 0 ends in step 1, so its reward in step 2
    # (a next episode's) does not count; envs 2 and 3 tie, so their group carries no signal
    reward = torch.tensor([[1.0, 0.5, 2.0, 1.0], [2.0, 0.5, 0.0, 1.0], [100.0, 0.0, 0.0, 0.0]])
    done = torch.tensor([[False, False, False, False], [True, False, False, False], [False, True, True, True]])
    adv, ret, std = group_advantages(reward, done, group_size=2)
    assert torch.allclose(ret, torch.tensor([3.0, 1.0, 2.0, 2.0]))
    assert torch.allclose(std, torch.tensor([1.0, 0.0]))  # population std: (3 - 1) / 2
    a = 1.0 / (1.0 + 1e-6)  # (3 - 2) / (1 + eps)
    expected = torch.tensor(
        [[a, -a, 0.0, 0.0], [a, -a, 0.0, 0.0], [0.0, -a, 0.0, 0.0]]
    )  # env 0's step 2 is after its episode: 0
    assert torch.allclose(adv, expected)


def test_an_env_whose_episode_was_discarded_is_no_group_member():
    # one group of 3; env 1's simulator failed mid-episode (its partial return 9 must not move the others)
    reward = torch.tensor([[1.0, 9.0, 3.0]])
    done = torch.ones(1, 3, dtype=torch.bool)
    adv, _, std = group_advantages(reward, done, group_size=3, valid=torch.tensor([True, False, True]))
    a = 1.0 / (1.0 + 1e-6)  # (3 - 2) / (1 + eps): mean 2 and std 1 of envs 0 and 2
    assert torch.allclose(adv, torch.tensor([[-a, 0.0, a]])) and torch.allclose(std, torch.tensor([1.0]))
    assert torch.equal(
        group_advantages(reward, done, 3, torch.ones(3, dtype=torch.bool))[0], group_advantages(reward, done, 3)[0]
    )  # all valid: as before


def returns_batch(reward: torch.Tensor, done: torch.Tensor, mask: torch.Tensor | None = None) -> RolloutBatch:
    """A (T, N) batch with what advantages read: rewards, dones and the loss mask (one action per chunk step)."""
    T, N = reward.shape
    return RolloutBatch(
        obs={},
        chunk=torch.zeros(T, N, 1, 1),
        extras={},
        log_prob=torch.zeros(T, N, 1),
        value=torch.zeros(T, N),
        reward=reward,
        done=done,
        mask=torch.ones(T, N, 1, dtype=torch.bool) if mask is None else mask,
        last_value=torch.zeros(N),
        cutoff_value=torch.zeros(T, N),
    )


def test_exact_ties_carry_no_signal():
    # two groups of 8: bitwise-equal returns of 3.7, whose float32 mean is one ulp off; and 3.7 beside its float32
    # neighbour, a spread within EPS that groups_without_signal counts: both must get advantage 0, not +-0.2
    tie = torch.full((8,), 3.7)
    near = tie.clone()
    near[0] = torch.nextafter(tie[0], torch.tensor(4.0))
    reward = torch.cat([tie, near]).view(1, 16)
    done = torch.ones(1, 16, dtype=torch.bool)
    adv, _, std = group_advantages(reward, done, group_size=8)
    assert torch.equal(adv, torch.zeros(1, 16))
    trainer = GRPOTrainer(policy_of("openpi"), compose_config("algo=grpo", "algo.group_size=8").algo)
    adv, _, metrics = trainer.advantages(returns_batch(reward, done))
    assert torch.equal(adv, torch.zeros(1, 16)) and metrics["train/groups_without_signal"] == 1.0


def chunk_report(reward: float, terminated: bool = False, truncated: bool = False) -> ChunkReport:
    """One env's chunk of one step, as its simulator reports it."""
    return ChunkReport(
        executed=1,
        rewards=np.array([reward], np.float32),
        successes=np.array([terminated]),
        step_times=np.zeros(1),
        terminated=terminated,
        truncated=truncated,
        episode=None,
    )


def test_a_stale_episode_stays_in_its_groups_baseline():
    # one group of 4: env 0 succeeds at once (return 1), sampled by weights one version older than the others'
    # chunks; envs 1 and 2 fail (0) at their step limit; env 3's simulator fails, so its episode is discarded
    stats, steps = RolloutStats(), []
    reports = [
        [chunk_report(1.0, terminated=True), chunk_report(0.0), chunk_report(0.0), chunk_report(0.0)],
        [
            ChunkReport.nothing(),
            chunk_report(0.0, truncated=True),
            chunk_report(0.0, truncated=True),
            ChunkReport.nothing(truncated=True, failed="died"),
        ],
    ]
    for t, step_reports in enumerate(reports):
        step = ChunkStep(
            obs={},
            chunk=torch.zeros(4, 1, 1),
            extras={},
            log_prob=torch.zeros(4, 1),
            value=torch.zeros(4),
            version=torch.tensor([0, t + 1, t + 1, t + 1]),
        )
        step.record(step_reports, stats, steps)
        steps.append(step)
    batch = stack_steps(steps, torch.zeros(4))
    trainer = GRPOTrainer(policy_of("openpi"), compose_config("algo=grpo").algo)
    before = trainer.advantages(batch)[0]
    a = 2**0.5 / (1.0 + 1e-6)  # returns 1, 0, 0 of the three that finished: mean 1/3, std sqrt(2)/3
    assert torch.allclose(before[0], torch.tensor([a, -a / 2, -a / 2, 0.0]))
    assert drop_stale(batch, train_version=2, max_staleness=1)[0] == 1 and not batch.mask[:, 0].any()
    assert torch.equal(trainer.advantages(batch)[0][:, 1:], before[:, 1:])  # the failures keep their -0.707


def test_first_episode_masks_what_follows_the_first_end():
    done = torch.tensor([[False, True], [True, False], [False, True]])
    assert first_episode(done).tolist() == [[True, True], [True, False], [False, False]]


def test_group_advantages_need_whole_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.bool), group_size=4)


def test_group_seeds_are_shared_within_a_group_and_distinct_across_groups_and_iterations():
    first, second = group_seeds(0, 0, 8, 4), group_seeds(0, 1, 8, 4)
    assert first[:4] == [first[0]] * 4 and first[4:] == [first[4]] * 4 and first[0] != first[4]
    assert not set(first) & set(second)
    assert group_seeds(0, 0, 8, 4) == first  # a function of (seed, iteration, group) only
    assert not set(group_seeds(1, 0, 8, 4)) & set(first)
    assert all(0 <= s < 2**31 for s in group_seeds(10**9, 10**6, 8, 2))


def policy_of(family: str):
    torch.manual_seed(0)
    return build_policy(OmegaConf.to_container(compose_config(f"policy={family}").policy, resolve=True), LIFT_SPEC)


def one_episode_rollout(policy, chunks: int = 2, num_envs: int = 4):
    """What collect(reset_seeds=...) returns, from the policy's own samples on made-up states: env 0's
    episode ends in the first chunk (its later actions are masked), the others' in the last."""
    gen = torch.Generator().manual_seed(1)
    spec = policy.env_spec
    tokens, token_mask = (torch.from_numpy(a) for a in policy.tokenize([spec.instruction] * num_envs))
    steps = []
    for t in range(chunks):
        obs = {
            "state": torch.randn(num_envs, spec.obs["state"].shape[0], generator=gen),
            "tokens": tokens,
            "token_mask": token_mask,
        }
        out = policy.sample(obs)
        done = torch.tensor([t == 0] + [t == chunks - 1] * (num_envs - 1))
        mask = torch.ones(num_envs, policy.chunk_len, dtype=torch.bool)
        mask[0] = t == 0
        reward = torch.rand(num_envs, generator=gen) * mask.any(1)
        steps.append(
            ChunkStep(
                obs=obs,
                chunk=out.chunk,
                extras=out.extras,
                log_prob=out.log_prob,
                value=out.value,
                reward=reward,
                done=done,
                mask=mask,
                cutoff_value=torch.zeros(num_envs),
            )
        )
    return stack_steps(steps, torch.zeros(num_envs))


GRPO_SMALL = ("algo=grpo", "algo.group_size=2", "algo.epochs=1", "algo.minibatches=1")


@pytest.mark.parametrize("family", group_options("policy"))
def test_grpo_updates_every_policy_family(family):
    policy = policy_of(family)
    before = [p.detach().clone() for p in policy.parameters()]
    out = GRPOTrainer(policy, compose_config(*GRPO_SMALL).algo).update(one_episode_rollout(policy))
    assert "losses/value" not in out and "train/explained_variance" not in out  # no critic
    assert out["train/group_return_std"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in out.values()), out
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_grpo_update_ignores_what_follows_an_episode_end():
    # the same rollout, except that env 0's chunks after its end are unmasked and rewarded (as if the env
    # had gone on into another episode): the update must not see them
    policy = policy_of("openpi")
    batch = one_episode_rollout(policy)
    leaked = copy.deepcopy(batch)
    leaked.mask[1:, 0] = True
    leaked.reward[1:, 0] = 100.0
    results = []
    for b in (batch, leaked):
        p = copy.deepcopy(policy)
        torch.manual_seed(0)  # the same minibatch order
        GRPOTrainer(p, compose_config(*GRPO_SMALL).algo).update(b)
        results.append(list(p.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_every_algo_has_a_config_and_a_trainer():
    from ebrl.rl.trainers import TRAINERS

    assert set(ALGOS) == set(group_options("algo")) == set(TRAINERS)
    validate(compose_config("algo=grpo"))  # the defaults: 8 envs in groups of 4


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["env.num_envs=6"],
            "env.num_envs=6 is not a multiple of algo.group_size=4; with algo=grpo use env.num_envs=4, 8",
        ),
        (["algo.group_size=1"], "algo.group_size=1 must be at least 2"),
        (["algo.minibatches=3"], "algo.minibatches=3 does not divide env.num_envs=8"),
    ],
)
def test_groups_that_cannot_work(overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(compose_config("algo=grpo", *overrides))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("schedule", ["colocated", "hybrid", "ebrl"])
def test_a_rollout_runs_one_episode_per_env_from_its_groups_reset(schedule, tmp_path):
    """Under any schedule (hybrid and ebrl: each of their 2 groups is one GRPO group, running and resetting on its
    own; ebrl's overlapping the update)."""
    from ebrl.runs.experiment import Experiment

    exp = Experiment.from_config(
        compose_config(
            f"scheduler={schedule}",
            "algo=grpo",
            "env.num_envs=4",
            "algo.group_size=2",
            "algo.minibatches=2",
            "env.max_episode_steps=12",
            "iterations=1",
            "progress=false",
            "logger=none",
        ),
        run_dir=tmp_path / "run",
    )
    batches = []
    train = exp.scheduler.trainer.train
    exp.scheduler.trainer.train = lambda iteration, batch, **how: (
        batches.append(batch),
        train(iteration, batch, **how),
    )
    try:
        assert exp.policy.chunk_len == 8  # the 12-step episodes end 4 steps into the second chunk
        stats, metrics = exp.scheduler.next_iteration()
    finally:
        exp.close()
    batch = batches[0]
    first = batch.obs["state"][0]
    assert torch.equal(first[0], first[1]) and torch.equal(first[2], first[3]) and not torch.equal(first[0], first[2])
    assert batch.chunk.shape[:2] == (2, 4)  # every episode ended in chunk 2: no more were collected
    assert batch.mask[0].all() and batch.mask[1, :, :4].all() and not batch.mask[1, :, 4:].any()
    assert batch.done[1].all() and not batch.done[0].any()
    assert stats.env_steps == 4 * 12 and stats.lengths == [12] * 4  # the auto-reset after each end ran no step
    assert not batch.cutoff_value.any() and not batch.last_value.any()  # nothing to bootstrap
    assert "train/group_return_std" in metrics and batch.version.eq(0).all()  # sampled by the first weights
    # overlapping schedules correct the staleness in GRPO's ratio as in PPO's (decoupled: the behaviour weight)
    assert ("train/is_weight_mean" in metrics) == (schedule == "ebrl")


@pytest.mark.slow  # (the default suite's time)
def test_grpo_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "r"
    proc = run_py(
        *SMALL_GRPO,
        "algo=grpo",
        "env.num_envs=4",
        "algo.group_size=2",
        "env.max_episode_steps=16",
        "iterations=2",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EBRL run summary" in proc.stdout
    rows = metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    steps = [b["env_steps"] - a["env_steps"] for a, b in zip([{"env_steps": 0}] + rows, rows)]
    for row, n in zip(rows, steps):
        # one whole episode per env, and not a step more: env steps = the episodes' lengths
        assert row["env/episodes"] == 4 and n == round(4 * row["env/episode_length"]) and 0 < n <= 4 * 16
        assert "train/group_return_std" in row and "losses/policy" in row and "losses/value" not in row
    assert (run_dir / "checkpoints" / "last.pt").is_file()
