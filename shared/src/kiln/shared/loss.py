"""The policy loss's knobs, declared once: ``LossFields`` are ``algorithm.*`` of the
settings (``AlgorithmSettings`` derives from them) and ``LossConfig`` is what the
learner's loss (``kiln.learner.grpo.policy_loss``) takes.

Invariants: torch-free (every service reads the settings); every range the loss needs is
a field constraint here, so a value the learner would refuse (``clip_eps = 1.5``) is
refused when the settings load, in every service, not when the learner starts.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

LossName = Literal["ppo_clip", "decoupled_ppo", "tis", "gspo"]
KlEstimator = Literal["k1", "k2", "k3"]
SequenceMask = Literal["off", "geometric"]
LOSSES: tuple[str, ...] = get_args(LossName)
KL_ESTIMATOR_NAMES: tuple[str, ...] = get_args(KlEstimator)
SEQUENCE_MASKS: tuple[str, ...] = get_args(SequenceMask)


class LossFields(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range of the importance ratio (the lower side, and the upper one unless
    ``clip_eps_high`` is set); in (0, 1)."""
    clip_eps_high: float | None = Field(default=None, gt=0)
    """Upper clip range (asymmetric "clip-higher"); unset = ``clip_eps``."""
    loss: LossName = "ppo_clip"
    """Policy loss: ``ppo_clip`` (ratio to the behaviour policy), ``decoupled_ppo`` (clip
    against the policy the batch starts from, times the behaviour correction), ``tis``
    (policy gradient with truncated importance weights), ``gspo`` (GSPO: one importance
    ratio per sequence, the geometric mean of its tokens' ratios to the behaviour policy,
    clipped by ``gspo_clip_eps``/``gspo_clip_eps_high`` and applied to all its tokens)."""
    gspo_clip_eps: float = Field(default=3e-4, gt=0, lt=1)
    """``gspo``: lower clip range of the sequence ratio (clipped at ``1 - gspo_clip_eps``);
    in (0, 1). A geometric mean over many tokens moves far less than one token's ratio:
    the defaults are the GSPO paper's 3e-4 below and 4e-4 above."""
    gspo_clip_eps_high: float = Field(default=4e-4, gt=0)
    """``gspo``: upper clip range of the sequence ratio (clipped at ``1 +
    gspo_clip_eps_high``); > 0."""
    sequence_mask: SequenceMask = "off"
    """Sequence-level rejection of rollout/learner mismatch, with any ``loss``:
    ``geometric`` leaves out of every loss term all tokens of a sequence whose
    geometric-mean importance ratio ``exp(mean log(pi / pi_behaviour))`` over its trained
    tokens lies outside [``sequence_mask_low``, ``sequence_mask_high``] (SkyRL's geo
    mask; ``pi``: the policy the batch starts from); ``off``: no sequence is masked."""
    sequence_mask_low: float = Field(default=0.99, gt=0, le=1)
    """``sequence_mask = "geometric"``: the lowest geometric-mean ratio a sequence may have
    and still train; in (0, 1]."""
    sequence_mask_high: float = Field(default=1.01, ge=1)
    """``sequence_mask = "geometric"``: the highest geometric-mean ratio a sequence may
    have and still train; >= 1."""
    tis_cap: float = Field(default=2.0, ge=0)
    """Truncation of the behaviour importance weight: ``min(w, tis_cap)`` (``tis`` and
    ``decoupled_ppo``); 0 = no truncation."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the per-token KL penalty to the reference (the initial) policy; 0 = off
    (no reference forward pass)."""
    kl_estimator: KlEstimator = "k3"
    """KL estimator: ``k1`` = logp - ref, ``k2`` = (logp - ref)^2 / 2 (gradient linear in
    the log-ratio), ``k3`` = exp(ref - logp) - (ref - logp) - 1 (gradient grows
    exponentially where the reference is far likelier than the policy)."""


class LossConfig(LossFields):
    """The loss's knobs as the learner passes them around (immutable)."""

    model_config = ConfigDict(frozen=True)

    @classmethod
    def of(cls, settings: LossFields) -> LossConfig:
        """The loss fields of ``settings`` (``AlgorithmSettings``)."""
        return cls(**{k: getattr(settings, k) for k in LossFields.model_fields})
