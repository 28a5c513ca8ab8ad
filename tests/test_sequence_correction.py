"""Sequence-level corrections of the policy loss against hand-computed values: the
geometric-mean sequence mask (``algorithm.sequence_mask = "geometric"``) and GSPO's
sequence ratio (``algorithm.loss = "gspo"``). A sequence is a row (or a run of one
``segments`` id in a packed row); its means are over its trained tokens only, and a
trajectory's segments are sequences of their own in the learner's step."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.learner.grpo import LossConfig, policy_loss, sequence_mean

LOG_HALF = math.log(0.5)


def rows(*ratios_per_row, pad=0, dtype=torch.float32):
    """(logp, behaviour, mask) for rows of trained tokens with the given ratios
    pi / pi_behaviour (behaviour 0.5 everywhere), each row led by one prompt token (mask 0)
    and right-padded with ``pad`` extra positions (mask 0) up to the longest row."""
    n = 1 + max(len(r) for r in ratios_per_row) + pad
    logp = torch.zeros(len(ratios_per_row), n, dtype=dtype)
    behaviour = torch.full((len(ratios_per_row), n), LOG_HALF, dtype=dtype)
    mask = torch.zeros(len(ratios_per_row), n, dtype=dtype)
    for i, ratios in enumerate(ratios_per_row):
        for j, r in enumerate(ratios):
            logp[i, 1 + j] = math.log(0.5 * r)
            mask[i, 1 + j] = 1
    # What rollout records at untrained positions must not count: wild behaviour logprobs.
    behaviour[mask == 0] = -40.0
    return logp, behaviour, mask


def test_sequence_mean_over_trained_tokens_only():
    x = torch.tensor([[9.0, 1.0, 3.0, 7.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    assert sequence_mean(x, mask).tolist() == [[2.0] * 4, [0.0] * 4]
    # packed: positions 0-1 are one sequence, 2-3 another
    seg = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]])
    assert sequence_mean(x, torch.ones(2, 4), seg).tolist() == [[5.0, 5.0, 5.0, 5.0], [5.0] * 4]
    assert sequence_mean(x, mask, seg).tolist() == [[1.0, 1.0, 3.0, 3.0], [0.0] * 4]


def test_geometric_sequence_mask_by_hand():
    # ppo_clip (clip 0.2) with the geo mask [0.99, 1.01]; token ratios pi / pi_behaviour:
    # row 0 (A = +1): 1.1 and 1/1.1, each outside the band, geometric mean 1.0 -> kept;
    #   per token -r: -1.1, -1/1.1
    # row 1 (A = -1): 1.02, 1.02 -> mean 1.02 > 1.01: masked
    # row 2 (A = +1): 0.98 -> < 0.99: masked
    # row 3 (A = -1): 1.005 (its untrained prompt token's wild gap not counted) -> kept;
    #   per token -min(-1.005, -1.005) = +1.005
    # mean over all 6 trained tokens (masked ones stay in the denominator)
    logp, behaviour, mask = rows([1.1, 1 / 1.1], [1.02, 1.02], [0.98], [1.005])
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    logp.requires_grad_()
    cfg = LossConfig(sequence_mask="geometric", sequence_mask_low=0.99, sequence_mask_high=1.01)
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    assert loss.item() == pytest.approx((-1.1 - 1 / 1.1 + 1.005) / 6, rel=1e-6)
    assert stats["seq_masked_frac"] == pytest.approx(3 / 6) and stats["tokens"] == 6
    loss.backward()
    # d(-r A / 6)/dlogp = -r A / 6 on the kept rows; exactly 0 on masked rows and untrained tokens
    want = torch.zeros_like(logp)
    want[0, 1], want[0, 2], want[3, 1] = -1.1 / 6, -1 / 1.1 / 6, 1.005 / 6
    torch.testing.assert_close(logp.grad, want)
    # off (the default): every sequence trains
    loss_off, stats_off = policy_loss(logp.detach(), behaviour, adv, mask, LossConfig())
    assert loss_off.item() == pytest.approx((-1.1 - 1 / 1.1 + 2 * 1.02 - 0.98 + 1.005) / 6, abs=1e-6)
    assert "seq_masked_frac" not in stats_off


def test_geometric_mask_uses_the_proximal_policy_and_masks_every_term():
    # tis with prox given: the mask's ratio is prox / behaviour, not theta / behaviour.
    # row 0: theta = behaviour (ratio 1) but prox / behaviour = 1.05 -> masked; row 1: prox /
    # behaviour = 1.0 -> kept, tis weight 1.0, A = +1: -log(0.5) / 2 tokens, gradient -1/2.
    # The KL term (k1 = logp - ref, ref = log 0.25, coefficient 0.5) leaves the masked row
    # too: kl = (log 0.5 - log 0.25) / 2 tokens, gradient 0.5 / 2.
    logp, behaviour, mask = rows([1.0], [1.0])
    prox = logp.clone()
    prox[0, 1] = math.log(0.5 * 1.05)
    ref = torch.full_like(logp, math.log(0.25))
    cfg = LossConfig(loss="tis", sequence_mask="geometric", kl_coef=0.5, kl_estimator="k1")
    logp.requires_grad_()
    loss, stats = policy_loss(logp, behaviour, torch.ones(2, 1), mask, cfg, prox_logp=prox, ref_logp=ref)
    kl = math.log(2) / 2
    assert loss.item() == pytest.approx(-LOG_HALF / 2 + 0.5 * kl, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl) and stats["seq_masked_frac"] == 0.5
    loss.backward()
    assert logp.grad[0].abs().sum() == 0 and logp.grad[1, 1] == pytest.approx(-1 / 2 + 1 / 4)


def test_gspo_by_hand():
    # gspo, clip [1 - 3e-4, 1 + 4e-4]; s = exp(mean log r) over the sequence's trained tokens:
    # row 0 (A = +1): r 1.0002, 1.0004 -> s0 = sqrt(1.0002 * 1.0004), inside: -s0 per token
    # row 1 (A = +1): r 1.2, 1.0 -> s = sqrt(1.2) > 1.0004: clipped, -1.0004 per token
    # row 2 (A = -1): r 0.5 x3 -> s = 0.5 < 0.9997: -min(-0.5, -0.9997) = 0.9997 per token
    # row 3 (A = -1): r 1.21, 1.0 -> s = 1.1: -min(-1.1, -1.0004) = 1.1 (unclipped branch)
    # loss = sum / 9 tokens. Gradient of a token t of a sequence of k tokens with k
    # copies of s * (-A): -A * k * s * (1/k) / 9 = -A s / 9 (rows 0, 3); rows 1, 2: 0.
    logp, behaviour, mask = rows([1.0002, 1.0004], [1.2, 1.0], [0.5, 0.5, 0.5], [1.21, 1.0], dtype=torch.float64)
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]], dtype=torch.float64)
    logp.requires_grad_()
    loss, stats = policy_loss(logp, behaviour, adv, mask, LossConfig(loss="gspo"))
    s0 = math.sqrt(1.0002 * 1.0004)
    assert loss.item() == pytest.approx((-2 * s0 - 2 * 1.0004 + 3 * 0.9997 + 2 * 1.1) / 9, rel=1e-9)
    assert stats["clip_frac"] == pytest.approx(7 / 9)  # rows 1-3: the sequence ratio is outside
    assert stats["ratio_mean"] == pytest.approx((2 * s0 + 2 * math.sqrt(1.2) + 1.5 + 2.2) / 9)
    loss.backward()
    want = torch.zeros_like(logp)
    want[0, 1:3] = -s0 / 9
    want[3, 1:3] = 1.1 / 9
    torch.testing.assert_close(logp.grad, want)


def test_gspo_with_equal_token_ratios_is_ppo_clip_on_the_same_range():
    # every token of a sequence at the same ratio: the sequence ratio is that ratio
    logp, behaviour, mask = rows([1.1, 1.1], [0.7, 0.7, 0.7], [1.0001])
    adv = torch.tensor([[1.0], [-0.5], [2.0]])
    gspo, _ = policy_loss(
        logp, behaviour, adv, mask, LossConfig(loss="gspo", gspo_clip_eps=0.2, gspo_clip_eps_high=0.05)
    )
    ppo, _ = policy_loss(logp, behaviour, adv, mask, LossConfig(clip_eps=0.2, clip_eps_high=0.05))
    assert gspo.item() == pytest.approx(ppo.item(), rel=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(loss="gspo", gspo_clip_eps=0.05),
        LossConfig(sequence_mask="geometric", sequence_mask_low=0.95, sequence_mask_high=1.05),
        LossConfig(loss="gspo", gspo_clip_eps=0.05, sequence_mask="geometric", sequence_mask_high=1.05),
    ],
)
def test_packed_segments_are_sequences_of_their_own(cfg):
    # Two rows, and the same tokens packed into one row with segment ids: the same loss
    # and gradients (geo mask: row 0 kept, ratio 1.02; row 1 masked, 1.1).
    logp, behaviour, mask = rows([1.02, 1.02], [1.1, 1.0, 1.21])
    adv = torch.tensor([[1.0], [-1.0]])
    packed = [torch.cat((t[0, :3], t[1])).unsqueeze(0) for t in (logp, behaviour, mask)]
    seg = torch.tensor([[0] * 3 + [1] * 4])
    packed_adv = torch.tensor([[1.0] * 3 + [-1.0] * 4])
    a = logp.clone().requires_grad_()
    b = packed[0].clone().requires_grad_()
    la, sa = policy_loss(a, behaviour, adv, mask, cfg)
    lb, sb = policy_loss(b, packed[1], packed_adv, packed[2], cfg, segments=seg)
    la.backward()
    lb.backward()
    assert lb.item() == pytest.approx(la.item(), rel=1e-6) and sb == pytest.approx(sa)
    torch.testing.assert_close(b.grad[0], torch.cat((a.grad[0, :3], a.grad[1])))
    # unpacked as one sequence, the mix would have been judged as a whole
    lc, _ = policy_loss(packed[0], packed[1], packed_adv, packed[2], cfg)
    assert lc.item() != pytest.approx(la.item(), rel=1e-3)


def test_sequence_settings_are_validated():
    for bad in (
        dict(loss="gspo_token"),
        dict(sequence_mask="product"),
        dict(sequence_mask_low=1.2),
        dict(sequence_mask_low=0.0),
        dict(sequence_mask_high=0.9),
        dict(gspo_clip_eps=0.0),
        dict(gspo_clip_eps_high=-1e-4),
    ):
        with pytest.raises(ValueError):
            LossConfig(**bad)
    d = LossConfig()
    assert (d.loss, d.sequence_mask) == ("ppo_clip", "off")  # the default behaviour is unchanged


@pytest.mark.parametrize("variant", ["ppo_clip", "gspo"])
def test_policy_step_masks_the_segment_whose_mean_is_off(variant):
    """A trajectory in two segments (an external harness rewrote its history): each trains
    as a sequence of its own, so the geo mask rejects only the segment whose behaviour
    logprobs are 0.1 below the policy's (ratio e^0.1 = 1.105 on each of its tokens), not
    the whole trajectory (mean over both: e^0.04, also outside the band), and the prompt
    tokens' recorded logprob 0 never counts."""
    from kiln.learner.config import LearnerConfig
    from kiln.learner.policy import Policy
    from kiln.shared.config import load_config
    from kiln.shared.contracts import Segment, Trajectory, TrajectoryStatus
    from kiln.shared.model import sequence_logprobs
    from kiln.shared.tasks import load_suite

    overrides = [
        f"algorithm.loss={variant}",
        "algorithm.sequence_mask=geometric",
        "algorithm.sequence_mask_low=0.99",
        "algorithm.sequence_mask_high=1.01",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "learner.tokenizer_corpus_repeats=1",
    ]
    policy = Policy(load_config(LearnerConfig, None, overrides), load_suite("builtin"))
    first, second = list(range(5, 15)), list(range(20, 28))  # 4 prompt + 6, 4 prompt + 4 generated
    logprobs = []
    for ids, shift in ((first, 0.0), (second, -0.1)):
        with torch.no_grad():
            lp, _ = sequence_logprobs(
                policy.model.train(), torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
            )
        logprobs += [0.0] * 4 + (lp[0, 4:] + shift).tolist()
    mask = ([0] * 4 + [1] * 6) + ([0] * 4 + [1] * 4)
    t = Trajectory(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="t",
        sample_index=0,
        dispatch_version=0,
        status=TrajectoryStatus.FINISHED,
        token_ids=first + second,
        logprobs=logprobs,
        token_versions=[0 if m else -1 for m in mask],
        loss_mask=mask,
        segments=[Segment(start=len(first), reason="history rewritten")],
    )
    stats = policy.train_step([(t, 1.0)], version=0)
    assert stats.tokens == 10 and stats.seq_masked_frac == pytest.approx(4 / 10)
