"""masked_var / masked_whiten, GAE advantages and returns, and the clipped value loss against hand-computed numbers.

Every expected value below is written out literally, with the arithmetic in a comment; none is
produced by re-running the formula under test. Tolerances are ~1e-7 rather than float64 exact because
the masked means divide by ``count + 1e-8`` (verl's guard), a relative error of about 1e-8 / count.
"""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import AGG_MODES, gae_advantages, masked_var, masked_whiten, value_loss

NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------------------------
# masked_var / masked_whiten
# ----------------------------------------------------------------------------------------------

# Real values 1, 2, 3, 4 (padding holds NaN and inf, which must not count):
#   mean = 10 / 4 = 2.5; deviations -1.5, -0.5, 0.5, 1.5; squares 2.25 + 0.25 + 0.25 + 2.25 = 5
#   biased var = 5 / 4 = 1.25; unbiased = 5 / (4 - 1) = 1.6666667
#   whitened = dev / sqrt(1.6666667) = dev * 0.7745967 = -1.161895, -0.3872983, 0.3872983, 1.161895
#   (the 1e-8 under the square root moves these by a relative 3e-9)
WHITEN_VALUES = [[1.0, 2.0, NAN], [3.0, 4.0, INF]]
WHITEN_MASK = [[1, 1, 0], [1, 1, 0]]


def test_masked_var_unbiased_and_biased():
    values, mask = torch.tensor(WHITEN_VALUES), torch.tensor(WHITEN_MASK)
    assert masked_var(values, mask).item() == pytest.approx(1.6666667, abs=1e-6)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(1.25, abs=1e-6)


