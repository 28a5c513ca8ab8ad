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

LossName = Literal["ppo_clip", "decoupled_ppo", "tis"]
KlEstimator = Literal["k1", "k2", "k3"]
LOSSES: tuple[str, ...] = get_args(LossName)
KL_ESTIMATOR_NAMES: tuple[str, ...] = get_args(KlEstimator)


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
    (policy gradient with truncated importance weights)."""
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
