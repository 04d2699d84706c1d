"""Off-policy correction of the PPO/GRPO policy loss, for training on rollouts up to k weight versions stale.

With asynchronous (bounded-staleness) training three policies meet in one loss:

* the *behaviour* policy pi_behav that sampled the tokens (the rollout engine's weights at the time;
  its per-token log-probs are ``rollout_log_prob``);
* the *proximal* policy pi_prox, the actor as it is when this batch reaches training (its log-probs
  are recomputed before the update: ``old_log_prob``);
* the policy being trained, pi_theta (``log_prob``, the only tensor with a gradient).

PPO's ratio r = pi_theta / pi_prox keeps its usual meaning (a trust region around the policy the
update starts from), but the tokens were drawn from pi_behav, not pi_prox, so each token's loss is
reweighted by the behaviour importance weight w = pi_prox / pi_behav = exp(old_log_prob -
rollout_log_prob). That is "decoupled PPO" (Hilton et al. 2021, "Batch size-invariance for policy
optimization", arXiv:2110.00641), as AReaL trains asynchronously. Raw weights are heavy-tailed
(a token the behaviour policy sampled at low probability that the proximal policy now likes), so the
weight is bounded by ``cap``; the modes differ in what they do above it:

* ``none``: w = 1, plain PPO against ``old_log_prob`` (the staleness is ignored).
* ``tis``: truncated IS, w = min(w, cap), as verl's rollout correction (token-level
  ``rollout_is``; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"). A truncated token still pushes, at most ``cap`` times as hard.
* ``decoupled``: AReaL's ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap``: a token whose
  weight exceeds the cap is *dropped* (w = 0), the others keep their untruncated weight.

``OFF_POLICY_CORRECTIONS`` is the one place these names live. Metrics use the ``off_policy/`` prefix.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from .functional import float_dtype, masked_mean
from .losses import LOG_RATIO_CLAMP, agg_loss, check_policy_loss_inputs, policy_loss_metrics, policy_loss_terms

# (raw weights [B, R], real-token mask [B, R] bool, cap) -> (weights, keep, changed): the weights
# to multiply the per-token loss by (0 off ``keep``), the tokens that still carry a gradient, and the
# real tokens whose weight the mode altered (truncated or dropped; what ``is_clip_frac`` counts).
CorrectionFn = Callable[[torch.Tensor, torch.Tensor, float], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _no_correction(raw: torch.Tensor, real: torch.Tensor, cap: float):
    """w = 1 on every real token: exactly ``policy_loss``."""
    return real.to(raw.dtype), real, torch.zeros_like(real)


def _truncated_is(raw: torch.Tensor, real: torch.Tensor, cap: float):
    """w = min(pi_prox / pi_behav, cap), verl's token-level TIS (``rollout_is_weights.clamp(max=cap)``).

    Why truncate: the untruncated weight makes the gradient estimate unbiased but its variance is
    unbounded (one token with w = 50 can dominate a batch); capping bounds each token's influence
    at ``cap`` times an on-policy token's, at the price of under-weighting (a bias on) exactly the
    tokens whose weight was capped. Every token stays in the update.
    """
    return raw.clamp(max=cap), real, real & (raw > cap)


def _decoupled(raw: torch.Tensor, real: torch.Tensor, cap: float):
    """w = pi_prox / pi_behav where it is <= cap, else 0: AReaL's ``behav_mask`` / ``behav_imp_weight``.

    AReaL keeps a token iff ``behav_imp_weight <= behav_imp_weight_cap`` (a weight equal to the cap is
    kept), multiplies the loss by the untruncated weight, and zeroes the rest. Why drop rather than
    truncate: a weight above the cap means the stale behaviour policy sampled a token the proximal
    policy now likes far more; AReaL treats such tokens as outliers to leave out of the update,
    rather than letting each still push at ``cap`` times an on-policy token's weight.
    """
    keep = real & (raw <= cap)
    return torch.where(keep, raw, torch.zeros_like(raw)), keep, real & ~keep


OFF_POLICY_CORRECTIONS: Dict[str, CorrectionFn] = {
    "none": _no_correction,
    "tis": _truncated_is,
    "decoupled": _decoupled,
}


def _check_mode_and_cap(mode: str, cap: float) -> None:
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"unknown off_policy_correction {mode!r}; expected one of {list(OFF_POLICY_CORRECTIONS)}"
        )
    if math.isnan(cap) or cap < 1.0:
        raise ValueError(
            f"tis_cap must be >= 1.0 (math.inf for no cap), got {cap}: the weight of an on-policy token is "
            "exactly 1, and a cap below 1 would down-weight (tis) or drop (decoupled) every fresh token too"
        )


def behaviour_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    mask: torch.Tensor,
    mode: str,
    cap: float = 2.0,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """Behaviour importance weights pi_prox / pi_behav per token. Returns ``(weights, keep, metrics)``.

    The raw weight is ``exp(clamp(old_log_prob - rollout_log_prob, -20, 20))`` (verl's safety
    bound, the same as ``policy_loss``'s: a garbage log-prob cannot make it inf), then bounded as
    ``mode`` says (see the module docstring and ``OFF_POLICY_CORRECTIONS``):

    * ``weights`` ``[B, R]``: what to multiply each token's loss by; detached (the weights change
      the measure the tokens were drawn from, not the objective: no gradient may flow through
      them), and 0 on padding and on dropped tokens.
    * ``keep`` ``[B, R]`` bool: the real tokens whose weight is non-zero, i.e. that carry a gradient.
      ``corrected_policy_loss`` still divides by the original ``mask`` (AReaL's denominator, which
      counts dropped tokens); a caller wanting verl's rejection-sampling normalisation instead
      (dropped tokens out of the denominator too) can aggregate over ``keep``.
    * ``metrics`` (Python floats, over real tokens; empty for ``none`` without ``rollout_log_prob``):

      - ``off_policy/is_weight_mean``, ``off_policy/is_weight_max``: of the *raw* weights, before the
        cap (as verl's ``rollout_is_mean`` / ``rollout_is_max``): how stale the batch is, whichever
        mode is on. ``max`` is 0 when no token is real.
      - ``off_policy/is_clip_frac``: fraction of real tokens the mode changed: raw weight > cap,
        truncated (``tis``, verl's ``rollout_is_ratio_fraction_high``) or dropped (``decoupled``,
        1 - AReaL's ``behave_mask`` fraction); 0 for ``none``.
      - ``off_policy/kl``: mean of ``rollout_log_prob - old_log_prob``, the k1 estimate of
        KL(pi_behav || pi_prox) (verl's ``rollout_corr/kl``).

    ``rollout_log_prob`` may be None only with ``mode="none"`` (synchronous training has none).

    Raises:
        ValueError: unknown ``mode``, ``cap`` < 1 or NaN, mismatched shapes, or a correcting mode
            without ``rollout_log_prob``.
    """
    _check_mode_and_cap(mode, cap)
    real = mask != 0
    if rollout_log_prob is None:
        if mode != "none":
            raise ValueError(
                f"off_policy_correction={mode!r} needs rollout_log_prob (the behaviour policy's per-token "
                "log-probs, from the rollout engine); got None. Have the rollout return its log-probs, or "
                "use off_policy_correction='none'"
            )
        if old_log_prob.shape != mask.shape:
            raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)} and mask {tuple(mask.shape)} differ in shape")
        return real.to(float_dtype(old_log_prob)), real, {}
    if not old_log_prob.shape == rollout_log_prob.shape == mask.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and mask must share one [batch, len] shape; got "
            f"{[tuple(t.shape) for t in (old_log_prob, rollout_log_prob, mask)]}"
        )
    with torch.no_grad():
        old, behav = old_log_prob.detach(), rollout_log_prob.detach()
        dtype = float_dtype(old, behav)
        log_w = torch.clamp(old.to(dtype) - behav.to(dtype), min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        # where(), not * mask: a NaN log-prob in a padding slot must not survive as NaN * 0.
        raw = torch.where(real, torch.exp(log_w), torch.zeros_like(log_w))
        weights, keep, changed = OFF_POLICY_CORRECTIONS[mode](raw, real, cap)
        metrics = {
            "off_policy/is_weight_mean": masked_mean(raw, mask).item(),
            "off_policy/is_weight_max": raw.masked_fill(~real, -math.inf).max().item() if real.any() else 0.0,
            "off_policy/is_clip_frac": masked_mean(changed.to(dtype), mask).item(),
            "off_policy/kl": masked_mean(behav.to(dtype) - old.to(dtype), mask).item(),
        }
    return weights, keep, metrics


def corrected_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``policy_loss`` with each token's loss multiplied by its behaviour weight. Returns ``(loss, metrics)``.

    Per token, with r = exp(log_prob - old_log_prob) (w.r.t. the *proximal* policy) and w from
    ``behaviour_weights(old_log_prob, rollout_log_prob, mask, mode, cap)``:

        per_token = w * ppo_clipped_dual_clipped(r, A)          (``policy_loss_terms``, unchanged)
        loss = agg_loss(per_token, mask, agg)

    The denominator is the original ``mask``, so a token ``decoupled`` drops still counts in it, as
    in AReaL (``pg_loss = where(loss_mask, pg_loss * w, 0).sum() / loss_mask.count_nonzero()``).
    With ``rollout_log_prob == old_log_prob`` (no staleness) every weight is exactly 1 and every
    mode returns exactly ``policy_loss``; ``mode="none"`` always does.

    Differences from the references, all outside their normal operating range: the PPO log-ratio
    is clamped to [-20, 20] (verl does this, AReaL does not), and so is the behaviour log-ratio
    (verl's newer ``rollout_corr_helper`` does; verl's older ``tis_imp_ratio_cap`` and AReaL do
    not): the weight of a token with |old - rollout| > 20 differs, but it is dropped or truncated
    for any cap < e^20 either way. AReaL's dual clip is written ``min(loss, c * |A|)`` for every
    token; for A >= 0 the clipped loss is <= 0 <= c * |A|, so it is the same as verl's A < 0 only.

    Metrics: ``policy_loss``'s (``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``, over the original
    mask, before weighting) plus ``behaviour_weights``' ``off_policy/*``.

    Raises:
        ValueError: as ``policy_loss`` and ``behaviour_weights``.
    """
    check_policy_loss_inputs(clip_c, agg, log_prob, old_log_prob, advantages, mask)
    weights, _keep, off_metrics = behaviour_weights(old_log_prob, rollout_log_prob, mask, mode, cap)
    terms = policy_loss_terms(log_prob, old_log_prob, advantages, clip_low, clip_high, clip_c)
    loss = agg_loss(terms.per_token * weights.to(terms.per_token.device), mask, agg)
    return loss, {**policy_loss_metrics(terms, advantages, mask), **off_metrics}
