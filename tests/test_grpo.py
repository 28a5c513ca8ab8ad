"""GRPO advantages and every variant of the token loss, against hand-computed values."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from kiln.learner.grpo import LossConfig, group_advantages, policy_loss, ppo_clip_loss, trained_token_mask


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=False) == [0.5, -0.5, -0.5, 0.5]
    a = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, [1, -1, -1, 1]))
    assert group_advantages([0.0, 0.0, 0.0], std_normalize=True) == [0.0, 0.0, 0.0]
    assert group_advantages([], std_normalize=False) == []
    # W-REINFORCE: only the below-average samples are scaled
    assert group_advantages([1.0, 0.0, 0.0, 0.0], std_normalize=False, negative_weight=0.1) == pytest.approx(
        [0.75, -0.025, -0.025, -0.025]
    )
    assert group_advantages([1.0, 0.0], std_normalize=False, negative_weight=0.0) == [0.5, 0.0]
    # rewards of valid samples only: a missing score must not become a group-wide nan
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([1.0, float("nan")], std_normalize=False)


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
    loss, stats = policy_loss(
        new, behaviour, adv, torch.ones(1, 3), LossConfig(loss="decoupled_ppo", tis_cap=2.0), prox_logp=prox
    )
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
    loss, stats = policy_loss(
        new, lp(0.5, 0.1), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), LossConfig(loss="tis", tis_cap=2.0)
    )
    assert math.isclose(loss.item(), (-1.2 * math.log(0.6) + 2 * math.log(0.5)) / 2, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.6, 1.0]]))
    assert stats["tis_capped_frac"] == 0.5


def test_kl_estimators_by_hand():
    # ref 0.5, new 0.25: d = log ref - log new = log 2; k1 = -d = -log 2; k2 = d^2 / 2;
    # k3 = e^d - d - 1 = 1 - log 2
    new, ref, zero = lp(0.25), lp(0.5), torch.zeros(1, 1)
    for est, want in (("k1", -math.log(2)), ("k2", math.log(2) ** 2 / 2), ("k3", 1 - math.log(2))):
        loss, stats = policy_loss(
            new, new, zero, torch.ones(1, 1), LossConfig(kl_coef=0.1, kl_estimator=est), ref_logp=ref
        )
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
            new,
            behaviour,
            torch.tensor([[1.0]]),
            mask,
            LossConfig(loss=variant, kl_coef=0.1),
            prox_logp=behaviour,
            ref_logp=behaviour,
        )
        loss.backward()
        assert torch.isfinite(loss) and stats["tokens"] == 2, variant
        assert torch.all(new.grad[~mask] == 0) and torch.all(new.grad[mask] != 0), (variant, new.grad)


@pytest.mark.parametrize("variant", ["ppo_clip", "decoupled_ppo", "tis"])
def test_policy_step_with_each_variant_and_stale_tokens(variant):
    """The learner's step runs every variant (with the KL reference on), masks the
    tokens of a version older than max_staleness and counts them."""
    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Trajectory, TrajectoryStatus
    from kiln.shared.tasks import load_suite

    overrides = [
        f"algorithm.loss={variant}",
        "algorithm.kl_coef=0.05",
        "algorithm.max_staleness=1",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "learner.tokenizer_corpus_repeats=1",
    ]
    policy = Policy(load_config(LearnerConfig, None, overrides), load_suite("builtin"))

    def traj(i, versions):
        n = len(versions)
        return Trajectory(
            run_id="r",
            trajectory_id=f"t{i}",
            group_id="g",
            task_id="t",
            sample_index=i,
            dispatch_version=3,
            status=TrajectoryStatus.FINISHED,
            token_ids=[5 + i] * (4 + n),
            logprobs=[0.0] * 4 + [-2.0] * n,
            token_versions=[-1] * 4 + versions,
            loss_mask=[0] * 4 + [1] * n,
        )

    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = policy.train_step([(traj(0, [1, 1, 4, 4]), 1.0), (traj(1, [4, 4, 4]), -1.0)], version=4)
    assert stats.stale_tokens == 2 and stats.tokens == 5
    assert stats.kl >= 0 and any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))


def test_tis_with_proximal_weights_and_no_cap():
    # the weight uses prox when given: token 1, A = +1: w = 0.4 / 0.5 = 0.8 -> -0.8 * log 0.6;
    # token 2, A = -1: w = 0.3 / 0.1 = 3, tis_cap 0 = no truncation -> +3 * log 0.5.
    # Gradients (mean over 2 tokens): -0.8 / 2 and +3 / 2.
    new = lp(0.6, 0.5).requires_grad_()
    loss, stats = policy_loss(
        new,
        lp(0.5, 0.1),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        LossConfig(loss="tis", tis_cap=0.0),
        prox_logp=lp(0.4, 0.3),
    )
    assert math.isclose(loss.item(), (-0.8 * math.log(0.6) + 3 * math.log(0.5)) / 2, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.4, 1.5]]))
    assert "tis_capped_frac" not in stats and stats["clip_frac"] == 0.0
    # ratio_mean is pi_theta / pi_behaviour: (0.6/0.5 + 0.5/0.1) / 2 = 3.1
    assert stats["ratio_mean"] == pytest.approx(3.1)


def test_decoupled_ppo_without_cap():
    # behaviour 0.1, prox 0.4: weight 4 kept whole (tis_cap 0); new 0.44: r = 1.1 inside
    # the clip, A = +1 -> loss -4 * 1.1 = -4.4, gradient d/dlogp = -4 * r = -4.4
    new = lp(0.44).requires_grad_()
    cfg = LossConfig(loss="decoupled_ppo", tis_cap=0.0)
    loss, stats = policy_loss(new, lp(0.1), torch.tensor([[1.0]]), torch.ones(1, 1), cfg, prox_logp=lp(0.4))
    loss.backward()
    assert loss.item() == pytest.approx(-4.4) and new.grad.item() == pytest.approx(-4.4)
    assert stats["behaviour_weight_mean"] == pytest.approx(4.0) and stats["ratio_mean"] == pytest.approx(1.1)


def test_kl_gradient_by_hand_and_only_logp_is_differentiated():
    # k3 = e^d - d - 1 with d = ref - logp: dk3/dlogp = 1 - e^d; ref 0.5, new 0.25: 1 - 2 = -1.
    # k1 = logp - ref: dk1/dlogp = 1; k2 = (logp - ref)^2 / 2: dk2/dlogp = logp - ref = -log 2.
    # Behaviour, prox and ref get no gradient.
    for est, want in (("k1", 1.0), ("k2", -math.log(2)), ("k3", -1.0)):
        new, ref, beh = lp(0.25).requires_grad_(), lp(0.5).requires_grad_(), lp(0.25).requires_grad_()
        cfg = LossConfig(loss="decoupled_ppo", kl_coef=1.0, kl_estimator=est)
        loss, _ = policy_loss(new, beh, torch.zeros(1, 1), torch.ones(1, 1), cfg, prox_logp=beh, ref_logp=ref)
        loss.backward()
        assert new.grad.item() == pytest.approx(want), est
        assert ref.grad is None and beh.grad is None


def test_k2_gradient_stays_bounded_where_k3_explodes():
    # A sampled token the reference finds 500x likelier (the tiny preset's KL-526 step):
    # k3's gradient is 1 - 500, k2's only -log 500.
    grads = {}
    for est in ("k2", "k3"):
        new = lp(0.001).requires_grad_()
        loss, _ = policy_loss(
            new,
            new.detach(),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            LossConfig(kl_coef=1.0, kl_estimator=est),
            ref_logp=lp(0.5),
        )
        loss.backward()
        grads[est] = new.grad.item()
    assert grads["k3"] == pytest.approx(1 - 500) and grads["k2"] == pytest.approx(-math.log(500))


def test_untrained_positions_never_leak_nan():
    # -inf logprobs (a pad or prompt position) and a huge behaviour gap on masked tokens:
    # the loss stays finite and their gradient is exactly zero
    behaviour = torch.tensor([[-float("inf"), -1.0, 80.0]])
    for variant in ("ppo_clip", "decoupled_ppo", "tis"):
        new = torch.tensor([[-float("inf"), -0.5, -100.0]], requires_grad=True)
        mask = torch.tensor([[0.0, 1.0, 0.0]])
        cfg = LossConfig(loss=variant, kl_coef=0.5)
        loss, _ = policy_loss(new, behaviour, torch.tensor([[1.0]]), mask, cfg, prox_logp=behaviour, ref_logp=behaviour)
        loss.backward()
        assert torch.isfinite(loss), variant
        assert new.grad[0, 0] == 0 and new.grad[0, 2] == 0 and torch.isfinite(new.grad[0, 1]), (variant, new.grad)


def test_trained_token_mask_edges():
    versions = torch.tensor([[-1, 0, 2, 4, 5]])
    loss_mask = torch.tensor([[1, 1, 1, 1, 1]])
    # max_staleness None: nothing is stale; 0: only the current version trains; a version -1
    # token is never stale (its loss_mask decides)
    mask, stale = trained_token_mask(loss_mask, versions, 5, None)
    assert mask.all() and stale == 0
    mask, stale = trained_token_mask(loss_mask, versions, 5, 0)
    assert mask.tolist() == [[True, False, False, False, True]] and stale == 3
    mask, stale = trained_token_mask(loss_mask, versions, 5, 3)  # 5 - 2 = 3 is not > 3
    assert mask.tolist() == [[True, False, True, True, True]] and stale == 1
    # a token not in the loss is not counted as stale
    mask, stale = trained_token_mask(torch.tensor([[0, 0, 1, 1, 1]]), versions, 5, 0)
    assert stale == 2


def test_loss_config_is_validated():
    for bad in (
        dict(loss="reinforce"),
        dict(kl_estimator="k4"),
        dict(clip_eps=0.0),
        dict(clip_eps_high=-0.1),
        dict(kl_coef=-1.0),
    ):
        with pytest.raises(ValueError):
            LossConfig(**bad)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reference_is_version_zero(precision):
    """The KL reference is the initial policy, in the policy's own precision: before any
    update the policy's logprobs equal the reference's and the first step's KL is 0."""
    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Trajectory, TrajectoryStatus
    from kiln.shared.tasks import load_suite

    overrides = [
        f"learner.precision.mode={precision}",
        "algorithm.kl_coef=0.1",
        "algorithm.max_staleness=1",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "learner.tokenizer_corpus_repeats=1",
    ]
    policy = Policy(load_config(LearnerConfig, None, overrides), load_suite("builtin"))
    t = Trajectory(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="t",
        sample_index=0,
        dispatch_version=0,
        status=TrajectoryStatus.FINISHED,
        token_ids=list(range(5, 25)),
        logprobs=[0.0] * 8 + [-3.0] * 12,
        token_versions=[-1] * 8 + [0] * 12,
        loss_mask=[0] * 8 + [1] * 12,
    )
    batch = [(t, 1.0), (t.model_copy(update={"sample_index": 1}), -1.0)]
    assert policy.train_step(batch, version=0).kl == 0.0
    assert policy.train_step(batch, version=1).kl > 0  # the policy has moved away from it