def test_masked_whiten_hand_computed():
    out = masked_whiten(torch.tensor(WHITEN_VALUES), torch.tensor(WHITEN_MASK))
    # Padding comes back as exactly 0 (not NaN/inf).
    expected = torch.tensor([[-1.161895, -0.3872983, 0.0], [0.3872983, 1.161895, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_masked_whiten_without_shifting_the_mean():
    # shift_mean=False adds the mean 2.5 back: 2.5 - 1.161895 = 1.338105, 2.5 - 0.3872983 = 2.1127017,
    # 2.5 + 0.3872983 = 2.8872983, 2.5 + 1.161895 = 3.661895; padding is still 0.
    out = masked_whiten(torch.tensor(WHITEN_VALUES), torch.tensor(WHITEN_MASK), shift_mean=False)
    expected = torch.tensor([[1.338105, 2.1127017, 0.0], [2.8872983, 3.661895, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_masked_whiten_padding_garbage_gives_no_nan_gradient():
    values = torch.tensor(WHITEN_VALUES, requires_grad=True)
    out = masked_whiten(values, torch.tensor(WHITEN_MASK))
    # d out[0, 0] / d values: finite on the real tokens (positive on values[0, 0] itself, since
    # raising it raises its own z-score), exactly 0 on the NaN / inf padding, and no NaN leaks in
    # through the backward of (nan - mean) or (nan - mean)^2.
    out[0, 0].backward()
    assert torch.isfinite(values.grad).all()
    assert values.grad[0, 2].item() == 0.0 and values.grad[1, 2].item() == 0.0
    assert values.grad[0, 0].item() > 0


def test_masked_whiten_bool_and_float_masks_agree():
    values = torch.tensor(WHITEN_VALUES)
    a = masked_whiten(values, torch.tensor(WHITEN_MASK).bool())
    b = masked_whiten(values, torch.tensor(WHITEN_MASK).float())
    assert torch.equal(a, b)


@pytest.mark.parametrize("mask, count", [([[1, 0, 0], [0, 0, 0]], "1"), ([[0, 0, 0], [0, 0, 0]], "0")])
def test_masked_var_needs_two_positions(mask, count):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    with pytest.raises(ValueError, match=rf"at least 2 masked positions, got a mask sum of {count}:.*count - 1"):
        masked_var(values, torch.tensor(mask))
    with pytest.raises(ValueError, match=r"at least 2 masked positions"):
        masked_whiten(values, torch.tensor(mask))
    # The biased variance of one value is 0 (and of none, 0 / 1e-8 = 0): no error.
    assert masked_var(values, torch.tensor(mask), unbiased=False).item() == 0.0


# ----------------------------------------------------------------------------------------------
# gae_advantages
# ----------------------------------------------------------------------------------------------


def test_gae_gamma_one_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: the TD errors telescope, A_t = sum_{k >= t} r_k - V_t, and
    # returns = A + V = reward-to-go (whatever V is).
    #   row 0: r = [0, 0, 1],  V = [0.5, 0.25, 0.75]:  RTG = [1, 1, 1];    A = [0.5, 0.75, 0.25]
    #   row 1: r = [0, 0, -1], V = [0, 0.5, -0.5]:     RTG = [-1, -1, -1]; A = [-1, -1.5, -0.5]
    # Whitening the 6 raw advantages: sum = 1.5 - 3 = -1.5, mean = -0.25
    #   deviations 0.75, 1, 0.5, -0.75, -1.25, -0.25; squares sum to
    #   0.5625 + 1 + 0.25 + 0.5625 + 1.5625 + 0.0625 = 4; unbiased var = 4 / 5 = 0.8
    #   1 / sqrt(0.8) = 1.118034 -> 0.8385255, 1.118034, 0.5590170, -0.8385255, -1.3975425, -0.2795085
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 0.75], [0.0, 0.5, -0.5]], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, torch.ones(2, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64))
    expected = torch.tensor(
        [[0.8385255, 1.118034, 0.5590170], [-0.8385255, -1.3975425, -0.2795085]], dtype=torch.float64
    )
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


# gamma = 0.9, lam = 0.8 (gamma * lam = 0.72); padding in the middle of row 0 and at the end of
# row 1, with garbage rewards and values there that must be skipped.
#   row 0: mask [1, 0, 1], r = [0, 5, 1], V = [0.5, 100, 0.2]
#     t=2: delta = 1 + 0.9 * 0 - 0.2 = 0.8; A2 = 0.8                 (nothing follows the last token)
#     t=1: padding: nextvalue stays V2 = 0.2 and the running A stays 0.8, so A1 = 0.8 (carried)
#     t=0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32                       (bootstraps from V2, not V1 = 100)
#          A0 = -0.32 + 0.72 * 0.8 = -0.32 + 0.576 = 0.256
#     returns = A + V = [0.256 + 0.5, 0.8 + 100, 0.8 + 0.2] = [0.756, 100.8, 1.0]
#   row 1: mask [1, 1, 0], r = [0, 2, 3], V = [1.0, 0.5, 7]
#     t=2: padding: nextvalue stays 0, running A stays 0, A2 = 0
#     t=1: delta = 2 + 0.9 * 0 - 0.5 = 1.5; A1 = 1.5 + 0.72 * 0 = 1.5   (not 2 + 0.9 * 7 - 0.5 = 7.8)
#     t=0: delta = 0 + 0.9 * 0.5 - 1.0 = -0.55; A0 = -0.55 + 0.72 * 1.5 = -0.55 + 1.08 = 0.53
#     returns = [0.53 + 1.0, 1.5 + 0.5, 0 + 7] = [1.53, 2.0, 7.0]
# Whitening the 4 real advantages 0.256, 0.8, 0.53, 1.5:
#   mean = 3.086 / 4 = 0.7715; deviations -0.5155, 0.0285, -0.2415, 0.7285
#   squares 0.26574025 + 0.00081225 + 0.05832225 + 0.53071225 = 0.855587
#   unbiased var = 0.855587 / 3 = 0.28519567; 1 / sqrt(0.28519567) = 1.8725289
#   -> -0.9652887, 0.0533671, -0.4522157, 1.3641373; padding -> 0
GAE_REWARDS = [[0.0, 5.0, 1.0], [0.0, 2.0, 3.0]]
GAE_VALUES = [[0.5, 100.0, 0.2], [1.0, 0.5, 7.0]]
GAE_MASK = [[1, 0, 1], [1, 1, 0]]
GAE_RETURNS = [[0.756, 100.8, 1.0], [1.53, 2.0, 7.0]]
GAE_ADVANTAGES = [[-0.9652887, 0.0, 0.0533671], [-0.4522157, 1.3641373, 0.0]]


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool, torch.float32])
def test_gae_padding_carries_next_value_and_advantage_through(mask_dtype):
    rewards = torch.tensor(GAE_REWARDS, dtype=torch.float64)
    values = torch.tensor(GAE_VALUES, dtype=torch.float64)
    mask = torch.tensor(GAE_MASK).to(mask_dtype)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor(GAE_RETURNS, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(adv, torch.tensor(GAE_ADVANTAGES, dtype=torch.float64), atol=1e-6, rtol=0)


def test_gae_nan_in_padding_does_not_reach_real_tokens():
    # Same batch with NaN / inf in the padded slots: the real tokens' returns and all advantages
    # are unchanged. Returns at padding are A + V there, so they are garbage too (never used).
    rewards = torch.tensor([[0.0, NAN, 1.0], [0.0, 2.0, INF]], dtype=torch.float64)
    values = torch.tensor([[0.5, NAN, 0.2], [1.0, 0.5, NAN]], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, torch.tensor(GAE_MASK), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor(GAE_ADVANTAGES, dtype=torch.float64), atol=1e-6, rtol=0)
    real = torch.tensor(GAE_MASK).bool()
    torch.testing.assert_close(ret[real], torch.tensor([0.756, 1.0, 1.53, 2.0], dtype=torch.float64))


def test_gae_lam_zero_is_one_step_td_error():
    # lam = 0: A_t = delta_t only. Row [r = 0, 1], V = [0.5, 0.25], gamma = 0.9:
    #   t=1: delta = 1 - 0.25 = 0.75;  t=0: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275
    #   returns = [-0.275 + 0.5, 0.75 + 0.25] = [0.225, 1.0]
    #   whitened: mean 0.2375, deviations -/+0.5125, unbiased var = 2 * 0.2626563 / 1 = 0.5253125,
    #   std 0.7247845 -> -/+0.7071068 (two values always whiten to -/+ 1/sqrt(2))
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 1.0]], dtype=torch.float64),
        torch.tensor([[0.5, 0.25]], dtype=torch.float64),
        torch.ones(1, 2),
        gamma=0.9,
        lam=0.0,
    )
    torch.testing.assert_close(ret, torch.tensor([[0.225, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[-0.7071068, 0.7071068]], dtype=torch.float64), atol=1e-6, rtol=0)


def test_gae_float32_and_no_gradient():
    rewards = torch.tensor(GAE_REWARDS)
    values = torch.tensor(GAE_VALUES, requires_grad=True)
    adv, ret = gae_advantages(rewards, values, torch.tensor(GAE_MASK), gamma=0.9, lam=0.8)
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    torch.testing.assert_close(adv, torch.tensor(GAE_ADVANTAGES), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, bad", [("gamma", 1.5), ("gamma", -0.1), ("lam", 2.0), ("lam", math.nan)])
def test_gae_rejects_gamma_lam_outside_unit_interval(name, bad):
    kwargs = {"gamma": 1.0, "lam": 1.0, name: bad}
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, 1\] .*got {bad}; pass a value such as 1.0"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), **kwargs)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match=r"token_rewards, values and mask must share one 2-D.*outcome_token_rewards"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"token_rewards, values and mask must share one 2-D"):
        gae_advantages(torch.zeros(6), torch.zeros(6), torch.ones(6), gamma=1.0, lam=1.0)


def test_gae_needs_two_real_tokens_to_whiten():
    with pytest.raises(ValueError, match=r"at least 2 masked positions, got a mask sum of 1"):
        gae_advantages(torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([[1, 0], [0, 0]]), gamma=1.0, lam=1.0)


# ----------------------------------------------------------------------------------------------
# value_loss
# ----------------------------------------------------------------------------------------------


def _value_batch():
    """Two rows, clip_value = 0.2, mask [[1, 1, 1], [1, 1, 0]] (float64; values chosen exact in binary).

    Per token: V_clipped = V_old + clamp(V - V_old, -0.2, 0.2); l1 = (V - R)^2, l2 = (V_clipped - R)^2
      a: V_old 0, V 0.5,   R 1: V_clipped 0.2;   l1 = 0.25,     l2 = 0.64     -> 0.64 (clipped)
      b: V_old 0, V 0.125, R 1: V_clipped 0.125; l1 = l2 = 0.875^2 = 0.765625 -> 0.765625 (inside)
      c: V_old 0, V 0.5,   R 0: V_clipped 0.2;   l1 = 0.25,     l2 = 0.04     -> 0.25 (moved away
         from R: not clipped)
      d: V_old 1, V 0.5,   R 0: V_clipped 0.8;   l1 = 0.25,     l2 = 0.64     -> 0.64 (clipped)
      e: V_old 1, V 1.125, R 2: V_clipped 1.125; l1 = l2 = 0.765625          -> 0.765625 (inside)
      padding: V 5, V_old 0, R NaN (GAE's returns at padding are garbage)
    Row sums: 0.64 + 0.765625 + 0.25 = 1.655625 and 0.64 + 0.765625 = 1.405625; total 3.06125.
    """
    values_pred = torch.tensor([[0.5, 0.125, 0.5], [0.5, 1.125, 5.0]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, NAN]], dtype=torch.float64)
    old_values = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return values_pred, returns, old_values, mask


