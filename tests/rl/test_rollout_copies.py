"""Observations on the hot path: one copy from the simulators' slots into a policy batch, one more into the
iteration's (T, N, ...) place, uint8 throughout, and a batch in shared memory reaches another process as a handle."""

import numpy as np
import torch
import torch.multiprocessing as mp

from ebrl.rl.rollout import ChunkStep, batch_obs, concat_envs, pad_steps, stack_group_obs, stack_steps


def _obs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "image/agentview": torch.randint(0, 256, (n, 4, 4, 3), generator=g, dtype=torch.uint8),
        "state": torch.randn(n, 5, generator=g),
    }


def _steps(n: int, t: int, seed: int) -> list[ChunkStep]:
    steps = []
    for i in range(t):
        s = ChunkStep(
            obs=_obs(n, seed + i),
            chunk=torch.zeros(n, 2, 1),
            extras={},
            log_prob=torch.zeros(n, 2),
            value=torch.zeros(n),
            version=torch.zeros(n, dtype=torch.long),
        )
        s.reward, s.done, s.mask = torch.zeros(n), torch.zeros(n, dtype=torch.bool), torch.ones(n, 2, dtype=torch.bool)
        s.cutoff_value = torch.zeros(n)
        steps.append(s)
    return steps


def test_an_iterations_observations_go_into_place_in_one_copy_as_stacking_padding_and_joining_put_them():
    a, b = _steps(2, 3, seed=0), _steps(3, 2, seed=10)  # an episodic group may end after fewer chunk steps
    joined = concat_envs([pad_steps(stack_steps(s, torch.zeros(len(s[0].value))), 3) for s in (a, b)])
    placed = stack_group_obs([[s.obs for s in a], [s.obs for s in b]], 3, shared=True)
    assert placed.keys() == joined.obs.keys()
    for k, v in joined.obs.items():
        assert placed[k].dtype == v.dtype and torch.equal(placed[k], v), k
        assert placed[k].is_shared()
    assert placed["image/agentview"].dtype == torch.uint8  # (the rollout keeps images as the simulator made them)
    assert stack_steps(a, torch.zeros(2), with_obs=False).obs == {}


def _fill(conn) -> None:
    for tensor in iter(conn.recv, None):
        tensor.fill_(7)
        conn.send("done")


def test_a_shared_policy_batch_reaches_another_process_as_a_handle_not_a_copy():
    per_env = [{"image/agentview": np.full((4, 4, 3), i, np.uint8)} for i in range(3)]
    tokens, mask = torch.arange(12).view(4, 3), torch.ones(4, 3, dtype=torch.bool)
    shared = batch_obs(per_env, tokens, mask, [2, 0, 1], shared=True)
    plain = batch_obs(per_env, tokens, mask, [2, 0, 1])
    for k in shared:
        assert torch.equal(shared[k], plain[k]) and shared[k].is_shared() and not plain[k].is_shared()
    assert shared["image/agentview"][:, 0, 0, 0].tolist() == [0, 1, 2] and shared["tokens"][0].tolist() == [6, 7, 8]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fill, args=(child,), daemon=True)
    proc.start()
    try:
        image = shared["image/agentview"]
        pointer = image.data_ptr()
        parent.send(image)
        assert parent.recv() == "done"
        assert image.eq(7).all() and image.data_ptr() == pointer  # the child wrote into this very memory
        unshared = plain["image/agentview"]
        pointer = unshared.data_ptr()
        parent.send(unshared)  # the control: torch first copies a tensor that is not shared into a new segment
        assert parent.recv() == "done"
        assert unshared.data_ptr() != pointer
    finally:
        parent.send(None)
        proc.join(30)
