"""GRPO advantages and the off-policy-corrected policy loss (pure functions): token-level
corrections, and sequence-level ones (GSPO's ratio, the geometric-mean sequence mask).

Advantages are per group: reward minus the group mean (optionally divided by the group
std), over the group's valid samples only: ``infra_error`` trajectories are excluded
before this point, so they never shift a group's statistics.

Every token is corrected with its own behaviour logprob, the one rollout recorded when
that very token was sampled (a resumed partial trajectory mixes versions), and carries
its own version, so staleness is judged per token. The loss variants (``loss``):

- ``ppo_clip``: PPO's clipped surrogate on ``r = pi_theta / pi_behaviour``, optionally
  with an asymmetric upper clip (``clip_eps_high``);
- ``decoupled_ppo`` (Hilton et al.; AReaL): the clip is taken against the proximal
  policy (the policy the batch starts from, ``prox``), ``r = pi_theta / pi_prox``, and
  the surrogate is weighted by the behaviour correction ``pi_prox / pi_behaviour``
  (detached, truncated at ``tis_cap`` when it is > 0); with ``prox == behaviour`` it is
  ``ppo_clip``;
- ``tis``: the plain policy gradient ``-w * A * logp`` weighted by the truncated
  importance ratio ``w = min(pi / pi_behaviour, tis_cap)`` (detached), where ``pi`` is
  the proximal policy when its logprobs are given and ``pi_theta`` otherwise (the same
  numbers when the batch takes one optimizer step, as the learner's does);

- ``gspo`` (Zheng et al., GSPO): one ratio per sequence, ``s = exp(mean over the
  sequence's trained tokens of (logp - behaviour))`` (the geometric mean of its tokens'
  ratios, differentiated through every token), in PPO's clipped surrogate with the
  sequence's advantage and the ``gspo_clip_eps``/``gspo_clip_eps_high`` range, applied to
  each of its trained tokens: under the token-level mean below, every trained token of a
  sequence gets the gradient ``s * A / N`` while ``s`` is inside the clip;

``tis_cap`` <= 0 means no truncation (plain importance weights) in both variants that
use it;

plus, with ``sequence_mask = "geometric"`` and any variant, a sequence-level rejection
(SkyRL's geo mask): a sequence whose geometric-mean ratio ``exp(mean log(pi /
pi_behaviour))`` over its trained tokens (``pi`` as for ``tis``) lies outside
[``sequence_mask_low``, ``sequence_mask_high``] drops out of every term, all its tokens;
single tokens far off either way do not mask a sequence whose mean stays inside. Its
tokens stay in the denominator (the batch's trained tokens, fixed before any loss), so
a rejected sequence scales the step down rather than re-weighting the kept ones;

plus, when ``kl_coef > 0``, a KL penalty to a frozen reference policy per token with
the ``k1`` (``logp - ref``), ``k2`` (``(logp - ref)^2 / 2``) or ``k3``
(``exp(ref - logp) - (ref - logp) - 1``) estimator (``k1`` is unbiased for the KL value
but, used as a loss, its gradient is only the score function; ``k2`` and ``k3`` are
non-negative and their gradients pull toward the reference; ``k3``'s grows like
``exp(ref - logp)``, so one sampled token the reference finds far likelier than the
policy can dominate a step (measured: a step of the tiny preset with KL 526 and gradient
norm 1453), ``k2``'s only linearly in the log-ratio). Every term is a mean over all
trained tokens of the batch (token-level, so long trajectories are not down-weighted).

Invariants:

- a token that is not trained (``loss_mask`` 0, or older than ``max_staleness``
  versions: ``trained_token_mask``) contributes nothing to the loss, to the token count
  or to any gradient (its gradient is exactly zero, and no nan/inf leaks from the
  logprobs recorded at untrained positions);
- behaviour, proximal and reference logprobs are constants (no gradient flows into
  them); only ``logp`` (the policy being trained) is differentiated;
- a sequence is a row of the batch (``Policy.train_step`` gives every segment of a
  trajectory a row of its own), or with ``segments`` one run of equal ids inside a row
  (packed rows); its means are over its trained tokens only (``mask`` 1: generated and
  not stale), never over prompt, observation, padding or another sequence's tokens;
- the stats are floats: ``tokens`` (trained tokens, masked sequences included),
  ``ratio_mean`` and ``clip_frac`` (of the clipped ratio: theta/behaviour, theta/prox for
  ``decoupled_ppo``, the sequence ratio for ``gspo``; for ``tis`` the fraction of capped
  weights), ``tis_capped_frac`` (when a cap applies), ``kl`` (when ``kl_coef > 0``),
  ``behaviour_weight_mean`` (``decoupled_ppo``), ``seq_masked_frac`` (the trained tokens
  the sequence mask rejected, when it is on), all over the trained tokens.
"""

