"""pass@k against values computed by hand from 1 - C(n-c, k) / C(n, k)."""
import math

import pytest

from mindspeed_rl.algorithms.pass_at_k import PASS_THRESHOLD, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0),
    (4, 1, 1, 0.25),                  # pass@1 = c / n
    (4, 3, 1, 0.75),
    (4, 1, 2, 1 - 3 / 6),             # C(3,2)=3, C(4,2)=6
    (4, 2, 2, 1 - 1 / 6),             # C(2,2)=1
    (4, 3, 2, 1.0),                   # n - c = 1 < k: every pair holds a pass
    (4, 1, 4, 1.0),                   # pass@n: any pass
    (4, 0, 4, 0.0),
    (5, 2, 3, 1 - 1 / 10),            # C(3,3)=1, C(5,3)=10
    (10, 3, 5, 1 - 21 / 252),         # C(7,5)=21, C(10,5)=252
])
def test_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_equals_the_binomial_formula_and_stays_finite_for_large_n():
    for n, c, k in [(20, 7, 3), (50, 1, 10), (16, 15, 16)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    value = pass_at_k(2000, 3, 100)   # C(2000, 100) overflows a float; the product form does not
    assert 0.0 < value < 1.0 and math.isfinite(value)


def test_mean_over_prompts_with_the_threshold():
    scores = [[1.0, 0.0, 2 / 3, 1.0],      # c = 2 (2/3 is partial credit: no pass)
              [0.0, 0.0, 0.0, 0.0],        # c = 0
              [1.0, 1.0, 1.0, 1.0]]        # c = 4
    assert PASS_THRESHOLD == 1.0
    assert mean_pass_at_k(scores, 1) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k(scores, 4) == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert mean_pass_at_k(scores, 2) == pytest.approx(((1 - 1 / 6) + 0.0 + 1.0) / 3)
    assert mean_pass_at_k(scores, 1, threshold=0.5) == pytest.approx((0.75 + 0.0 + 1.0) / 3)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="no prompts"):
        mean_pass_at_k([], 1)
