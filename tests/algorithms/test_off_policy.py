"""Off-policy correction (none / tis / decoupled) against hand-computed numbers and against ports of
verl's and AReaL's own arithmetic.

Hand-computed expectations are written out literally with the arithmetic in comments. The parity
tests port the reference functions line by line (cited at each) and compare on random tensors.
"""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import (
    AGG_MODES,
    OFF_POLICY_CORRECTIONS,
    behaviour_weights,
    corrected_policy_loss,
    policy_loss,
)

NAN = float("nan")
MODES = ("none", "tis", "decoupled")


def test_registry_names():
    assert tuple(OFF_POLICY_CORRECTIONS) == MODES


# ----------------------------------------------------------------------------------------------
# The 2x3 batch
# ----------------------------------------------------------------------------------------------
#
# old_log_prob = -1 everywhere; log_prob = old + ln(r); rollout_log_prob = old - ln(w), so the
# PPO ratio exp(log_prob - old) = r and the raw behaviour weight exp(old - rollout) = w.
# clip 0.2 / 0.2, clip_c 3, cap 2.
#
# Row 0, A = +1, mask [1, 1, 1], r = [1.5, 0.5, 1.1], w = [0.5, 3, 1]
#   r=1.5: max(-1.5, -1.2) = -1.2   (PPO clip)
#   r=0.5: max(-0.5, -0.8) = -0.5
#   r=1.1: -1.1                     (inside the trust region)
# Row 1, A = -2, mask [1, 1, 0], r = [4, 0.9, pad], w = [2, 1.5, pad]
#   r=4:   max(8, 2.4) = 8; dual clip min(8, 2 * 3 = 6) = 6
#   r=0.9: max(1.8, 2 * 0.9 = 1.8) = 1.8 (0.9 is inside [0.8, 1.2]); min(6, 1.8) = 1.8
#   pad:   log_prob = 50, rollout_log_prob = NaN (garbage, masked out)
# Per-token PPO losses on real tokens: -1.2, -0.5, -1.1 | 6, 1.8
#
# Weights applied:
#   none:      1, 1, 1 | 1, 1
#   tis:       min(w, 2) = 0.5, 2, 1 | 2, 1.5
#   decoupled: w if w <= 2 else 0 = 0.5, 0, 1 | 2, 1.5    (w = 3 dropped; w = 2 == cap kept)
# Weighted losses:
#   none:      -1.2, -0.5, -1.1 | 6, 1.8      row sums -2.8 | 7.8
#   tis:       -0.6, -1.0, -1.1 | 12, 2.7     row sums -2.7 | 14.7
#   decoupled: -0.6,  0,   -1.1 | 12, 2.7     row sums -1.7 | 14.7
# token-mean (5 real tokens; decoupled keeps the dropped token in the denominator, as AReaL):
#   none 5.0 / 5 = 1.0;  tis 12.0 / 5 = 2.4;  decoupled 13.0 / 5 = 2.6
# seq-mean-token-mean:
#   none (-2.8 / 3 + 7.8 / 2) / 2 = (-0.9333333 + 3.9) / 2 = 1.4833333
#   tis  (-2.7 / 3 + 14.7 / 2) / 2 = (-0.9 + 7.35) / 2 = 3.225
#   decoupled (-1.7 / 3 + 7.35) / 2 = (-0.5666667 + 7.35) / 2 = 3.3916667
# seq-mean-token-sum:
#   none (-2.8 + 7.8) / 2 = 2.5;  tis (-2.7 + 14.7) / 2 = 6.0;  decoupled (-1.7 + 14.7) / 2 = 6.5
EXPECTED = {
    "none": {"token-mean": 1.0, "seq-mean-token-mean": 1.4833333, "seq-mean-token-sum": 2.5},
    "tis": {"token-mean": 2.4, "seq-mean-token-mean": 3.225, "seq-mean-token-sum": 6.0},
    "decoupled": {"token-mean": 2.6, "seq-mean-token-mean": 3.3916667, "seq-mean-token-sum": 6.5},
}


