"""Padding layout shared by rollout and training, hand-checked."""
import pytest
import torch

from mindspeed_rl.engines.batching import collate, left_pad, positions, right_pad, unpad_rows

T = torch.tensor


def test_left_pad():
    ids, mask = left_pad([T([5, 6, 7]), T([8]), T([], dtype=torch.long)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


def test_right_pad_keeps_one_column_for_all_empty_rows():
    ids, mask = right_pad([T([5, 6]), T([7])], pad_id=9)
    assert ids.tolist() == [[5, 6], [7, 9]]
    assert mask.tolist() == [[1.0, 1.0], [1.0, 0.0]] and mask.dtype == torch.float32
    ids, mask = right_pad([T([], dtype=torch.long)] * 2, pad_id=9)
    assert ids.tolist() == [[9], [9]] and mask.tolist() == [[0.0], [0.0]]


def test_positions_count_real_tokens_only():
    mask = T([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert positions(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def test_collate_aligns_every_response_at_the_same_column():
    b = collate([T([1, 4]), T([1, 5, 6])], [T([7, 8, 9]), T([10])], pad_id=0)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[0, 1, 4, 7, 8, 9], [1, 5, 6, 10, 0, 0]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3]]
    assert b.responses.tolist() == [[7, 8, 9], [10, 0, 0]]
    assert b.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.response_lengths == [3, 1]
    rows = unpad_rows(b.responses.float(), b.response_mask)
    assert [r.tolist() for r in rows] == [[7.0, 8.0, 9.0], [10.0]]


def test_token_budget_groups_take_every_row_once_within_the_budget():
    from mindspeed_rl.engines.batching import padded_tokens, token_budget_groups
    g = torch.Generator().manual_seed(0)
    p = torch.randint(1, 9, (23,), generator=g).tolist()
    r = torch.randint(1, 30, (23,), generator=g).tolist()
    for budget in (1, 40, 100, 10_000):
        groups = token_budget_groups(p, r, budget)
        assert sorted(i for grp in groups for i in grp) == list(range(23))
        for grp in groups:
            assert grp == sorted(grp)
            assert len(grp) == 1 or padded_tokens([p[i] for i in grp], [r[i] for i in grp]) <= budget
    assert len(token_budget_groups(p, r, 1)) == 23                       # each row alone
    assert token_budget_groups(p, r, 10_000) == [list(range(23))]        # all in one
    # the groups together compute fewer padded tokens than one forward over all rows
    budget = 120
    sorted_cost = sum(padded_tokens([p[i] for i in grp], [r[i] for i in grp])
                      for grp in token_budget_groups(p, r, budget))
    assert sorted_cost < padded_tokens(p, r)


def test_token_budget_groups_example_and_bad_budget():
    from mindspeed_rl.engines.batching import token_budget_groups
    assert token_budget_groups([2, 2, 2], [8, 1, 7], 20) == [[0, 2], [1]]
    with pytest.raises(ValueError):
        token_budget_groups([1], [1], 0)
