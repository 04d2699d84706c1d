"""Reward-model math against hand-computed numbers: the Bradley-Terry loss, accuracy, margin, the
score at the last real token (left, right and both paddings) and the weighted reward.

Every expected value is written out, with its arithmetic in a comment.
"""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import (REWARD_SOURCES, bradley_terry_loss, combine_rewards, last_token_scores,
                                     preference_accuracy, preference_margin)


def test_bradley_terry_loss_hand_computed():
    # differences c - r: 0, 2, -1
    # -log sigmoid(0) = log 2 = 0.693147
    # -log sigmoid(2) = log(1 + e^-2) = log(1.135335) = 0.126928
    # -log sigmoid(-1) = log(1 + e) = log(3.718282) = 1.313262
    # mean = (0.693147 + 0.126928 + 1.313262) / 3 = 0.711112
    chosen = torch.tensor([1.0, 3.0, 0.0])
    rejected = torch.tensor([1.0, 1.0, 1.0])
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(0.711112, abs=1e-6)


def test_bradley_terry_loss_gradient():
    # d/dc of -log sigmoid(c - r) = -(1 - sigmoid(c - r)) = -sigmoid(r - c); mean over 2 pairs halves it
    # pair 0: c - r = 0 -> -0.5 / 2 = -0.25; pair 1: c - r = 2 -> -sigmoid(-2) / 2 = -0.119203 / 2 = -0.059601
    chosen = torch.tensor([0.0, 2.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert chosen.grad.tolist() == pytest.approx([-0.25, -0.059601], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.25, 0.059601], abs=1e-6)


def test_bradley_terry_loss_stays_finite_far_apart():
    # c - r = -200: -log sigmoid(-200) = log(1 + e^200) = 200 (+ e^-200), no inf
    loss = bradley_terry_loss(torch.tensor([-100.0]), torch.tensor([100.0]))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(200.0)


def test_accuracy_and_margin_hand_computed():
    # pairs: (2 > 1) yes, (0 > 0) a tie: no, (-1 > 3) no, (5 > -5) yes -> 2 of 4 = 0.5
    # margin: (1 + 0 + -4 + 10) / 4 = 7 / 4 = 1.75
    chosen = torch.tensor([2.0, 0.0, -1.0, 5.0])
    rejected = torch.tensor([1.0, 0.0, 3.0, -5.0])
    assert preference_accuracy(chosen, rejected) == 0.5
    assert preference_margin(chosen, rejected) == 1.75


def test_pair_shapes_are_checked():
    with pytest.raises(ValueError, match="one shape"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="empty"):
        preference_accuracy(torch.zeros(0), torch.zeros(0))


def test_last_token_scores_right_left_and_both_paddings():
    # the same three rows of real scores [a, b, c] laid out three ways; the score is the last real one
    # row 0: real scores [0.1, 0.2, 0.3]     -> 0.3
    # row 1: real scores [0.4]               -> 0.4
    # row 2: real scores [0.5, 0.6]          -> 0.6
    right = torch.tensor([[0.1, 0.2, 0.3], [0.4, 9.0, 9.0], [0.5, 0.6, 9.0]])
    right_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    left = torch.tensor([[0.1, 0.2, 0.3], [9.0, 9.0, 0.4], [9.0, 0.5, 0.6]])
    left_mask = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]])
    # a left-padded prompt then a right-padded response: [pad, p, r, pad]
    both = torch.tensor([[9.0, 0.1, 0.2, 0.3], [9.0, 0.4, 9.0, 9.0], [0.5, 0.6, 9.0, 9.0]])
    both_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 0]])
    want = [0.3, 0.4, 0.6]
    for scores, mask in ((right, right_mask), (left, left_mask), (both, both_mask)):
        assert last_token_scores(scores, mask).tolist() == pytest.approx(want)
    for mask in (right_mask, left_mask):
        assert last_token_scores(torch.zeros(3, 3), mask.bool()).tolist() == [0.0, 0.0, 0.0]


def test_last_token_scores_refuses_an_empty_row():
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        last_token_scores(torch.zeros(2, 2), torch.tensor([[1, 0], [0, 0]]))


def test_combine_rewards_weighted_sum():
    # model 1.0 x [0.5, -1] + rule 0.5 x [1, 0] = [0.5 + 0.5, -1 + 0] = [1.0, -1.0]
    scores = {"model": torch.tensor([0.5, -1.0]), "rule": torch.tensor([1.0, 0.0])}
    assert combine_rewards(scores, {"model": 1.0, "rule": 0.5}).tolist() == [1.0, -1.0]
    # rule weight 0: the model's score alone, whatever the rule says
    assert combine_rewards(scores, {"model": 1.0, "rule": 0.0}).tolist() == [0.5, -1.0]
    # a weight-0 source needs no score
    assert combine_rewards({"model": torch.tensor([2.0])}, {"model": 0.5, "rule": 0.0}).tolist() == [1.0]
    assert set(REWARD_SOURCES) == {"model", "rule"}


def test_combine_rewards_errors():
    with pytest.raises(ValueError, match="no rule score"):
        combine_rewards({"model": torch.zeros(2)}, {"model": 1.0, "rule": 1.0})
    with pytest.raises(ValueError, match=r"\['critic'\]"):
        combine_rewards({"model": torch.zeros(2)}, {"critic": 1.0})
