"""DAPO's overlong penalty, the dynamic-sampling group filter and truncation, against hand-computed numbers."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.algorithms import constant_groups, overlong_penalty, truncated


def test_overlong_penalty_hand_computed():
    # max_len 10, buffer 4, factor 1: free up to 10 - 4 = 6 tokens, then -(L - 6) / 4, -1 from 10 on
    #   L = 0, 5, 6 -> 0;  L = 7 -> -1/4;  L = 8 -> -2/4;  L = 9 -> -3/4;  L = 10 -> -4/4 = -1;  L = 12 -> -1
    got = overlong_penalty([0, 5, 6, 7, 8, 9, 10, 12], max_len=10, buffer_len=4)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    # factor 0.5 halves it: L = 8 -> -2/4 * 0.5 = -0.25; L = 10 -> -0.5
    assert overlong_penalty(torch.tensor([8, 10]), 10, 4, 0.5).tolist() == [-0.25, -0.5]
    # buffer = max_len: the penalty grows from the first token: L = 3 of 4 -> -3/4
    assert overlong_penalty([3], 4, 4).tolist() == [-0.75]
    assert overlong_penalty([3, 9], 10, 0).tolist() == [0.0, 0.0], "buffer 0: off"
    assert overlong_penalty([], 10, 4).shape == (0,)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_len=0, buffer_len=0), "max_len=0"),
    (dict(max_len=10, buffer_len=11), "buffer_len=11"),
    (dict(max_len=10, buffer_len=-1), "buffer_len=-1"),
    (dict(max_len=10, buffer_len=2, penalty_factor=-1.0), "penalty_factor=-1.0"),
])
def test_overlong_penalty_refuses_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        overlong_penalty([1], **kwargs)


def test_constant_groups_hand_computed():
    # group 0: 1, 1, 1 -> constant; group 1: 0, 1 -> varies; group 2: 0.5 alone -> constant (no sibling);
    # group 3: 0.25, 0.25 -> constant; rows interleaved on purpose
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.25, 1.0, 0.25])
    groups = [0, 1, 0, 2, 0, 3, 1, 3]
    assert constant_groups(rewards, groups) == [0, 2, 3]
    # atol: 0.3 and 0.25 differ by 0.05
    near = torch.tensor([0.3, 0.25, 0.0, 1.0])
    assert constant_groups(near, ["a", "a", "b", "b"]) == []
    assert constant_groups(near, ["a", "a", "b", "b"], atol=0.1) == ["a"]


def test_constant_groups_refuses_bad_shapes():
    with pytest.raises(ValueError, match="1-D"):
        constant_groups(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="3 entries but rewards has 2"):
        constant_groups(torch.zeros(2), [0, 0, 1])
    with pytest.raises(ValueError, match="atol"):
        constant_groups(torch.zeros(2), [0, 0], atol=-1)


def test_truncated_hand_computed():
    stop = [2]  # <eos>
    rows = [torch.tensor([5, 6, 2]),      # 3 tokens, ends with the stop: finished at the limit
            torch.tensor([5, 6, 7]),      # 3 tokens, no stop: cut
            torch.tensor([5, 2]),         # finished early
            torch.tensor([5, 6]),         # 2 tokens without a stop: an engine that stopped on something else
            torch.tensor([], dtype=torch.long)]
    assert truncated(rows, 3, stop).tolist() == [False, True, False, False, False]
    assert truncated(rows, 2, stop).tolist() == [False, True, False, True, False], "a stop token ends it, past the limit too"