from __future__ import annotations

import math

import torch

# The loss's knobs are declared (and validated) once, with the settings they come from.
from kiln.shared.loss import KL_ESTIMATOR_NAMES, LOSSES, SEQUENCE_MASKS, LossConfig  # noqa: F401

# Per-token KL estimators of d = ref - logp.
KL_ESTIMATORS = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.exp(d) - d - 1,
}
assert tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES


def group_advantages(
    rewards: list[float], std_normalize: bool, eps: float = 1e-6, negative_weight: float = 1.0
) -> list[float]:
    """Mean-centred (optionally std-normalised) advantages of one group, the negative ones
    scaled by ``negative_weight`` (W-REINFORCE; 1 leaves them). ``rewards`` are
    those of the group's valid samples only: an ``infra_error`` sample has no reward (its
    placeholder 0 would bias the group), so the caller leaves it out; a non-finite reward
    is refused rather than spread over the whole group."""
    if not rewards:
        return []
    if not all(math.isfinite(x) for x in rewards):
        raise ValueError(f"non-finite reward in a group: {rewards}")
    r = torch.tensor(rewards, dtype=torch.float64)
    a = r - r.mean()
    if std_normalize and len(rewards) > 1:
        a = a / (r.std(unbiased=False) + eps)
    return torch.where(a < 0, a * negative_weight, a).tolist()


def trained_token_mask(
    loss_mask: torch.Tensor, token_versions: torch.Tensor, current_version: int, max_staleness: int | None
) -> tuple[torch.Tensor, int]:
    """(mask of the tokens to train, number of generated tokens masked as stale). A token
    of version ``v`` is stale when ``current_version - v > max_staleness``; tokens
    without a version (``-1``: prompt, observations) are never stale."""
    mask = loss_mask.bool()
    if max_staleness is None:
        return mask, 0
    stale = (token_versions >= 0) & (current_version - token_versions > max_staleness)
    return mask & ~stale, int((mask & stale).sum())


def _clipped_surrogate(ratio, adv, lo, hi):
    return torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def _truncate(weight, cap, mask, n, stats):
    """``min(weight, cap)`` (no cap when ``cap <= 0``) and where it capped; records
    ``tis_capped_frac`` over the trained tokens when a cap applies."""
    if cap <= 0:
        return weight, torch.zeros_like(weight, dtype=torch.bool)
    capped = weight > cap
    stats["tis_capped_frac"] = float((capped.to(mask.dtype) * mask).sum() / n)
    return weight.clamp(max=cap), capped


