"""PPO maths on hand-computed cases."""
import math

import torch

from ebrl.rl.ppo import compute_gae, ppo_loss


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
    adv, _ = compute_gae(torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.tensor([[False]]), torch.tensor([2.0]), 0.5, 1.0)
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
