"""GRPO advantages and every variant of the token loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.learner.grpo import LossConfig, group_advantages, policy_loss, ppo_clip_loss, trained_token_mask


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


def lp(*probs):
    return torch.tensor([[math.log(p) for p in probs]], requires_grad=False)


def test_asymmetric_clip():
    # ratio 1.25 with A = +1: clipped to 1.2 by a symmetric 0.2, kept under clip_eps_high 0.28
    new, old, adv, mask = lp(0.5), lp(0.4), torch.tensor([[1.0]]), torch.ones(1, 1)
    sym, _ = policy_loss(new, old, adv, mask, LossConfig(clip_eps=0.2))
    asym, _ = policy_loss(new, old, adv, mask, LossConfig(clip_eps=0.2, clip_eps_high=0.28))
    assert math.isclose(sym.item(), -1.2, rel_tol=1e-6) and math.isclose(asym.item(), -1.25, rel_tol=1e-6)


def test_decoupled_ppo_by_hand():
    # token 1, A = +1: behaviour 0.5, prox 0.4, new 0.6 -> r = 1.5 clipped to 1.2, weight 0.8: -0.96
    # token 2, A = -1: behaviour 0.1, prox 0.4 (weight 4, capped at 2), new 0.3 -> r = 0.75,
    #   min(-0.75, clip -> -0.8) = -0.8 (the clipped branch), times -2: +1.6
    # token 3, A = +1: behaviour = prox = 0.5, new 0.55 -> r = 1.1 inside the clip: -1.1
    # mean: (-0.96 + 1.6 - 1.1) / 3; only token 3 has a gradient: -r / 3
    new = lp(0.6, 0.3, 0.55).requires_grad_()
    behaviour, prox = lp(0.5, 0.1, 0.5), lp(0.4, 0.4, 0.5)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, stats = policy_loss(new, behaviour, adv, torch.ones(1, 3), LossConfig(loss="decoupled_ppo", tis_cap=2.0), prox_logp=prox)
    assert math.isclose(loss.item(), (-0.96 + 1.6 - 1.1) / 3, rel_tol=1e-6)
    assert stats["tis_capped_frac"] == pytest.approx(1 / 3) and stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0, -1.1 / 3]]))


def test_decoupled_ppo_with_prox_equal_behaviour_is_ppo_clip():
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(3, 6, generator=g) * 3
    base = behaviour + 0.3 * torch.randn(3, 6, generator=g)
    adv, mask = torch.tensor([[1.0], [-0.5], [2.0]]), (torch.rand(3, 6, generator=g) > 0.3).float()
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    la, _ = policy_loss(a, behaviour, adv, mask, LossConfig(loss="ppo_clip"))
    lb, _ = policy_loss(b, behaviour, adv, mask, LossConfig(loss="decoupled_ppo"), prox_logp=behaviour)
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb) and torch.allclose(a.grad, b.grad)


def test_truncated_importance_sampling_by_hand():
    # token 1, A = +1: w = 0.6 / 0.5 = 1.2 -> -1.2 * log 0.6; token 2, A = -1: w = 5 capped
    # at 2 -> +2 * log 0.5. Gradients (mean over 2 tokens): -1.2 / 2 and +2 / 2.
    new = lp(0.6, 0.5).requires_grad_()
    loss, stats = policy_loss(new, lp(0.5, 0.1), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), LossConfig(loss="tis", tis_cap=2.0))
    assert math.isclose(loss.item(), (-1.2 * math.log(0.6) + 2 * math.log(0.5)) / 2, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.6, 1.0]]))
    assert stats["tis_capped_frac"] == 0.5


def test_kl_estimators_by_hand():
    # ref 0.5, new 0.25: d = log ref - log new = log 2; k1 = -d = -log 2; k3 = e^d - d - 1 = 1 - log 2
    new, ref, zero = lp(0.25), lp(0.5), torch.zeros(1, 1)
    for est, want in (("k1", -math.log(2)), ("k3", 1 - math.log(2))):
        loss, stats = policy_loss(new, new, zero, torch.ones(1, 1), LossConfig(kl_coef=0.1, kl_estimator=est), ref_logp=ref)
        assert math.isclose(stats["kl"], want, rel_tol=1e-6) and math.isclose(loss.item(), 0.1 * want, rel_tol=1e-6)


def test_stale_tokens_are_masked_and_get_no_gradient():
    versions = torch.tensor([[-1, 3, 5, 6, 6]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0]])
    mask, stale = trained_token_mask(loss_mask, versions, current_version=6, max_staleness=1)
    assert mask.tolist() == [[False, False, True, True, False]] and stale == 1  # version 3 is 3 behind
    behaviour = torch.tensor([[0.0, -50.0, -1.0, -2.0, 40.0]])  # wild gaps on untrained tokens
    for variant in ("ppo_clip", "decoupled_ppo", "tis"):
        new = torch.tensor([[-3.0, -0.1, -0.9, -2.5, -0.2]], requires_grad=True)
        loss, stats = policy_loss(
            new, behaviour, torch.tensor([[1.0]]), mask, LossConfig(loss=variant, kl_coef=0.1),
            prox_logp=behaviour, ref_logp=behaviour,
        )  # fmt: skip
        loss.backward()
        assert torch.isfinite(loss) and stats["tokens"] == 2, variant
        assert torch.all(new.grad[~mask] == 0) and torch.all(new.grad[mask] != 0), (variant, new.grad)


@pytest.mark.parametrize("variant", ["ppo_clip", "decoupled_ppo", "tis"])
def test_policy_step_with_each_variant_and_stale_tokens(variant):
    """The learner's step runs every variant (with the KL reference on), masks the
    tokens of a version older than max_staleness and counts them."""
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Trajectory, TrajectoryStatus
    from kiln.shared.tasks import load_suite

    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy

    overrides = [f"algorithm.loss={variant}", "algorithm.kl_coef=0.05", "algorithm.max_staleness=1",
                 "model.hidden_size=32", "model.num_hidden_layers=1", "learner.tokenizer_corpus_repeats=1"]  # fmt: skip
    policy = Policy(load_config(LearnerConfig, None, overrides), load_suite("builtin"))

    def traj(i, versions):
        n = len(versions)
        return Trajectory(
            run_id="r", trajectory_id=f"t{i}", group_id="g", task_id="t", sample_index=i, dispatch_version=3,
            status=TrajectoryStatus.FINISHED, token_ids=[5 + i] * (4 + n), logprobs=[0.0] * 4 + [-2.0] * n,
            token_versions=[-1] * 4 + versions, loss_mask=[0] * 4 + [1] * n,
        )  # fmt: skip

    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = policy.train_step([(traj(0, [1, 1, 4, 4]), 1.0), (traj(1, [4, 4, 4]), -1.0)], version=4)
    assert stats.stale_tokens == 2 and stats.tokens == 5
    assert stats.kl >= 0 and any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