def sequence_mean(x: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T): at every position, the mean of ``x`` over the trained tokens (``mask`` 1)
    of its sequence (a row, or with ``segments`` a run of one id inside a row); 0 for a
    sequence without trained tokens. Differentiable in ``x``."""
    mask = mask.to(x.dtype)
    if segments is None:
        total = (x * mask).sum(-1, keepdim=True)
        return (total / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(x)
    b, t = x.shape
    k = int(segments.max()) + 1 if segments.numel() else 1
    flat = (torch.arange(b, device=x.device)[:, None] * k + segments).reshape(-1)
    total = x.new_zeros(b * k).index_add(0, flat, (x * mask).reshape(-1))
    count = x.new_zeros(b * k).index_add(0, flat, mask.reshape(-1))
    return (total / count.clamp(min=1))[flat].reshape(b, t)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """All (B, T); ``advantages`` broadcast per token; ``mask`` 1 on trained tokens;
    ``segments`` (B, T) integers >= 0, equal within a sequence, for rows packing several
    sequences (None: each row is one sequence)."""
    mask = mask.to(logp.dtype)
    n = mask.sum().clamp(min=1)
    lo, hi = 1 - cfg.clip_eps, 1 + (cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps)
    # Masked positions are filled before anything else (the policy's with a constant
    # through where(), whose backward gives them exactly 0): a huge logp gap or a -inf on
    # a prompt or pad token must not turn into inf * 0 = nan in the loss or its gradient.
    keep = mask.bool()
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    behaviour_logp = torch.where(keep, behaviour_logp.detach(), logp.detach())
    if prox_logp is not None:
        prox_logp = torch.where(keep, prox_logp.detach(), logp.detach())
    stats: dict[str, float] = {}
    if cfg.sequence_mask == "geometric":
        pi = logp.detach() if prox_logp is None else prox_logp
        geo = torch.exp(sequence_mean(pi - behaviour_logp, mask, segments))
        inside = (geo >= cfg.sequence_mask_low) & (geo <= cfg.sequence_mask_high)
        stats["seq_masked_frac"] = float(((~inside).to(mask.dtype) * mask).sum() / n)
        keep = keep & inside  # the whole sequence leaves every term; n still counts it
    if cfg.loss == "ppo_clip":
        ratio = torch.exp(logp - behaviour_logp)
        per_token = -_clipped_surrogate(ratio, advantages, lo, hi)
        clipped = (ratio < lo) | (ratio > hi)
    elif cfg.loss == "decoupled_ppo":
        if prox_logp is None:
            raise ValueError("decoupled_ppo needs the proximal policy's logprobs")
        ratio = torch.exp(logp - prox_logp)
        weight, _ = _truncate(torch.exp(prox_logp - behaviour_logp).detach(), cfg.tis_cap, mask, n, stats)
        per_token = -weight * _clipped_surrogate(ratio, advantages, lo, hi)
        clipped = (ratio < lo) | (ratio > hi)
        stats["behaviour_weight_mean"] = float((weight * mask).sum() / n)
    elif cfg.loss == "gspo":
        ratio = torch.exp(sequence_mean(logp - behaviour_logp, mask, segments))
        g_lo, g_hi = 1 - cfg.gspo_clip_eps, 1 + cfg.gspo_clip_eps_high
        per_token = -_clipped_surrogate(ratio, advantages, g_lo, g_hi)
        clipped = (ratio < g_lo) | (ratio > g_hi)
    else:  # tis
        ratio = torch.exp(logp - behaviour_logp)
        pi = logp.detach() if prox_logp is None else prox_logp
        weight, capped = _truncate(torch.exp(pi - behaviour_logp).detach(), cfg.tis_cap, mask, n, stats)
        per_token = -weight * advantages * logp
        clipped = capped
    loss = torch.where(keep, per_token, 0.0).sum() / n
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        d = torch.where(keep, ref_logp.detach(), logp.detach()) - logp
        kl = KL_ESTIMATORS[cfg.kl_estimator](d)
        kl_mean = torch.where(keep, kl, 0.0).sum() / n
        loss = loss + cfg.kl_coef * kl_mean
        stats["kl"] = float(kl_mean.detach())
    with torch.no_grad():
        stats.update(
            ratio_mean=float((ratio * mask).sum() / n),
            clip_frac=float((clipped.to(mask.dtype) * mask).sum() / n),
            tokens=float(mask.sum()),
        )
    return loss, stats


def ppo_clip_loss(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``policy_loss`` with the ``ppo_clip`` variant and a symmetric clip."""
    return policy_loss(logp, behaviour_logp, advantages, mask, LossConfig(clip_eps=clip_eps))
