"""outcome_token_rewards and ReMax advantages/returns against hand-computed numbers.

Every expected value below is written out literally, with the arithmetic in a comment; none is
produced by re-running the formula under test.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.algorithms import outcome_token_rewards, remax_advantages

NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------------------------
# outcome_token_rewards
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool, torch.float32])
def test_outcome_token_rewards_on_last_real_token(mask_dtype):
    # Row 0: mask [1, 1, 0, 0] -> last real token at index 1.
    # Row 1: mask [1, 1, 1, 1] -> index 3.
    # Row 2: mask [1, 0, 1, 0] (a gap) -> the highest selected index, 2 (not sum - 1 = 1).
    # Row 3: mask all zero -> nothing anywhere.
    scores = torch.tensor([1.0, -0.5, 2.0, 7.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]).to(mask_dtype)
    expected = torch.tensor(
        [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, -0.5], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    )
    assert torch.equal(outcome_token_rewards(scores, mask), expected)


def test_outcome_token_rewards_dtypes():
    # Integer scores become float; float64 stays float64.
    out = outcome_token_rewards(torch.tensor([1, 0]), torch.tensor([[1, 1], [1, 0]]))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    out = outcome_token_rewards(torch.tensor([0.5], dtype=torch.float64), torch.ones(1, 2))
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([[0.0, 0.5]], dtype=torch.float64))


def test_outcome_token_rewards_errors():
    with pytest.raises(ValueError, match=r"scores \[batch\].*equal batch, got \(3,\) and \(2, 4\)"):
        outcome_token_rewards(torch.zeros(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"scores \[batch\]"):
        outcome_token_rewards(torch.zeros(2, 1), torch.ones(2, 4))


# ----------------------------------------------------------------------------------------------
# remax_advantages
# ----------------------------------------------------------------------------------------------


def test_remax_outcome_reward_gives_score_minus_baseline_on_every_token():
    # Scores [1, 0.5] on the last real token, greedy baselines [0.25, 1.0]:
    #   token rewards [[0, 0, 1], [0, 0.5, 0]]
    #   returns (reward-to-go) [[1, 1, 1], [0.5, 0.5, 0]]
    #   advantages = returns - b * mask: [[1 - 0.25] * 3 = 0.75 x3], [0.5 - 1, 0.5 - 1, 0 - 0] = [-0.5, -0.5, 0]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.5]), mask)
    adv, ret = remax_advantages(rewards, torch.tensor([0.25, 1.0]), mask)
    assert torch.equal(ret, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    assert torch.equal(adv, torch.tensor([[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]))


def test_remax_per_token_rewards_with_padding():
    # Row 0: mask [1, 1, 1], r = [0.25, -0.5, 1], b = 0.5
    #   returns: t2 = 1; t1 = -0.5 + 1 = 0.5; t0 = 0.25 + 0.5 = 0.75
    #   advantages: [0.75 - 0.5, 0.5 - 0.5, 1 - 0.5] = [0.25, 0, 0.5]
    # Row 1: mask [1, 1, 0], r = [0.25, 0.5, NaN (padding)], b = 0.25
    #   padding reward dropped: returns [0.75, 0.5, 0]; advantages [0.5, 0.25, 0] (no baseline on padding)
    # Row 2: mask [1, 0, 1] (a gap), r = [1, 7 (padding), 2], b = 1
    #   masked rewards [1, 0, 2] -> returns [3, 2, 2]
    #   advantages = returns - b * mask = [3 - 1, 2 - 0, 2 - 1] = [2, 2, 1] (verl: the gap keeps its
    #   reward-to-go and gets no baseline)
    rewards = torch.tensor([[0.25, -0.5, 1.0], [0.25, 0.5, NAN], [1.0, 7.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = remax_advantages(rewards, torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64), mask)
    expected_ret = torch.tensor([[0.75, 0.5, 1.0], [0.75, 0.5, 0.0], [3.0, 2.0, 2.0]], dtype=torch.float64)
    expected_adv = torch.tensor([[0.25, 0.0, 0.5], [0.5, 0.25, 0.0], [2.0, 2.0, 1.0]], dtype=torch.float64)
    assert torch.equal(ret, expected_ret)
    assert torch.equal(adv, expected_adv)


def test_remax_inf_in_padding_does_not_spread_and_bool_mask_agrees():
    # An inf reward after the last real token: the cumulative sum would carry it into every real
    # token; masked first, returns are [1, 1, 0] and advantages [1 - 0.5, 1 - 0.5, 0] = [0.5, 0.5, 0].
    rewards = torch.tensor([[0.0, 1.0, INF]])
    for mask in (torch.tensor([[1, 1, 0]]), torch.tensor([[True, True, False]]), torch.tensor([[1.0, 1.0, 0.0]])):
        adv, ret = remax_advantages(rewards, torch.tensor([0.5]), mask)
        assert torch.equal(ret, torch.tensor([[1.0, 1.0, 0.0]]))
        assert torch.equal(adv, torch.tensor([[0.5, 0.5, 0.0]]))


def test_remax_is_detached():
    rewards = torch.tensor([[0.0, 1.0]], requires_grad=True)
    baselines = torch.tensor([0.5], requires_grad=True)
    adv, ret = remax_advantages(rewards, baselines, torch.ones(1, 2))
    assert not adv.requires_grad and not ret.requires_grad


def test_remax_errors():
    with pytest.raises(ValueError, match=r"token_rewards and mask must share one 2-D.*outcome_token_rewards"):
        remax_advantages(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"token_rewards and mask must share one 2-D"):
        remax_advantages(torch.zeros(2), torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"baselines must be \[batch\] = \[2\].*got shape \(3,\)"):
        remax_advantages(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"baselines must be \[batch\]"):
        remax_advantages(torch.zeros(2, 3), torch.zeros(2, 1), torch.ones(2, 3))