def test_trainer_keeps_infra_errors_out_of_advantages_and_passes_the_version():
    """The trainer's batch: an ``infra_error`` sample is neither trained nor part of its
    group's statistics, and ``train_step`` gets the version it trains from."""
    import asyncio
    from types import SimpleNamespace

    from opentelemetry import trace
    from opentelemetry.sdk.metrics import MeterProvider

    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import StepStats
    from kiln.learner.trainer import Trainer
    from kiln.shared import contracts as c
    from kiln.shared.config import load_config
    from kiln.shared.metrics import instruments

    cfg = load_config(LearnerConfig, None, ["algorithm.groups_per_step=1", "algorithm.samples_per_group=3"])
    calls = []

    class FakePolicy:
        world = None

        def train_step(self, batch, version=None):
            calls.append(([(t.trajectory_id, adv) for t, adv in batch], version))
            return StepStats(loss=0.0, aux_loss=0.0, tokens=1, ratio_mean=1.0, clip_frac=0.0, seconds=0.0)

        def stage(self, folder):
            return folder

    class FakeDelivery:
        headers: dict = {}

        async def ack(self):
            pass

    async def noop(*args, **kwargs):
        pass

    controller = SimpleNamespace(  # the trainer's view of it: kiln.learner.ledger.TrainerLedger
        last_published=lambda: 2,
        take_step_drops=lambda: 0,
        staleness_limit=lambda: 0,
        mark_trained=noop,
        step_finished=noop,
        drop=noop,
    )
    meter = MeterProvider().get_meter("test")
    ctx = SimpleNamespace(
        config=cfg,
        bus=SimpleNamespace(publish=noop),
        tracer=trace.get_tracer("test"),
        metrics=instruments(meter, "learner"),
    )

    def scored(i, reward, infra=None):
        t = c.Trajectory(
            run_id=cfg.run.id,
            trajectory_id=f"t{i}",
            group_id="g",
            task_id="t",
            sample_index=i,
            dispatch_version=2,
            status=c.TrajectoryStatus.FINISHED,
            token_ids=[1, 2],
            logprobs=[0.0, -1.0],
            token_versions=[-1, 2],
            loss_mask=[0, 1],
        )
        return c.ScoredTrajectory(trajectory=t, reward=reward, passed=reward > 0, infra_error=infra)

    trainer = Trainer(ctx, controller, FakePolicy())
    trainer.step = 2
    trainer.staging = Path(tempfile.mkdtemp())
    trainer.pending = {
        "g": {
            f"t{i}": (s, FakeDelivery())
            for i, s in enumerate([scored(0, 1.0), scored(1, 0.0, "pool exhausted"), scored(2, 0.0)])
        }
    }
    trainer.ready = ["g"]
    asyncio.run(trainer._train())
    # valid rewards 1, 0 -> mean 0.5 -> advantages +0.5, -0.5; t1 (infra, reward 0 placeholder)
    # would have made the mean 1/3
    assert calls == [([("t0", 0.5), ("t2", -0.5)], 2)]


