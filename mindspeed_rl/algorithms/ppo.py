"""PPO's critic-side math: GAE advantages and returns, and the clipped value loss.

PPO learns a value function V (the critic) next to the policy. Its per-token advantage is
Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438): an exponentially
weighted sum of one-step TD errors,

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          (A and V are 0 after the last token)

``lam`` trades bias for variance: ``lam = 1`` is the Monte-Carlo return minus V (unbiased, noisy),
``lam = 0`` the one-step TD error (low variance, as biased as the critic). The critic regresses on
``returns = A + V``. Token rewards usually come from ``outcome_token_rewards`` (the score on the
last token), possibly minus a per-token KL penalty.

Follows verl's ``compute_gae_advantage_return`` and ``compute_value_loss`` (``core_algos.py``).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .functional import float_dtype, masked_mean, masked_whiten
from .losses import agg_loss, check_agg_mode


def _check_unit_interval(name: str, value: float, meaning: str) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(
            f"{name} must be in [0, 1] ({meaning}), got {value}; pass a value such as 1.0 "
            "(verl's default for both gamma and lam)"
        )


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages (whitened) and returns: ``[batch, len] x 3 -> ([batch, len], [batch, len])``.

    The recursion runs backwards over the response. After the last token the episode has ended,
    so the value that follows it is 0 (a response cut at the length limit is treated the same way,
    as verl does). At a padding position (mask 0) nothing happens: the next value and the running
    advantage carry through unchanged,

        nextvalues = V_t * m_t + (1 - m_t) * nextvalues
        lastgaelam = (delta_t + gamma * lam * lastgaelam) * m_t + (1 - m_t) * lastgaelam

    so a masked slot in the middle of a response (a tool's output, say, which the policy did not
    write) is skipped: the token before it bootstraps from the value of the token after it. Both
    updates go through ``torch.where`` so a NaN/inf reward or value in a padding slot never enters
    the carried state.

    ``returns = advantages + values`` is taken from the *raw* advantages, before whitening: it is
    the critic's regression target (the lambda-return), and whitening would change its scale. The
    advantages are then whitened over the mask (``masked_whiten``) for the policy loss, and come
    back as 0 at padding. Returns at padding positions are the carried advantage plus whatever
    value sits there: not meaningful, and ignored by ``value_loss``.

    Computed under ``torch.no_grad``: both are fixed targets, never differentiated (the critic's
    gradient comes from ``value_loss``).

    Raises:
        ValueError: shapes differ or are not 2-D, ``gamma`` or ``lam`` outside [0, 1], or fewer than
            2 real tokens in the batch (whitening needs a variance).
    """
    shapes = {t.shape for t in (token_rewards, values, mask)}
    if len(shapes) != 1 or values.dim() != 2:
        raise ValueError(
            "token_rewards, values and mask must share one 2-D [batch, response_len] shape; got "
            f"{[tuple(t.shape) for t in (token_rewards, values, mask)]}. Turn a [batch] score into "
            "token rewards with outcome_token_rewards first"
        )
    _check_unit_interval("gamma", gamma, "the per-token discount factor")
    _check_unit_interval("lam", lam, "GAE's lambda, the bias/variance trade-off")

    with torch.no_grad():
        dtype = float_dtype(token_rewards, values)
        rewards, values = token_rewards.to(dtype), values.to(dtype)
        mask_f = mask.to(dtype)
        keep = mask != 0

        nextvalues = torch.zeros_like(values[:, 0])
        lastgaelam = torch.zeros_like(values[:, 0])
        advantages_reversed = []
        for t in reversed(range(values.shape[-1])):
            m_t, keep_t = mask_f[:, t], keep[:, t]
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_new = delta + gamma * lam * lastgaelam
            nextvalues = torch.where(keep_t, values[:, t] * m_t + (1 - m_t) * nextvalues, nextvalues)
            lastgaelam = torch.where(keep_t, lastgaelam_new * m_t + (1 - m_t) * lastgaelam, lastgaelam)
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def value_loss(
    values_pred: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip_value: float,
    agg: str = "token-mean",
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO's clipped value loss, as verl's ``compute_value_loss``. Returns ``(loss, metrics)``.

    Per token, with the critic's new prediction V, the prediction at rollout time V_old and the
    GAE return R:

        V_clipped = V_old + clamp(V - V_old, -clip_value, clip_value)
        per_token = max((V - R)^2, (V_clipped - R)^2)
        loss      = 0.5 * agg_loss(per_token, mask, agg)

    Why: the same trust region as the policy's clip, applied to the critic. Once V has moved more
    than ``clip_value`` from V_old *towards* R, the clipped error is the larger one and it is
    constant in V, so the gradient stops; moving *away* from R is never clipped. The ``max`` is the
    pessimistic choice, as in the policy loss. The 0.5 makes the gradient ``V - R`` (verl's).
    Note ``clip_value`` is in the units of the returns (unlike the policy's ratio clip).

    ``values_pred`` carries the gradient; ``returns`` and ``old_values`` are constants (pass them
    detached). Padding slots are zeroed with ``torch.where`` before squaring, so a NaN return or
    value there (GAE's returns at padding are not meaningful) gives neither a NaN loss nor a NaN
    gradient.

    Metrics (Python floats, masked means over real tokens):

    * ``vf_clipfrac``: fraction of tokens where the clipped error strictly won.
    * ``vpred_mean``: mean of ``values_pred``.

    Raises:
        ValueError: ``clip_value`` negative or NaN, an unknown ``agg`` mode, or mismatched shapes.
    """
    if not clip_value >= 0:
        raise ValueError(
            f"clip_value (how far values_pred may move from old_values before the loss is clipped) "
            f"must be >= 0, got {clip_value}; pass e.g. 0.5 (verl's cliprange_value), or float('inf') "
            "for no clipping"
        )
    check_agg_mode(agg)
    tensors = (values_pred, returns, old_values, mask)
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(
            "values_pred, returns, old_values and mask must share one [batch, len] shape; got "
            f"{[tuple(t.shape) for t in tensors]}"
        )

    keep = mask != 0
    zero = torch.zeros((), dtype=values_pred.dtype, device=values_pred.device)
    values_clipped = old_values + torch.clamp(values_pred - old_values, -clip_value, clip_value)
    vf_losses1 = torch.where(keep, values_pred - returns, zero).square()
    vf_losses2 = torch.where(keep, values_clipped - returns, zero).square()
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    loss = 0.5 * agg_loss(clipped_vf_losses, mask, agg)

    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(torch.gt(vf_losses2, vf_losses1).to(vf_losses1.dtype), mask).item(),
            "vpred_mean": masked_mean(values_pred, mask).item(),
        }
    return loss, metrics
