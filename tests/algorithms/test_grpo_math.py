"""GRPO advantages, loss aggregation and the clipped policy loss against hand-computed numbers.

Every expected value below is written out literally, with the arithmetic in a comment; none is
produced by re-running the formula under test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mindspeed_rl.algorithms import (
    AGG_MODES,
    agg_loss,
    broadcast_to_tokens,
    grpo_advantages,
    policy_loss,
)

# ----------------------------------------------------------------------------------------------
# grpo_advantages
# ----------------------------------------------------------------------------------------------

# Three groups, interleaved on purpose (rows of a group need not be adjacent):
#   group "a": rows 0, 2, 5 with rewards 1.0, 0.0, 0.5
#       mean = 1.5 / 3 = 0.5; deviations 0.5, -0.5, 0.0; sum of squares = 0.5
#       unbiased var = 0.5 / (3 - 1) = 0.25 -> std = 0.5
#       (the biased/population std would be sqrt(0.5 / 3) = 0.408, giving 1.2247 instead)
#       adv = dev / (0.5 + 1e-6): 0.5 / 0.500001 = 0.999998, -0.999998, 0.0
#   group "b": rows 1, 4 with rewards 2.0, 0.0
#       mean = 1.0; deviations 1, -1; unbiased var = 2 / 1 = 2 -> std = sqrt(2) = 1.41421356
#       adv = 1 / 1.41421456 = 0.70710628, and -0.70710628
#   group "c": row 3 alone, reward 0.3: verl uses mean 0, std 1 -> 0.3 / 1.000001 = 0.2999997
REWARDS = [1.0, 2.0, 0.0, 0.3, 0.0, 0.5]
GROUPS = ["a", "b", "a", "c", "b", "a"]
EXPECTED_NORM = [0.999998, 0.7071063, -0.999998, 0.2999997, -0.7071063, 0.0]
# norm_by_std=False (Dr. GRPO): only the mean is subtracted; the singleton keeps r - 0 = 0.3.
EXPECTED_NO_STD = [0.5, 1.0, -0.5, 0.3, -1.0, 0.0]


def test_grpo_advantages_hand_computed():
    adv = grpo_advantages(torch.tensor(REWARDS), GROUPS)
    torch.testing.assert_close(adv, torch.tensor(EXPECTED_NORM), atol=1e-6, rtol=0)


def test_grpo_advantages_without_std():
    adv = grpo_advantages(torch.tensor(REWARDS), GROUPS, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor(EXPECTED_NO_STD), atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    "index",
    [
        [7, 3, 7, 9, 3, 7],  # list of ints
        torch.tensor([7, 3, 7, 9, 3, 7]),  # tensor of ints
        np.array([7, 3, 7, 9, 3, 7]),  # numpy, as verl passes uid arrays
        np.array(["a", "b", "a", "c", "b", "a"], dtype=object),
    ],
)
def test_grpo_advantages_index_types(index):
    adv = grpo_advantages(torch.tensor(REWARDS), index)
    torch.testing.assert_close(adv, torch.tensor(EXPECTED_NORM), atol=1e-6, rtol=0)


def test_group_of_one_keeps_its_reward():
    # Single response in its group: mean 0, std 1 (verl), so adv = r / (1 + 1e-6), not 0.
    # 2.0 / 1.000001 = 1.999998; -1.0 / 1.000001 = -0.999999
    adv = grpo_advantages(torch.tensor([2.0, -1.0]), [0, 1])
    torch.testing.assert_close(adv, torch.tensor([1.999998, -0.999999]), atol=1e-6, rtol=0)


def test_all_equal_group_gives_zero_advantage():
    # std = 0 -> (r - mean) / (0 + eps) = 0 / 1e-6 = 0: no signal, and no NaN.
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), [0, 0, 1, 1])
    assert torch.equal(adv, torch.zeros(4))


def test_integer_rewards_become_float():
    # [1, 0] in one group: mean 0.5, unbiased std = sqrt(0.5) = 0.70710678
    # adv = +-0.5 / 0.70710778 = +-0.7071058
    adv = grpo_advantages(torch.tensor([1, 0]), [0, 0])
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.7071058, -0.7071058]), atol=1e-6, rtol=0)


def test_advantages_are_detached_constants():
    rewards = torch.tensor(REWARDS, requires_grad=True)
    adv = grpo_advantages(rewards, GROUPS)
    assert not adv.requires_grad
    assert rewards.grad is None


def test_grpo_advantages_errors():
    with pytest.raises(ValueError, match=r"1-D"):
        grpo_advantages(torch.zeros(2, 3), [0, 1])
    with pytest.raises(ValueError, match=r"3 entries but rewards has 2 rows"):
        grpo_advantages(torch.zeros(2), [0, 0, 1])


def test_broadcast_to_tokens():
    # [1.0, -0.5] onto masks [1,1,0] and [1,0,0]: scalar on real tokens, 0 on padding.
    out = broadcast_to_tokens(torch.tensor([1.0, -0.5]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 0.0], [-0.5, 0.0, 0.0]]))


def test_broadcast_to_tokens_errors():
    with pytest.raises(ValueError, match=r"equal batch"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"equal batch"):
        broadcast_to_tokens(torch.ones(2, 1), torch.ones(2, 4))


# ----------------------------------------------------------------------------------------------
# agg_loss
# ----------------------------------------------------------------------------------------------

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]
# token-mean:           (1 + 2 + 4) / 3 tokens = 7/3 = 2.3333333
# seq-mean-token-mean:  row means (1+2)/2 = 1.5 and 4/1 = 4 -> (1.5 + 4) / 2 = 2.75
# seq-mean-token-sum:   row sums 3 and 4 -> (3 + 4) / 2 = 3.5
AGG_EXPECTED = {"token-mean": 2.3333333, "seq-mean-token-mean": 2.75, "seq-mean-token-sum": 3.5}
# d loss / d loss_mat, i.e. the weight each mode gives each token:
#   token-mean: 1/3 per real token
#   seq-mean-token-mean: 1/(2 tokens * 2 rows) = 0.25 in row 0; 1/(1 token * 2 rows) = 0.5 in row 1
#   seq-mean-token-sum: 1/2 rows = 0.5 per real token
AGG_GRADS = {
    "token-mean": [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]],
    "seq-mean-token-mean": [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]],
    "seq-mean-token-sum": [[0.5, 0.5, 0.0], [0.5, 0.0, 0.0]],
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_modes(mode):
    loss_mat = torch.tensor(LOSS_MAT, requires_grad=True)
    loss = agg_loss(loss_mat, torch.tensor(MASK), mode)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(AGG_EXPECTED[mode], abs=1e-6)
    loss.backward()
    torch.testing.assert_close(loss_mat.grad, torch.tensor(AGG_GRADS[mode]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_padding_values_never_count(mode):
    # Garbage (NaN, inf, huge) in padded slots must not change anything.
    loss_mat = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), -1e30]])
    loss = agg_loss(loss_mat, torch.tensor(MASK), mode)
    assert loss.item() == pytest.approx(AGG_EXPECTED[mode], abs=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_fully_masked_row_is_left_out(mode):
    # A third row [7, 8, 9] with mask [0, 0, 0] (e.g. a response truncated to nothing):
    # token-mean: still 7/3. seq modes: the row is not counted among the sequences, so still
    # 2.75 and 3.5, not NaN (0/0 row mean) and not (3 + 4 + 0) / 3 = 2.3333.
    loss_mat = torch.tensor(LOSS_MAT + [[7.0, 8.0, 9.0]])
    mask = torch.tensor(MASK + [[0, 0, 0]])
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(AGG_EXPECTED[mode], abs=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_all_zero_mask_is_zero_not_nan(mode):
    loss_mat = torch.tensor(LOSS_MAT, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(loss_mat.grad, torch.zeros(2, 3))


def test_agg_loss_bool_mask_same_as_float():
    for mode in AGG_MODES:
        a = agg_loss(torch.tensor(LOSS_MAT), torch.tensor(MASK).bool(), mode)
        b = agg_loss(torch.tensor(LOSS_MAT), torch.tensor(MASK).float(), mode)
        assert a.item() == b.item()


def test_agg_loss_errors():
    with pytest.raises(ValueError, match=r"'seq-mean-token-sum-norm'.*token-mean.*seq-mean-token-mean"):
        agg_loss(torch.ones(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"\[batch, len\]"):
        agg_loss(torch.ones(2, 3), torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match=r"\[batch, len\]"):
        agg_loss(torch.ones(6), torch.ones(6), "token-mean")


# ----------------------------------------------------------------------------------------------
# policy_loss
# ----------------------------------------------------------------------------------------------


def _log_probs_for_ratios(ratios, old=-1.0):
    """old_log_prob = `old` everywhere; log_prob = old + ln(ratio), so exp(lp - old) = ratio."""
    old_lp = torch.full((len(ratios), len(ratios[0])), old, dtype=torch.float64)
    lp = old_lp + torch.log(torch.tensor(ratios, dtype=torch.float64))
    return lp, old_lp


def _batch():
    """Two rows, clip 0.2 / 0.2, clip_c 3.

    Row 0, A = +1, mask [1, 1, 1], ratios [1.5, 0.5, 1.1]:
        r=1.5: l1 = -1.5, l2 = -clamp(1.5, .8, 1.2) = -1.2, max = -1.2     (PPO clip, l2 > l1)
        r=0.5: l1 = -0.5, l2 = -0.8, max = -0.5                           (no clip for A > 0 at r < 1)
        r=1.1: l1 = l2 = -1.1                                             (inside the trust region)
    Row 1, A = -2, mask [1, 1, 0], ratios [4, 0.5, pad]:
        r=4:   l1 = 8, l2 = 2 * 1.2 = 2.4, max = 8; l3 = 2 * 3 = 6; min(6, 8) = 6   (dual clip)
        r=0.5: l1 = 1, l2 = 2 * 0.8 = 1.6, max = 1.6 (PPO clip, l2 > l1); min(6, 1.6) = 1.6
        pad:   log_prob = 50 (garbage), masked out
    Real tokens' losses: -1.2, -0.5, -1.1, 6, 1.6
    """
    lp, old_lp = _log_probs_for_ratios([[1.5, 0.5, 1.1], [4.0, 0.5, 1.0]])
    lp[1, 2] = 50.0
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return lp.requires_grad_(True), old_lp, adv, mask


# token-mean:          (-1.2 - 0.5 - 1.1 + 6 + 1.6) / 5 = 4.8 / 5 = 0.96
# seq-mean-token-mean: (-2.8 / 3 + 7.6 / 2) / 2 = (-0.9333333 + 3.8) / 2 = 1.4333333
# seq-mean-token-sum:  (-2.8 + 7.6) / 2 = 2.4
POLICY_EXPECTED = {"token-mean": 0.96, "seq-mean-token-mean": 1.4333333, "seq-mean-token-sum": 2.4}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_hand_computed(agg):
    lp, old_lp, adv, mask = _batch()
    loss, metrics = policy_loss(lp, old_lp, adv, mask, agg=agg)
    assert loss.item() == pytest.approx(POLICY_EXPECTED[agg], abs=1e-6)
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert all(type(v) is float for v in metrics.values())
    # PPO clip won (l2 > l1) at row 0 r=1.5 and row 1 r=0.5: 2 of 5 real tokens. The dual-clipped
    # token (row 1, r=4) has l2 = 2.4 < l1 = 8, so it does not count here.
    assert metrics["pg_clipfrac"] == pytest.approx(0.4, abs=1e-6)
    # Dual clip active (A < 0 and max(l1, l2) = 8 > l3 = 6) only at row 1, r=4: 1 of 5.
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2, abs=1e-6)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 4 + ln 0.5) / 5
    #        = -ln(1.5 * 0.5 * 1.1 * 4 * 0.5) / 5 = -ln(1.65) / 5 = -0.5007753 / 5 = -0.1001551
    # (the padded log-ratio, clamped to 20, would have pushed it to -4.1 were it counted)
    assert metrics["ppo_kl"] == pytest.approx(-0.1001551, abs=1e-6)


def test_policy_loss_gradient_token_mean():
    # d(-A r)/d log_prob = -A r where the unclipped term is used, 0 where a clip is active.
    # token-mean divides by 5 tokens:
    #   row 0: r=1.5 clipped -> 0; r=0.5 -> -1 * 0.5 / 5 = -0.1; r=1.1 -> -1.1 / 5 = -0.22
    #   row 1: r=4 dual-clipped (constant -A*c) -> 0; r=0.5 clipped -> 0; padding -> 0
    lp, old_lp, adv, mask = _batch()
    loss, _ = policy_loss(lp, old_lp, adv, mask)
    loss.backward()
    expected = torch.tensor([[0.0, -0.1, -0.22], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_gradients_are_finite(agg):
    lp, old_lp, adv, mask = _batch()
    loss, _ = policy_loss(lp, old_lp, adv, mask, agg=agg)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[1, 2].item() == 0.0  # padding
    assert lp.grad.abs().sum().item() > 0


def test_clip_for_positive_advantage_and_asymmetric_clip_high():
    # A = +1, r = 1.5: symmetric clip -> max(-1.5, -1.2) = -1.2; with clip_high = 0.28
    # (DAPO's clip-higher) -> max(-1.5, -1.28) = -1.28. Both clipped: pg_clipfrac = 1.
    lp, old_lp = _log_probs_for_ratios([[1.5]])
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    loss, m = policy_loss(lp, old_lp, adv, mask)
    assert loss.item() == pytest.approx(-1.2, abs=1e-7)
    assert m["pg_clipfrac"] == pytest.approx(1.0, abs=1e-6)
    loss, m = policy_loss(lp, old_lp, adv, mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28, abs=1e-7)


def test_clip_low_for_negative_advantage():
    # A = -1, r = 0.5: max(0.5, 1 * 0.8) = 0.8 (clip at 1 - 0.2); with clip_low = 0.6 the bound
    # is 0.4 < 0.5, so the plain term 0.5 is used and nothing is clipped.
    lp, old_lp = _log_probs_for_ratios([[0.5]])
    adv, mask = -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    loss, m = policy_loss(lp, old_lp, adv, mask)
    assert loss.item() == pytest.approx(0.8, abs=1e-7)
    assert m["pg_clipfrac"] == pytest.approx(1.0, abs=1e-6)
    loss, m = policy_loss(lp, old_lp, adv, mask, clip_low=0.6)
    assert loss.item() == pytest.approx(0.5, abs=1e-7)
    assert m["pg_clipfrac"] == 0.0


def test_dual_clip_caps_negative_advantage_with_large_ratio():
    # A = -1, ratios [e^2 = 7.389056, 2.5]:
    #   r = 7.389: l1 = 7.389, l2 = 1.2 -> max 7.389 > l3 = 1 * 3 -> capped at 3 (dual clip)
    #   r = 2.5:   l1 = 2.5,   l2 = 1.2 -> max 2.5 < 3 -> 2.5 (dual clip inactive)
    # token-mean = (3 + 2.5) / 2 = 2.75; pg_clipfrac_lower = 1/2
    # with clip_c = 5: (5 + 2.5) / 2 = 3.75
    lp, old_lp = _log_probs_for_ratios([[math.e**2, 2.5]])
    adv, mask = -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2)
    loss, m = policy_loss(lp, old_lp, adv, mask)
    assert loss.item() == pytest.approx(2.75, abs=1e-7)
    assert m["pg_clipfrac_lower"] == pytest.approx(0.5, abs=1e-6)
    assert m["pg_clipfrac"] == 0.0
    loss, _ = policy_loss(lp, old_lp, adv, mask, clip_c=5.0)
    assert loss.item() == pytest.approx(3.75, abs=1e-7)


def test_dual_clip_never_touches_positive_advantage():
    # A = +1, r = 7.389: max(-7.389, -1.2) = -1.2; the dual clip (-A * c = -3) is not applied.
    lp, old_lp = _log_probs_for_ratios([[math.e**2]])
    loss, m = policy_loss(lp, old_lp, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2, abs=1e-7)
    assert m["pg_clipfrac_lower"] == 0.0


def test_log_ratio_clamped_at_20():
    # log_prob - old = 30 and 25 are clamped to 20: ppo_kl = -(20 + 20) / 2 = -20 (not -27.5).
    # A = +1, ratio e^20: loss = max(-e^20, -1.2) = -1.2 per token.
    lp = torch.tensor([[30.0, 25.0]], dtype=torch.float64)
    old_lp = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = policy_loss(lp, old_lp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.2, abs=1e-7)
    assert m["ppo_kl"] == pytest.approx(-20.0, abs=1e-7)
    # Same at the other end: -30 -> -20, ppo_kl = +20.
    _, m = policy_loss(-lp, old_lp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2))
    assert m["ppo_kl"] == pytest.approx(20.0, abs=1e-7)


def test_log_ratio_clamp_prevents_nan_for_zero_advantage():
    # Unclamped, exp(1000) = inf and -0 * inf = NaN. Clamped, ratio = e^20 and the loss is 0.
    lp = torch.tensor([[1000.0, 0.0]], requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in m.values())


def test_policy_loss_all_zero_mask_no_nan():
    lp, old_lp, adv, _ = _batch()
    loss, m = policy_loss(lp, old_lp, adv, torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert m == {"pg_clipfrac": 0.0, "ppo_kl": 0.0, "pg_clipfrac_lower": 0.0}
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3, dtype=torch.float64))


def test_policy_loss_bool_mask_same_as_float():
    lp, old_lp, adv, mask = _batch()
    a, ma = policy_loss(lp, old_lp, adv, mask)
    b, mb = policy_loss(lp, old_lp, adv, mask.bool())
    assert a.item() == b.item()
    assert ma == mb


def test_policy_loss_float32():
    lp, old_lp, adv, mask = (t.detach().float() for t in _batch())
    loss, _ = policy_loss(lp, old_lp, adv, mask)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.96, abs=1e-5)


@pytest.mark.parametrize("clip_c", [1.0, 0.5, -3.0])
def test_policy_loss_rejects_clip_c_not_above_one(clip_c):
    lp, old_lp, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"clip_c .* must be > 1.0, got"):
        policy_loss(lp, old_lp, adv, mask, clip_c=clip_c)


def test_policy_loss_other_errors():
    lp, old_lp, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"'token_mean'.*seq-mean-token-sum"):
        policy_loss(lp, old_lp, adv, mask, agg="token_mean")
    with pytest.raises(ValueError, match=r"share one \[batch, len\] shape"):
        policy_loss(lp, old_lp, adv[:, :2], mask)