@pytest.mark.parametrize("variant", ["ppo_clip", "decoupled_ppo"])
def test_micro_batches_give_the_same_update(variant):
    """Gradient accumulation over chunks of rows is the same policy-gradient step as the
    whole batch at once: same loss, statistics and parameters after it. (The
    load-balancing term is computed per chunk, so it is compared loosely and left out of
    the parameter check.)"""
    from kiln.learner.parallel import policy_gradient_step
    from kiln.shared.model import MoEConfig, MoEForCausalLM, sequence_logprobs

    cfg = MoEConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        router_aux_loss_coef=0.0,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 24), generator=g)
    attn = torch.ones_like(ids)
    attn[3, 18:] = 0
    mask = (torch.rand(4, 24, generator=g) > 0.3).float() * attn
    mask[:, 0] = 0
    adv = torch.randn(4, 1, generator=g)
    outs, params = [], []
    for micro in (0, 1, 3):
        model = MoEForCausalLM(cfg).init_weights(0)
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, attn)
        behaviour = lp + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        shard = {"ids": ids, "attn": attn, "mask": mask, "behaviour": behaviour, "adv": adv}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # linear in the gradient (Adam's first step is its sign)
        out = policy_gradient_step(
            model,
            opt,
            shard,
            global_tokens=float(mask.sum()),
            loss=LossConfig(loss=variant),
            temperature=1.0,
            max_grad_norm=1.0,
            prox_logp=lp if variant == "decoupled_ppo" else None,
            micro_batch=micro,
        )
        outs.append(out)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for out, p in zip(outs[1:], params[1:]):
        for k in ("loss", "ratio_mean", "clip_frac", "grad_norm", "tokens"):
            assert out[k] == pytest.approx(outs[0][k], rel=1e-5, abs=1e-7), k
        assert out["aux_loss"] == pytest.approx(outs[0]["aux_loss"], rel=0.05)
        assert torch.allclose(p, params[0], atol=1e-6)


def test_learning_rate_schedule_warms_up_then_decays_to_the_last_step():
    from kiln.learner.policy import _Schedule

    s = _Schedule(warmup=4, total=20, decay_to=0.1)
    assert [s(i) for i in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert s(4) == 1.0 and abs(s(19) - 0.1) < 1e-12 and s(30) == s(19)
    assert all(s(i) > s(i + 1) for i in range(4, 19))
    assert [_Schedule(0)(i) for i in (0, 50)] == [1.0, 1.0]
