"""Loss aggregation and the PPO/GRPO clipped policy loss, following verl's ``core_algos.py``.

All per-token tensors are ``[batch, response_len]`` and come with a response mask (1 for a real
token, 0 for padding).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Tuple

import torch

from ..config.vocab import AGG_MODES
from .functional import masked_mean, masked_sum

# verl clamps the log-ratio to this range before exp(): a stale or garbage log-prob can make the
# difference huge, exp() would give inf, and -0 * inf = NaN for a zero advantage.
LOG_RATIO_CLAMP = 20.0


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {list(AGG_MODES)}")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a ``[batch, len]`` per-token loss to a scalar, over real tokens only.

    The mode decides how tokens and sequences are weighted, which matters because responses have
    different lengths:

    * ``token-mean``: every real token in the batch weighs the same,
      ``sum(loss * mask) / (sum(mask) + 1e-8)``. Long responses carry more weight. verl's default
      (DAPO argues for it).
    * ``seq-mean-token-mean``: average within each response, then over responses; every response
      weighs the same whatever its length (the original GRPO paper's 1/|o_i| sum).
    * ``seq-mean-token-sum``: sum within each response, then average over responses; the loss
      grows with length.

    Rows whose mask is all zero are left out of the seq-mean (they are not counted in the number of
    sequences), and an all-zero mask gives 0 in every mode: never NaN. This matches verl's
    ``agg_loss`` + ``masked_mean`` as of its "exclude fully masked sequences" fix; earlier verl
    versions divided a fully masked row by 0 (NaN) in ``seq-mean-token-mean`` and counted
    such rows in the ``seq-mean-token-sum`` denominator.

    Raises:
        ValueError: ``mode`` is not one of ``AGG_MODES``, or the shapes differ / are not 2-D.
    """
    check_agg_mode(mode)
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat and mask must both be [batch, len]; got {tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)

    tokens_per_row = mask.to(loss_mat.dtype).sum(dim=-1)
    row_has_tokens = (tokens_per_row > 0).to(loss_mat.dtype)
    row_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = row_sums / (tokens_per_row + 1e-8)
    else:  # "seq-mean-token-sum"
        per_row = row_sums
    return masked_mean(per_row, row_has_tokens)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO's clipped surrogate with dual-clip, as verl's vanilla policy loss. Returns ``(loss, metrics)``.

    Per token, with ratio r = pi_new / pi_old = exp(log_prob - old_log_prob) and advantage A:

        loss1 = -A * r                                         plain policy gradient
        loss2 = -A * clamp(r, 1 - clip_low, 1 + clip_high)     PPO's trust region
        clipped = max(loss1, loss2)                            pessimistic (worse) of the two
        loss3 = -A * clip_c                                    dual-clip cap
        per_token = min(loss3, clipped) if A < 0 else clipped

    Why each piece:

    * The ``max`` is PPO's pessimism: once r has left the trust region *in the direction the
      advantage rewards*, the clamped term wins and its gradient is 0, so one batch cannot push
      the policy arbitrarily far.
    * For A < 0 and r >> 1 (the new policy now strongly prefers a bad token) ``-A * r`` is
      unbounded; the dual clip (Ye et al. 2020, arXiv:1912.09729) caps the loss at ``-A * clip_c``
      so a few stale, very off-policy tokens cannot dominate the update. Hence ``clip_c > 1``.
    * ``log_prob - old_log_prob`` is clamped to [-20, 20] before ``exp`` for numerical safety.

    ``log_prob`` carries the gradient; ``old_log_prob`` and ``advantages`` are treated as constants
    (pass them detached). Note the argument order: verl's functions take ``old_log_prob`` first.

    Metrics (Python floats, all masked means over real tokens):

    * ``pg_clipfrac``: fraction of tokens where the PPO clamp strictly won (``loss2 > loss1``).
      Tokens capped by the dual clip are *not* counted here.
    * ``ppo_kl``: mean of ``old_log_prob - log_prob`` (clamped), the k1 estimate of
      KL(pi_old || pi_new) from tokens sampled under pi_old.
    * ``pg_clipfrac_lower``: fraction of tokens with A < 0 where the dual clip was active.

    Raises:
        ValueError: ``clip_c <= 1``, an unknown ``agg`` mode, or mismatched shapes.
    """
    check_policy_loss_inputs(clip_c, agg, log_prob, old_log_prob, advantages, mask)
    terms = policy_loss_terms(log_prob, old_log_prob, advantages, clip_low, clip_high, clip_c)
    loss = agg_loss(terms.per_token, mask, agg)
    return loss, policy_loss_metrics(terms, advantages, mask)


class PolicyLossTerms(NamedTuple):
    """The unreduced pieces of ``policy_loss``, all ``[batch, len]``.

    Split out so a caller can reweight tokens before aggregating (the off-policy corrections in
    ``off_policy.py`` multiply ``per_token`` by behaviour importance weights) and still share
    every line of the clipping arithmetic and its metrics with ``policy_loss``.
    """

    per_token: torch.Tensor  # the clipped, dual-clipped loss of each token (carries the gradient)
    log_ratio: torch.Tensor  # log_prob - old_log_prob, clamped to [-20, 20]
    pg_losses1: torch.Tensor  # -A * r
    pg_losses2: torch.Tensor  # -A * clamp(r, 1 - clip_low, 1 + clip_high)
    pg_losses3: torch.Tensor  # -A * clip_c
    clip_pg_losses1: torch.Tensor  # max(pg_losses1, pg_losses2)


def check_policy_loss_inputs(clip_c: float, agg: str, *tensors: torch.Tensor) -> None:
    """``policy_loss``'s argument checks: clip_c > 1, a known ``agg``, one shared shape."""
    if not clip_c > 1.0:
        raise ValueError(f"clip_c (dual-clip lower bound of the ratio) must be > 1.0, got {clip_c}")
    check_agg_mode(agg)
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(
            "log_prob, old_log_prob, advantages and mask must share one [batch, len] shape; got "
            f"{[tuple(t.shape) for t in tensors]}"
        )


def policy_loss_terms(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
) -> PolicyLossTerms:
    """Per-token clipped + dual-clipped surrogate of ``policy_loss`` (see there for the formulas),
    not yet masked or aggregated. No argument checks: ``policy_loss`` does them."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(negative_approx_kl)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)

    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return PolicyLossTerms(pg_losses, negative_approx_kl, pg_losses1, pg_losses2, pg_losses3, clip_pg_losses1)


def policy_loss_metrics(terms: PolicyLossTerms, advantages: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower`` of ``policy_loss`` (masked means, floats)."""
    with torch.no_grad():
        dtype = terms.per_token.dtype
        is_negative = (advantages < 0).to(dtype)
        return {
            "pg_clipfrac": masked_mean(torch.gt(terms.pg_losses2, terms.pg_losses1).to(dtype), mask).item(),
            "ppo_kl": masked_mean(-terms.log_ratio, mask).item(),
            "pg_clipfrac_lower": masked_mean(
                torch.gt(terms.clip_pg_losses1, terms.pg_losses3).to(dtype) * is_negative, mask
            ).item(),
        }
