"""GRPO advantages and the clipped, importance-weighted token loss, against hand-computed values."""

from __future__ import annotations

import math

import torch

from kiln.learner.grpo import group_advantages, ppo_clip_loss


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=False) == [0.5, -0.5, -0.5, 0.5]
    a = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, [1, -1, -1, 1]))
    assert group_advantages([0.0, 0.0, 0.0], std_normalize=True) == [0.0, 0.0, 0.0]
    assert group_advantages([], std_normalize=False) == []


def test_ppo_clip_loss_by_hand():
    # two sequences, three tokens; token 0 of each is a prompt token (mask 0)
    behaviour = torch.tensor([[0.0, math.log(0.5), math.log(0.5)], [0.0, math.log(0.2), math.log(0.4)]])
    new = torch.tensor([[0.0, math.log(0.55), math.log(0.9)], [0.0, math.log(0.1), math.log(0.4)]])
    adv = torch.tensor([[1.0], [-2.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    loss, stats = ppo_clip_loss(new, behaviour, adv, mask, clip_eps=0.2)
    # ratios 1.1, 1.8 (A=+1: the second is clipped to 1.2), 0.5, 1.0 (A=-2: the loss is
    # -min(r*A, clip(r)*A) = 2*max(r, clip(r)), so 0.5 counts as 0.8)
    per_token = [-1.1, -1.2, 2 * 0.8, 2 * 1.0]
    assert math.isclose(float(loss), sum(per_token) / 4, rel_tol=1e-5)
    assert stats["tokens"] == 4 and math.isclose(stats["clip_frac"], 0.5)


def test_masked_tokens_get_no_gradient():
    behaviour = torch.randn(2, 5)
    new = behaviour.clone().requires_grad_()  # on-policy: no token is clipped
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 0, 0, 0, 1]])
    loss, _ = ppo_clip_loss(new, behaviour, torch.tensor([[1.0], [-0.5]]), mask, 0.2)
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert torch.all(new.grad[mask == 1] != 0)