def _batch():
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    lp = old + torch.log(torch.tensor([[1.5, 0.5, 1.1], [4.0, 0.9, 1.0]], dtype=torch.float64))
    lp[1, 2] = 50.0
    rollout = old - torch.log(torch.tensor([[0.5, 3.0, 1.0], [2.0, 1.5, 1.0]], dtype=torch.float64))
    rollout[1, 2] = NAN
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return lp.requires_grad_(True), old, rollout, adv, mask


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_corrected_loss_hand_computed(mode, agg):
    lp, old, rollout, adv, mask = _batch()
    loss, metrics = corrected_policy_loss(lp, old, rollout, adv, mask, mode=mode, cap=2.0, agg=agg)
    assert loss.item() == pytest.approx(EXPECTED[mode][agg], abs=1e-6)
    # policy_loss's metrics are unweighted and the same in every mode:
    #   pg_clipfrac: PPO clip won only at row 0 r=1.5 -> 1/5; dual clip only at row 1 r=4 -> 1/5
    #   ppo_kl = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 4 + ln 0.9) / 5 = -ln(1.5 * 0.5 * 1.1 * 4 * 0.9) / 5
    #          = -ln(2.97) / 5 = -1.0885619 / 5 = -0.2177124
    assert metrics["pg_clipfrac"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["ppo_kl"] == pytest.approx(-0.2177124, abs=1e-6)
    # Raw weights over real tokens 0.5, 3, 1, 2, 1.5 (padding's NaN ignored):
    #   mean 8 / 5 = 1.6, max 3; one of five above the cap (2 == cap is not) -> 0.2 (0 for none)
    #   kl = mean(rollout - old) = -(ln 0.5 + ln 3 + ln 1 + ln 2 + ln 1.5) / 5 = -ln(4.5) / 5
    #      = -1.5040774 / 5 = -0.3008155
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(1.6, abs=1e-6)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(3.0, abs=1e-9)
    assert metrics["off_policy/is_clip_frac"] == pytest.approx(0.0 if mode == "none" else 0.2, abs=1e-6)
    assert metrics["off_policy/kl"] == pytest.approx(-0.3008155, abs=1e-6)
    assert all(type(v) is float for v in metrics.values())


@pytest.mark.parametrize(
    "mode, weights, keep",
    [
        ("none", [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], [[1, 1, 1], [1, 1, 0]]),
        ("tis", [[0.5, 2.0, 1.0], [2.0, 1.5, 0.0]], [[1, 1, 1], [1, 1, 0]]),
        ("decoupled", [[0.5, 0.0, 1.0], [2.0, 1.5, 0.0]], [[1, 0, 1], [1, 1, 0]]),
    ],
)
def test_behaviour_weights_hand_computed(mode, weights, keep):
    _, old, rollout, _, mask = _batch()
    w, k, _ = behaviour_weights(old, rollout, mask, mode, 2.0)
    torch.testing.assert_close(w, torch.tensor(weights, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(k, torch.tensor(keep).bool())
    assert not w.requires_grad


@pytest.mark.parametrize(
    "mode, expected",
    [
        # token-mean, d/d log_prob: plain PPO gradient times the weight. Plain gradient:
        #   row 0: r=1.5 clipped -> 0; r=0.5 -> -A r / 5 = -0.5 / 5 = -0.1; r=1.1 -> -1.1 / 5 = -0.22
        #   row 1: r=4 dual-clipped -> 0; r=0.9 -> 2 * 0.9 / 5 = 0.36; padding -> 0
        ("none", [[0.0, -0.1, -0.22], [0.0, 0.36, 0.0]]),
        # tis: -0.1 * 2 = -0.2, -0.22 * 1 = -0.22, 0.36 * 1.5 = 0.54
        ("tis", [[0.0, -0.2, -0.22], [0.0, 0.54, 0.0]]),
        # decoupled: the r=0.5 token (w = 3) is dropped -> 0; the rest as tis
        ("decoupled", [[0.0, 0.0, -0.22], [0.0, 0.54, 0.0]]),
    ],
)
def test_gradient_flows_only_through_log_prob(mode, expected):
    lp, old, rollout, adv, mask = _batch()
    rollout = rollout.clone().requires_grad_(True)
    loss, _ = corrected_policy_loss(lp, old, rollout, adv, mask, mode=mode, cap=2.0)
    loss.backward()
    # (atol 1e-8: token-mean divides by 5 + 1e-8, a relative 2e-9)
    torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-8, rtol=0)
    assert rollout.grad is None  # the weights are detached: nothing reaches the behaviour log-probs


def test_weights_are_detached_even_when_old_log_prob_requires_grad():
    _, old, rollout, _, mask = _batch()
    w, _, _ = behaviour_weights(old.clone().requires_grad_(True), rollout.clone().requires_grad_(True), mask, "tis")
    assert not w.requires_grad and w.grad_fn is None


@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_ignored(mode):
    # Change everything in the padding slot (row 1, col 2): log-probs, rollout, advantage. Nothing moves.
    lp, old, rollout, adv, mask = _batch()
    loss_a, m_a = corrected_policy_loss(lp, old, rollout, adv, mask, mode=mode)
    lp2, old2, rollout2, adv2 = lp.detach().clone(), old.clone(), rollout.clone(), adv.clone()
    lp2[1, 2], old2[1, 2], rollout2[1, 2], adv2[1, 2] = -70.0, 40.0, -90.0, 1e6
    loss_b, m_b = corrected_policy_loss(lp2, old2, rollout2, adv2, mask, mode=mode)
    assert loss_a.item() == loss_b.item()
    assert m_a == m_b


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_no_staleness_is_exactly_plain_ppo(mode, agg):
    # rollout_log_prob == old_log_prob: every weight is exp(0) = 1 exactly, so loss and gradient are
    # bit-for-bit policy_loss's.
    lp, old, adv, mask = _random_batch(seed=1)
    lp_ref = lp.detach().clone().requires_grad_(True)
    ref, ref_m = policy_loss(lp_ref, old, adv, mask, agg=agg)
    got, got_m = corrected_policy_loss(lp, old, old.clone(), adv, mask, mode=mode, cap=2.0, agg=agg)
    assert torch.equal(got, ref)
    ref.backward()
    got.backward()
    assert torch.equal(lp.grad, lp_ref.grad)
    assert {k: got_m[k] for k in ref_m} == ref_m
    assert got_m["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-7)
    assert got_m["off_policy/is_clip_frac"] == 0.0 and got_m["off_policy/kl"] == 0.0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_none_is_plain_policy_loss_whatever_the_staleness(agg):
    lp, old, adv, mask = _random_batch(seed=2)
    rollout = old + 0.7 * torch.randn(old.shape, dtype=old.dtype, generator=torch.Generator().manual_seed(3))
    ref, ref_m = policy_loss(lp, old, adv, mask, agg=agg)
    got, got_m = corrected_policy_loss(lp, old, rollout, adv, mask, mode="none", agg=agg)
    assert torch.equal(got, ref)
    assert {k: got_m[k] for k in ref_m} == ref_m
    # ... and without rollout_log_prob at all (synchronous training): no off_policy/ metrics
    got, got_m = corrected_policy_loss(lp, old, None, adv, mask, mode="none", agg=agg)
    assert torch.equal(got, ref) and got_m == ref_m


@pytest.mark.parametrize("cap", [1.0, 1.5, 2.0, 5.0])
def test_cap_respected(cap):
    _, old, _, mask = _random_batch(seed=4)
    rollout = old + 1.0 * torch.randn(old.shape, dtype=old.dtype, generator=torch.Generator().manual_seed(5))
    raw = torch.exp(old - rollout)
    real = mask != 0
    w, keep, m = behaviour_weights(old, rollout, mask, "tis", cap)
    assert (w <= cap).all() and torch.equal(keep, real)
    torch.testing.assert_close(w[real], torch.clamp(raw, max=cap)[real])
    above = (raw > cap) & real
    assert above.any() and m["off_policy/is_clip_frac"] == pytest.approx(above.sum().item() / real.sum().item())
    w, keep, m = behaviour_weights(old, rollout, mask, "decoupled", cap)
    assert (w <= cap).all()
    assert torch.equal(keep, real & (raw <= cap))
    torch.testing.assert_close(w[keep], raw[keep])
    assert (w[~keep] == 0).all()
    assert m["off_policy/is_clip_frac"] == pytest.approx(above.sum().item() / real.sum().item())


def test_infinite_cap_means_no_cap():
    _, old, _, mask = _random_batch(seed=6)
    rollout = old + torch.randn(old.shape, dtype=old.dtype, generator=torch.Generator().manual_seed(7))
    real = mask != 0
    for mode in ("tis", "decoupled"):
        w, keep, m = behaviour_weights(old, rollout, mask, mode, math.inf)
        torch.testing.assert_close(w[real], torch.exp(old - rollout)[real])
        assert torch.equal(keep, real) and m["off_policy/is_clip_frac"] == 0.0


def test_all_padding_gives_zero_metrics_not_nan():
    z = torch.zeros(2, 3, dtype=torch.float64)
    loss, m = corrected_policy_loss(z, z, z, z, z, mode="decoupled")
    assert loss.item() == 0.0
    assert m["off_policy/is_weight_max"] == 0.0 and m["off_policy/is_weight_mean"] == 0.0


def test_errors():
    lp, old, rollout, adv, mask = _batch()
    expected_names = r"unknown off_policy_correction 'is'; expected one of \['none', 'tis', 'decoupled'\]"
    with pytest.raises(ValueError, match=expected_names):
        corrected_policy_loss(lp, old, rollout, adv, mask, mode="is")
    for bad in (0.5, NAN):
        with pytest.raises(ValueError, match=r"tis_cap must be >= 1.0"):
            behaviour_weights(old, rollout, mask, "tis", bad)
    with pytest.raises(ValueError, match=r"'decoupled' needs rollout_log_prob.*got None"):
        corrected_policy_loss(lp, old, None, adv, mask, mode="decoupled")
    with pytest.raises(ValueError, match=r"must share one \[batch, len\] shape"):
        behaviour_weights(old, rollout[:, :2], mask, "tis")
    with pytest.raises(ValueError, match=r"clip_c"):
        corrected_policy_loss(lp, old, rollout, adv, mask, mode="tis", clip_c=1.0)


# ----------------------------------------------------------------------------------------------
# Parity with verl and AReaL (their arithmetic ported into the test as the reference)
# ----------------------------------------------------------------------------------------------


def _random_batch(seed, b=8, r=16):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, r, dtype=torch.float64, generator=g) * 3.0
    lp = (old + 0.3 * torch.randn(b, r, dtype=torch.float64, generator=g)).requires_grad_(True)
    adv = torch.randn(b, r, dtype=torch.float64, generator=g)
    lengths = torch.randint(1, r + 1, (b,), generator=g)  # every row has at least one real token
    mask = (torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return lp, old, adv, mask


def _verl_masked_mean(values, mask):
    # verl/utils/torch_functional.py masked_mean
    return (values * mask).sum() / (mask.sum() + 1e-8)


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    # verl/trainer/ppo/core_algos.py agg_loss
    if loss_agg_mode == "token-mean":
        return _verl_masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1))
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1))
    raise ValueError(loss_agg_mode)


