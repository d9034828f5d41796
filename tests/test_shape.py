"""The rollout's shape (ebrl/shape.py): its sizes worked out once from the config, and the memory check, the GPU cost
model and the trainer taking the same micro-batch from it."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from ebrl.shape import RolloutShape, micro_rows, minibatch_rows
from tests.conftest import compose_config
from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout

# 4 envs x 3 chunks: 12 rows, 2 minibatches of 6; a micro-batch of 10 is more than a minibatch holds
OVERSIZED = (
    "policy=openpi",
    "scheduler=colocated",
    "hw=h200x1",
    "env.num_envs=4",
    "algo.rollout_chunks=3",
    "algo.minibatches=2",
    "algo.epochs=1",
    "algo.micro_batch=10",
)


def test_ppo_sizes_come_from_the_config() -> None:
    cfg = compose_config(
        "env.num_envs=8",
        "scheduler=ebrl",
        "scheduler.groups=2",
        "algo.rollout_chunks=5",
        "algo.minibatches=4",
        "algo.micro_batch=3",
    )
    shape = RolloutShape.of(cfg)
    assert (shape.envs, shape.group_size, shape.groups, shape.envs_per_group) == (8, 1, 2, 4)
    assert (shape.chunks, shape.rows, shape.minibatch_rows, shape.micro_rows) == (5, 40, 10, 3)
    assert RolloutShape.of(cfg, envs=16).rows == 80  # (a benchmark's prediction at another count)


def test_grpo_chunks_wait_for_the_episode() -> None:
    cfg = compose_config(
        "algo=grpo", "algo.group_size=2", "env.num_envs=4", "algo.minibatches=1", "algo.micro_batch=null"
    )
    before = RolloutShape.of(cfg)  # (the checks: no env spec yet)
    assert (before.group_size, before.units, before.chunks, before.rows, before.micro_rows) == (2, 2, None, None, None)
    after = RolloutShape.of(cfg, max_episode_steps=24, execute=5)
    assert (after.chunks, after.rows, after.minibatch_rows, after.micro_rows) == (5, 20, 20, 20)


def test_the_global_batch_is_shared_over_the_ranks() -> None:
    algo = compose_config("algo.global_batch=64", "algo.micro_batch=100").algo
    assert minibatch_rows(algo, 128) == 64 and minibatch_rows(algo, 128, ranks=2) == 32
    assert micro_rows(algo, minibatch_rows(algo, 128, ranks=2)) == 32  # a pass holds at most a minibatch
    plain = OmegaConf.to_container(compose_config("algo.global_batch=64").algo, resolve=True)
    assert minibatch_rows(plain, 128, ranks=2) == 32  # (a process's plain copy of the config reads the same)


def trainer_rows(cfg) -> int:
    """The most rows one forward/backward pass of PPOTrainer.update takes on a rollout of cfg's shape."""
    from ebrl.policies.build import build_policy
    from ebrl.rl.ppo import PPOTrainer

    torch.manual_seed(0)
    policy = build_policy(OmegaConf.to_container(cfg.policy, resolve=True), LIFT_SPEC, train=True)
    batch = one_episode_rollout(policy, chunks=cfg.algo.rollout_chunks, num_envs=cfg.env.num_envs)
    seen, evaluate = [], policy.evaluate

    def counted(obs, *args, **kwargs):
        seen.append(len(obs["state"]))
        return evaluate(obs, *args, **kwargs)

    policy.evaluate = counted
    PPOTrainer(policy, cfg.algo).update(batch)
    return max(seen)


def test_the_memory_check_sizes_the_micro_batch_the_trainer_takes(monkeypatch, tmp_path) -> None:
    """algo.micro_batch beyond a minibatch: the trainer's passes hold a minibatch, and so do the memory model's
    sizes in the run's memory check (Placement.check_memory), the at-scale benchmark's memory line and the GPU cost
    model's update (a micro-batch of algo.micro_batch there would count more activations than any pass holds)."""
    import ebrl.alloc.memory
    import ebrl.forecast.gpu_cost as gpu_cost
    import ebrl.runtime.placement
    from ebrl.bench.at_scale import gpu_memory
    from ebrl.node import Ranks
    from ebrl.runtime.placement import Placement

    cfg = compose_config(*OVERSIZED)
    trained = trainer_rows(cfg)
    assert trained == 6 == RolloutShape.of(cfg).micro_rows

    sized = []
    fitting = ebrl.alloc.memory.fitting_strategy

    def recorded(model, gpu_bytes, num_envs, micro_batch, *args, **kwargs):
        sized.append(micro_batch)
        return fitting(model, gpu_bytes, num_envs, micro_batch, *args, **kwargs)

    monkeypatch.setattr(ebrl.runtime.placement, "fitting_strategy", recorded)
    Placement(cfg, [0, 1], torch.device("cuda"), tmp_path, Ranks()).check_memory(LIFT_SPEC)  # (the meta device)
    assert sized == [trained]

    _, line = gpu_memory(cfg, int(cfg.env.num_envs), cameras=0)
    assert f"micro-batch {trained}," in line

    passes = []
    roofline = gpu_cost.roofline

    def timed(ops, rows, *args, **kwargs):
        passes.append(rows)
        return roofline(ops, rows, *args, **kwargs)

    ops = gpu_cost.PolicyOps.of(OmegaConf.to_container(cfg.policy, resolve=True), LIFT_SPEC)
    monkeypatch.setattr(gpu_cost, "roofline", timed)
    rows = RolloutShape.of(cfg).rows  # (with a proximal pass over every row, a micro-batch at a time as well)
    gpu_cost.train_time(ops, rows, gpu_cost.UpdateShape(cfg.algo), gpu_cost.GPUS["H200"], 1.0, 0.0, proximal=rows)
    assert max(passes) == trained
