"""masked_sum / masked_mean, entropy_from_logits and log_probs_from_logits against hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import entropy_from_logits, log_probs_from_logits, masked_mean, masked_sum

LN3 = math.log(3.0)


def test_masked_mean_and_sum():
    values = torch.tensor([[1.0, 2.0, 100.0], [4.0, 6.0, 8.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # all: (1 + 2 + 4 + 6 + 8) / 5 = 21 / 5 = 4.2; per row: 3/2 = 1.5 and 18/3 = 6
    assert masked_sum(values, mask).item() == 21.0
    assert masked_mean(values, mask).item() == pytest.approx(4.2, abs=1e-6)
    torch.testing.assert_close(masked_sum(values, mask, dim=-1), torch.tensor([3.0, 18.0]))
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 6.0]))


def test_masked_mean_all_zero_mask_is_zero():
    # 0 / (0 + 1e-8) = 0, not 0/0 = NaN (verl's convention).
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0
    torch.testing.assert_close(masked_mean(values, torch.tensor([[0, 0], [1, 1]]), dim=-1), torch.tensor([0.0, 3.5]))


def test_masked_reductions_ignore_nan_and_inf_in_padding():
    values = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0]])
    assert masked_sum(values, mask).item() == 1.0
    out = masked_mean(values, mask)
    assert out.item() == pytest.approx(1.0, abs=1e-6)
    out.backward()
    # Gradient 1/(1 + 1e-8) on the real token, exactly 0 (not NaN) on padding.
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_entropy_from_logits_hand_computed():
    # [0, ln 3] -> p = [1/4, 3/4]; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3
    #            = 1.3862944 - 0.8239592 = 0.5623352
    # uniform over 4 -> ln 4 = 1.3862944
    uniform = entropy_from_logits(torch.zeros(1, 4))
    torch.testing.assert_close(uniform, torch.tensor([1.3862944]))
    two_way = entropy_from_logits(torch.tensor([[0.0, LN3], [5.0, 5.0 + LN3]]))
    # shifting all logits by 5 changes nothing
    torch.testing.assert_close(two_way, torch.tensor([0.5623352, 0.5623352]))


def test_entropy_from_logits_shape():
    assert entropy_from_logits(torch.zeros(2, 3, 7)).shape == (2, 3)


def test_entropy_from_logits_is_stable_for_large_logits():
    # [1000, 1000] -> ln 2 = 0.6931472 (naive exp would overflow).
    # [1000, 0]    -> p = [1, e^-1000 = 0]: H = 0. Naive -sum p log p hits 0 * log(0) = NaN;
    #                 logsumexp - sum p*z = 1000 - (1 * 1000 + 0 * 0) = 0.
    # float64: the formula subtracts two ~1000-sized terms, so in float32 the result is only good
    # to ~1000 * 6e-8 = 6e-5 (documented; real LM logits are far smaller).
    out = entropy_from_logits(torch.tensor([[1000.0, 1000.0], [1000.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([0.6931472, 0.0], dtype=torch.float64), atol=1e-7, rtol=0)
    out32 = entropy_from_logits(torch.tensor([[1000.0, 1000.0], [1000.0, 0.0]]))
    assert torch.isfinite(out32).all()
    torch.testing.assert_close(out32, torch.tensor([0.6931472, 0.0]), atol=1e-4, rtol=0)


def test_entropy_gradient_is_finite():
    logits = torch.tensor([[1000.0, 0.0], [0.0, LN3]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_log_probs_from_logits_hand_computed():
    # logits [0, ln 3] at both positions -> p = [1/4, 3/4]
    # labels [1, 0]: [ln 0.75, ln 0.25] = [-0.2876821, -1.3862944]
    logits = torch.tensor([[[0.0, LN3], [0.0, LN3]]], requires_grad=True)
    out = log_probs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[-0.2876821, -1.3862944]]))
    # d log p_label / d logits = onehot(label) - p: [-0.25, 0.25] and [0.75, -0.75]
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25], [0.75, -0.75]]]))


def test_log_probs_from_logits_is_stable():
    # [1000, 0], label 1: log p = 0 - logsumexp(1000, 0) = -1000 (log(softmax) would give -inf).
    out = log_probs_from_logits(torch.tensor([[[1000.0, 0.0]]]), torch.tensor([[1]]))
    assert out.item() == pytest.approx(-1000.0, abs=1e-3)


def test_log_probs_from_logits_shape_error():
    with pytest.raises(ValueError, match=r"labels shape \(2, 3\) must equal .* \(2, 4\)"):
        log_probs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