# token-mean:          0.5 * 3.06125 / 5 = 0.5 * 0.61225 = 0.306125
# seq-mean-token-mean: 0.5 * (1.655625 / 3 + 1.405625 / 2) / 2 = 0.5 * (0.551875 + 0.7028125) / 2
#                      = 0.5 * 0.62734375 = 0.313671875
# seq-mean-token-sum:  0.5 * (1.655625 + 1.405625) / 2 = 0.5 * 1.530625 = 0.7653125
VALUE_EXPECTED = {"token-mean": 0.306125, "seq-mean-token-mean": 0.313671875, "seq-mean-token-sum": 0.7653125}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_hand_computed(agg):
    values_pred, returns, old_values, mask = _value_batch()
    loss, metrics = value_loss(values_pred, returns, old_values, mask, clip_value=0.2, agg=agg)
    assert loss.item() == pytest.approx(VALUE_EXPECTED[agg], abs=1e-7)
    assert set(metrics) == {"vf_clipfrac", "vpred_mean"}
    assert all(type(v) is float for v in metrics.values())
    # l2 > l1 strictly at a and d: 2 of 5 real tokens (b and e tie, c has l2 < l1).
    assert metrics["vf_clipfrac"] == pytest.approx(0.4, abs=1e-7)
    # (0.5 + 0.125 + 0.5 + 0.5 + 1.125) / 5 = 2.75 / 5 = 0.55 (the padded 5.0 never counts)
    assert metrics["vpred_mean"] == pytest.approx(0.55, abs=1e-7)