def _verl_reference(old_log_prob, log_prob, rollout_log_prob, advantages, response_mask, *, clip_ratio_low,
                    clip_ratio_high, clip_ratio_c, rollout_is_threshold, loss_agg_mode):
    """verl's token-level TIS, ported from
    * verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_correction_weights`` (rollout_is="token",
      rollout_is_batch_normalize=False) and its ``compute_is_metrics`` (token branch: mean, max,
      ratio_fraction_high), called by ``compute_rollout_correction_and_rejection_mask`` with
      ``log_ratio = old_log_prob - rollout_log_prob``;
    * verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla`` (``pg_losses = pg_losses *
      rollout_is_weights`` before ``agg_loss``).
    """
    SAFETY_BOUND = 20.0
    log_ratio = old_log_prob - rollout_log_prob
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    rollout_is_weights = torch.exp(log_ratio_safe)
    rollout_is_weights = rollout_is_weights * response_mask
    mask_bool = response_mask.bool()
    metrics = {
        "rollout_is_mean": _verl_masked_mean(rollout_is_weights, response_mask).item(),
        "rollout_is_ratio_fraction_high": _verl_masked_mean(
            (rollout_is_weights > rollout_is_threshold).float(), response_mask).item(),
        "rollout_is_max": rollout_is_weights.masked_fill(~mask_bool, float("-inf")).max().item(),
    }
    rollout_is_weights = rollout_is_weights.clamp(max=rollout_is_threshold)
    rollout_is_weights = rollout_is_weights.detach()

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_losses = pg_losses * rollout_is_weights
    return _verl_agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


