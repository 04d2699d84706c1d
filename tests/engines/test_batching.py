"""Padding layout shared by rollout and training, hand-checked."""
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