def test_value_loss_gradient_flows_to_values_pred():
    # token-mean: d loss / d V = 0.5 * (1/5) * d(per_token)/dV = 0.1 * 2 (V - R) where the unclipped
    # error is used, 0 where the clipped (constant in V) one wins:
    #   a: clipped -> 0;  b: 0.1 * 2 * (0.125 - 1) = -0.175;  c: 0.1 * 2 * (0.5 - 0) = 0.1
    #   d: clipped -> 0;  e: 0.1 * 2 * (1.125 - 2) = -0.175;  padding (R = NaN) -> exactly 0
    values_pred, returns, old_values, mask = _value_batch()
    loss, _ = value_loss(values_pred, returns, old_values, mask, clip_value=0.2)
    loss.backward()
    expected = torch.tensor([[0.0, -0.175, 0.1], [0.0, -0.175, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(values_pred.grad, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_gradients_are_finite(agg):
    values_pred, returns, old_values, mask = _value_batch()
    loss, _ = value_loss(values_pred, returns, old_values, mask, clip_value=0.2, agg=agg)
    loss.backward()
    assert torch.isfinite(values_pred.grad).all()
    assert values_pred.grad[1, 2].item() == 0.0
    assert values_pred.grad.abs().sum().item() > 0


def test_value_loss_unclipped_is_half_mse():
    # All predictions within 0.2 of old_values: V = [0.1, -0.15], V_old = 0, R = [1, 0.5]
    #   errors 0.9 and -0.65 -> 0.81 and 0.4225; 0.5 * (0.81 + 0.4225) / 2 = 0.5 * 0.61625 = 0.308125
    #   nothing clipped; vpred_mean = (0.1 - 0.15) / 2 = -0.025
    loss, m = value_loss(
        torch.tensor([[0.1, -0.15]], dtype=torch.float64),
        torch.tensor([[1.0, 0.5]], dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
        clip_value=0.2,
    )
    assert loss.item() == pytest.approx(0.308125, abs=1e-7)
    assert m == {"vf_clipfrac": 0.0, "vpred_mean": pytest.approx(-0.025, abs=1e-9)}


def test_value_loss_wider_clip_releases_the_clipped_tokens():
    # clip_value = 1: a (V - V_old = 0.5) and d (-0.5) are inside the region now, so l1 is used:
    # a 0.25, b 0.765625, c 0.25 | d 0.25, e 0.765625 -> token-mean 0.5 * 2.28125 / 5 = 0.228125
    values_pred, returns, old_values, mask = _value_batch()
    loss, m = value_loss(values_pred, returns, old_values, mask, clip_value=1.0)
    assert loss.item() == pytest.approx(0.228125, abs=1e-7)
    assert m["vf_clipfrac"] == 0.0


def test_value_loss_all_zero_mask_no_nan():
    values_pred, returns, old_values, _ = _value_batch()
    loss, m = value_loss(values_pred, returns, old_values, torch.zeros(2, 3), clip_value=0.2)
    assert loss.item() == 0.0
    assert m == {"vf_clipfrac": 0.0, "vpred_mean": 0.0}
    loss.backward()
    assert torch.equal(values_pred.grad, torch.zeros(2, 3, dtype=torch.float64))


def test_value_loss_errors():
    values_pred, returns, old_values, mask = _value_batch()
    with pytest.raises(ValueError, match=r"clip_value .* must be >= 0, got -0.2; pass e.g. 0.5"):
        value_loss(values_pred, returns, old_values, mask, clip_value=-0.2)
    with pytest.raises(ValueError, match=r"clip_value .* got nan"):
        value_loss(values_pred, returns, old_values, mask, clip_value=math.nan)
    with pytest.raises(ValueError, match=r"'token_mean'.*seq-mean-token-sum"):
        value_loss(values_pred, returns, old_values, mask, clip_value=0.2, agg="token_mean")
    with pytest.raises(ValueError, match=r"values_pred, returns, old_values and mask must share one"):
        value_loss(values_pred, returns[:, :2], old_values, mask, clip_value=0.2)