def _areal_reference(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                     eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None):
    """AReaL's decoupled PPO loss, ported from areal/utils/functional.py ``ppo_actor_loss_fn``
    (inclusionAI/AReaL). Note AReaL's naming: ``proximal_logprobs`` is our old_log_prob (recomputed),
    ``old_logprobs`` is our rollout_log_prob (from the inference engine)."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    behav_kl = proximal_logprobs - old_logprobs
    behav_imp_weight = behav_kl.exp()
    behav_mask = (
        (behav_imp_weight <= behav_imp_weight_cap).logical_and(loss_mask)
        if behav_imp_weight_cap is not None
        else loss_mask
    )
    behav_imp_weight = torch.where(behav_mask, behav_imp_weight, 0.0)
    pg_loss = pg_loss * behav_imp_weight
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count
    return pg_loss, behav_mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_tis_matches_verl(seed, agg):
    lp, old, adv, mask = _random_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    rollout = old + 0.7 * torch.randn(old.shape, dtype=old.dtype, generator=g)
    lp_ref = lp.detach().clone().requires_grad_(True)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_threshold=2.0)
    ref, ref_m = _verl_reference(old, lp_ref, rollout, adv, mask, loss_agg_mode=agg, **kw)
    got, got_m = corrected_policy_loss(lp, old, rollout, adv, mask, mode="tis", cap=2.0, clip_low=0.2,
                                       clip_high=0.28, clip_c=3.0, agg=agg)
    assert ref_m["rollout_is_ratio_fraction_high"] > 0  # the cap is exercised
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-7)
    ref.backward()
    got.backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-9, rtol=1e-7)
    assert got_m["off_policy/is_weight_mean"] == pytest.approx(ref_m["rollout_is_mean"], abs=1e-7)
    assert got_m["off_policy/is_weight_max"] == pytest.approx(ref_m["rollout_is_max"], abs=1e-9)
    assert got_m["off_policy/is_clip_frac"] == pytest.approx(ref_m["rollout_is_ratio_fraction_high"], abs=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [1.5, 2.0, 5.0])
def test_decoupled_matches_areal(seed, cap):
    lp, old, adv, mask = _random_batch(seed)
    g = torch.Generator().manual_seed(200 + seed)
    rollout = old + 0.7 * torch.randn(old.shape, dtype=old.dtype, generator=g)
    lp_ref = lp.detach().clone().requires_grad_(True)
    ref, behav_mask = _areal_reference(lp_ref, old, rollout, adv, eps_clip=0.2, loss_mask=mask.bool(),
                                       eps_clip_higher=0.28, c_clip=3.0, behav_imp_weight_cap=cap)
    got, got_m = corrected_policy_loss(lp, old, rollout, adv, mask, mode="decoupled", cap=cap, clip_low=0.2,
                                       clip_high=0.28, clip_c=3.0, agg="token-mean")
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-7)
    ref.backward()
    got.backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-9, rtol=1e-7)
    _, keep, _ = behaviour_weights(old, rollout, mask, "decoupled", cap)
    assert torch.equal(keep, behav_mask)
    dropped = 1.0 - behav_mask.sum().item() / mask.sum().item()
    assert got_m["off_policy/is_clip_frac"] == pytest.approx(dropped, abs=1e-7)
