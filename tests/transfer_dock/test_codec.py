"""`codec.pack` / `codec.unpack`: a column's rows as one flat buffer plus offsets, and back."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mindspeed_rl.transfer_dock.codec import ColumnBlock, pack, unpack

TORCH_DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.bool]
NUMPY_DTYPES = [np.int64, np.int32, np.float32, np.float64, np.bool_]
# Variable lengths, with empty rows first, in the middle and last.
LENGTHS = [0, 3, 1, 0, 7, 2, 0]


def torch_rows(dtype, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        if dtype == torch.bool:
            rows.append(torch.randint(0, 2, (n,), generator=g).bool())
        elif dtype.is_floating_point:
            rows.append((torch.randn(n, generator=g) * 100 + i).to(dtype))
        else:
            rows.append(torch.randint(-(2**40), 2**40, (n,), generator=g).to(dtype))
    return rows


def numpy_rows(dtype, lengths, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return [rng.integers(0, 2, n).astype(np.bool_) for n in lengths]
    return [(rng.standard_normal(n) * 1000).astype(dtype) for n in lengths]


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def assert_rows_equal(got, expected):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert type(g) is type(e), f"row {i}: {type(g).__name__} instead of {type(e).__name__}"
        assert g.dtype == e.dtype, f"row {i}: dtype {g.dtype} instead of {e.dtype}"
        assert tuple(g.shape) == tuple(e.shape), f"row {i}: shape {tuple(g.shape)} instead of {tuple(e.shape)}"
        if isinstance(e, torch.Tensor):  # bit-exact, NaNs included: compare the bit patterns
            bits = _BITS.get(e.dtype, e.dtype)
            assert torch.equal(g.view(bits), e.view(bits)), f"row {i}: {g} instead of {e}"
        else:
            assert g.tobytes() == e.tobytes(), f"row {i}"


def readonly(block: ColumnBlock) -> ColumnBlock:
    """The block as Ray hands it out: the flat buffer is a read-only view of the object store."""
    flat = block.flat.copy()
    flat.setflags(write=False)
    return ColumnBlock(flat, block.offsets.copy(), block.torch_dtype)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [LENGTHS, [5], [0], [0, 0, 0], [1] * 20], ids=["mixed", "one", "one-empty",
                                                                                 "all-empty", "many"])
def test_torch_rows_round_trip(dtype, lengths):
    rows = torch_rows(dtype, lengths)
    block = pack(rows)
    assert len(block) == len(rows)
    assert [block.row_numel(i) for i in range(len(rows))] == lengths
    assert block.nbytes == sum(lengths) * rows[0].element_size()
    assert isinstance(block.flat, np.ndarray)  # what travels through Ray's object store zero-copy
    assert_rows_equal(unpack(block), rows)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("lengths", [LENGTHS, [5], [0], [0, 0, 0]], ids=["mixed", "one", "one-empty", "all-empty"])
def test_numpy_rows_round_trip(dtype, lengths):
    rows = numpy_rows(dtype, lengths)
    block = pack(rows)
    assert block.torch_dtype is None
    assert [block.row_numel(i) for i in range(len(rows))] == lengths
    assert_rows_equal(unpack(block), rows)


def test_bfloat16_survives_pickling_bit_exact():
    rows = [torch.tensor([1.0, -0.0, float("inf"), float("nan"), 3.140625], dtype=torch.bfloat16),
            torch.tensor([], dtype=torch.bfloat16)]
    block = pickle.loads(pickle.dumps(pack(rows)))
    out = unpack(block)
    assert out[0].dtype == torch.bfloat16
    assert_rows_equal(out, rows)


def test_non_contiguous_and_grad_rows_round_trip():
    base = torch.arange(20, dtype=torch.float32)
    rows = [base[::2], base[1:4], torch.ones(3, requires_grad=True)]
    out = unpack(pack(rows))
    assert_rows_equal(out, [r.detach() for r in rows])
    assert not out[2].requires_grad


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12),
       dtype=st.sampled_from(TORCH_DTYPES + NUMPY_DTYPES), seed=st.integers(0, 1000))
def test_round_trip_property(lengths, dtype, seed):
    rows = torch_rows(dtype, lengths, seed) if isinstance(dtype, torch.dtype) else numpy_rows(dtype, lengths, seed)
    block = pack(rows)
    assert_rows_equal(unpack(block), rows)
    assert_rows_equal(unpack(readonly(block)), rows)
    assert_rows_equal(unpack(pickle.loads(pickle.dumps(block))), rows)


# ---------------------------------------------------------------------- take
@pytest.mark.parametrize("make", [lambda: torch_rows(torch.float32, LENGTHS), lambda: torch_rows(torch.bfloat16, LENGTHS),
                                  lambda: numpy_rows(np.int32, LENGTHS)], ids=["float32", "bfloat16", "numpy"])
@pytest.mark.parametrize("positions", [[4], [1, 4], [6, 0, 3], [4, 2, 1, 0], [3, 3], []],
                         ids=["one", "two", "reordered-empties", "reversed", "repeated", "none"])
def test_take_subset_keeps_the_rows_in_the_given_order(make, positions):
    rows = make()
    part = pack(rows).take(positions)
    assert len(part) == len(positions)
    assert part.torch_dtype == pack(rows).torch_dtype
    assert part.nbytes == sum(rows[p].numel() if isinstance(rows[p], torch.Tensor) else rows[p].size
                              for p in positions) * pack(rows).flat.itemsize
    assert_rows_equal(unpack(part), [rows[p] for p in positions])


@pytest.mark.parametrize("make", [lambda: torch_rows(torch.int64, LENGTHS), lambda: numpy_rows(np.float64, LENGTHS)],
                         ids=["torch", "numpy"])
def test_take_all_positions_returns_every_row(make):
    rows = make()
    block = pack(rows)
    everything = block.take(range(len(rows)))
    assert len(everything) == len(rows)
    assert_rows_equal(unpack(everything), rows)
    assert_rows_equal(unpack(readonly(block).take(list(range(len(rows))))), rows)


def test_take_of_readonly_block_gives_writable_private_rows():
    block = readonly(pack(torch_rows(torch.float32, LENGTHS)))
    part = block.take([1, 4])
    out = unpack(part)
    out[0][0] = 12345.0
    assert block.flat[0] != 12345.0
    assert out[0][0].item() == 12345.0


# ---------------------------------------------------------------------- zero-copy pack
def test_rows_of_a_2d_tensor_pack_without_copying():
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    block = pack(list(t))
    assert np.shares_memory(block.flat, t.numpy())
    assert_rows_equal(unpack(block), list(t))


def test_slices_of_one_tensor_back_to_back_pack_without_copying():
    x = torch.arange(10, dtype=torch.float32)
    rows = [x[0:3], x[3:5], x[5:10]]
    block = pack(rows)
    assert np.shares_memory(block.flat, x.numpy())
    assert_rows_equal(unpack(block), [r.clone() for r in rows])


@pytest.mark.parametrize("pick", [
    lambda t: list(t)[::-1],  # reversed rows: not back to back in order
    lambda t: [t[0], t[2]],  # a gap
    lambda t: [t[1], t[1], t[2]],  # the same row twice
    lambda t: list(t.T.contiguous().T),  # rows of a transposed (column-major) tensor
    lambda t: [t[0, :2], t[0, 2:], t[1]],  # back to back, then a jump
    lambda t: [t[0, 1:], t[1]],  # starts mid-row
], ids=["reversed", "gap", "repeated", "column-major", "split", "offset"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16], ids=str)
def test_rows_that_share_a_buffer_but_are_not_back_to_back_pack_correctly(pick, dtype):
    t = torch.arange(12).reshape(3, 4).to(dtype)
    rows = pick(t)
    assert_rows_equal(unpack(pack(rows)), [r.clone() for r in rows])


def test_rows_from_numpy_row_views_pack_correctly():
    """`torch.from_numpy` of each row of a 2-D array: adjacent in memory, but each row tensor's
    storage covers only its own row."""
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    rows = [torch.from_numpy(r) for r in a]
    assert_rows_equal(unpack(pack(rows)), [torch.tensor(r) for r in a])


def test_numpy_rows_are_copied_by_pack():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    block = pack(list(a))
    a[0, 0] = -1.0
    assert block.flat[0] == 0.0


# ---------------------------------------------------------------------- ownership on unpack
def test_default_unpack_copies():
    """Private rows by default: a consumer writing in place must not reach other consumers."""
    block = pack(torch_rows(torch.float32, LENGTHS))
    out = unpack(block)
    rows = [r for r in out if r.numel()]
    assert rows and not any(np.shares_memory(r.numpy(), block.flat) for r in rows)


def test_zero_copy_unpack_shares_the_buffer():
    block = pack(torch_rows(torch.float32, LENGTHS))
    out = unpack(block, copy=False)
    shared = [r for r in out if r.numel()]
    assert shared and all(np.shares_memory(r.numpy(), block.flat) for r in shared)


def test_zero_copy_unpack_of_a_readonly_numpy_block_gives_readonly_rows():
    block = readonly(pack(numpy_rows(np.float64, LENGTHS)))
    out = unpack(block, copy=False)
    with pytest.raises(ValueError, match="read-only"):
        out[1][0] = 1.0


@pytest.mark.parametrize("make", [lambda n: torch_rows(torch.float32, n), lambda n: torch_rows(torch.bfloat16, n),
                                  lambda n: torch_rows(torch.int64, n), lambda n: torch_rows(torch.bool, n),
                                  lambda n: numpy_rows(np.float32, n)],
                         ids=["float32", "bfloat16", "int64", "bool", "numpy"])
@pytest.mark.parametrize("lengths", [[3, 0, 2, 4], [4]], ids=["four-rows", "one-row"])
@pytest.mark.parametrize("make_readonly", [False, True], ids=["writable-block", "readonly-block"])
def test_unpack_copy_gives_private_writable_rows(make, lengths, make_readonly):
    rows = make(lengths)
    before = [r.clone() if isinstance(r, torch.Tensor) else r.copy() for r in rows]
    block = pack(rows)
    if make_readonly:
        block = readonly(block)
    flat_before = block.flat.copy()
    out = unpack(block, copy=True)
    for r in out:
        r[...] = 0  # writable: must not raise, and must reach neither the block nor the caller's rows
    assert not any(r.any() for r in out)
    assert np.array_equal(block.flat, flat_before), "unpack(copy=True) rows write into the block"
    assert_rows_equal(rows, before)
    assert_rows_equal(unpack(block, copy=True), before)


def test_unpack_copy_of_a_readonly_block_is_not_readonly():
    block = readonly(pack(torch_rows(torch.float16, LENGTHS)))
    out = unpack(block, copy=True)
    assert all(not np.shares_memory(r.numpy(), block.flat) for r in out if r.numel())
    np_out = unpack(readonly(pack(numpy_rows(np.int32, LENGTHS))), copy=True)
    assert all(r.flags.writeable for r in np_out)


def test_rows_of_one_unpack_do_not_alias_each_other():
    out = unpack(pack(torch_rows(torch.int64, [3, 3, 3])), copy=True)
    snapshot = [r.clone() for r in out]
    out[1].fill_(0)
    assert torch.equal(out[0], snapshot[0]) and torch.equal(out[2], snapshot[2])


def test_pack_rejects_no_rows():
    with pytest.raises(ValueError, match="no rows"):
        pack([])
