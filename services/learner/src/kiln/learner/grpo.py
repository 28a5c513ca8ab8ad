"""GRPO advantages and the token-level, off-policy-corrected policy loss (pure functions).

Advantages are per group: reward minus the group mean (optionally divided by the group
std). Trajectories flagged ``infra_error`` are excluded before this point, so they
never shift a group's statistics.

The loss is PPO-clip on the per-token importance ratio pi_theta / pi_behaviour, where
the behaviour logprob is the one rollout recorded for that very token (a trajectory
may mix versions), averaged over all trained tokens of the batch (token-level, so
long trajectories are not down-weighted).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: list[float], std_normalize: bool, eps: float = 1e-6) -> list[float]:
    if not rewards:
        return []
    r = torch.tensor(rewards, dtype=torch.float64)
    a = r - r.mean()
    if std_normalize and len(rewards) > 1:
        a = a / (r.std(unbiased=False) + eps)
    return a.tolist()


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """All (B, T); ``advantages`` broadcast per token, ``mask`` 1 on trained tokens."""
    mask = mask.float()
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        stats = {
            "ratio_mean": float((ratio * mask).sum() / n),
            "clip_frac": float((((ratio - 1).abs() > clip_eps).float() * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return loss, stats
