"""Contract tests for the plain (no Ray) `TransferDock`.

Each `test_cNN_*` checks one numbered point of the dock's contract; the tests after them cover
metrics, the event log, status reports, `GRPOTransferDock` and 2-D column values.
"""
from __future__ import annotations

import random
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindspeed_rl.transfer_dock import (GRPO_COLUMNS, GRPO_CONSUMERS, AnyReadySampler, DockError, DockIndexError,
                                        DockKeyError, DockTimeoutError, DockValueError, GRPOTransferDock,
                                        LengthBalancedSampler, MissingDataError, OrderedSampler, TransferDock)

# ---------------------------------------------------------------------------------------------- helpers


def val(row: int, col: str) -> np.ndarray:
    """A row's cell in `col`: variable length, and its content says which (row, column) it is."""
    code = sum(map(ord, col)) % 97
    return np.full(1 + (row * 7 + code) % 11, row * 1000 + code, dtype=np.int64)


def make_dock(columns=("a", "b"), consumers=("c1", "c2"), prompts_num=8, n=1, **kwargs) -> TransferDock:
    return TransferDock(list(columns), list(consumers), prompts_num, n, **kwargs)


def put_rows(dock: TransferDock, columns, rows, **kwargs) -> None:
    rows = list(rows)
    dock.put_experience({c: [val(r, c) for r in rows] for c in columns}, rows, **kwargs)


def assert_data_matches(data: dict, idx: list, columns) -> None:
    """The data handed out lines up with the row indexes handed out, column by column."""
    assert sorted(data) == sorted(set(columns))
    for c in columns:
        assert len(data[c]) == len(idx)
        for r, v in zip(idx, data[c]):
            assert np.array_equal(np.asarray(v), val(r, c)), (c, r)


def fingerprint(dock: TransferDock):
    """Everything observable about a dock's contents and progress, in comparable form."""
    sd = dock.state_dict()
    cells = {c: {r: np.asarray(v).tolist() for r, v in cs.items()} for c, cs in sd["cells"].items()}
    return {**sd, "cells": cells}, dock.get_column_status(), dock.get_consumer_status()


def drain(dock: TransferDock, consumer: str, columns, count: int, check=True, **kwargs) -> list[list[int]]:
    """Non-blocking gets until one comes back empty; returns the batches of row indexes.
    With `check`, the cells must be the `val()` cells `put_rows` writes."""
    batches = []
    while True:
        data, idx = dock.get_experience(consumer, columns, count, **kwargs)
        if not idx:
            assert data == {}
            return batches
        if check:
            assert_data_matches(data, idx, columns)
        batches.append(idx)


class Call(threading.Thread):
    """Runs one call in a thread and keeps its result or exception."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.result = self.error = None
        self.elapsed = None

    def run(self):
        t = time.monotonic()
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # re-raised in the test's thread by outcome()
            self.error = e
        self.elapsed = time.monotonic() - t

    def outcome(self, timeout: float = 10.0):
        self.join(timeout)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def start(fn, *args, **kwargs) -> Call:
    call = Call(fn, *args, **kwargs)
    call.start()
    return call


def still_blocked(call: Call, for_s: float = 0.2) -> bool:
    call.join(for_s)
    return call.is_alive()


# ---------------------------------------------------------------------------------------------- contract 1


def test_c01_rows_and_groups_layout():
    dock = make_dock(("tok", "arr"), ("c",), prompts_num=3, n=4)
    assert dock.capacity == 12
    tensors = [torch.arange(1 + r % 5, dtype=torch.int32) + 100 * r for r in range(12)]
    arrays = [np.linspace(0, 1, 2 + r).astype(np.float32) for r in range(12)]
    dock.put_experience({"tok": tensors, "arr": arrays}, list(range(12)))
    with pytest.raises(DockIndexError, match=r"0 \.\. 11"):
        dock.put_experience({"tok": [tensors[0]]}, [12])

    groups = []
    while True:
        data, idx = dock.get_experience("c", ["tok", "arr"], 4, get_n_samples=True)
        if not idx:
            break
        p = idx[0] // 4
        assert sorted(idx) == list(range(p * 4, p * 4 + 4)), "prompt p owns rows p*n .. p*n+n-1"
        for r, t, a in zip(idx, data["tok"], data["arr"]):
            assert isinstance(t, torch.Tensor) and t.ndim == 1 and torch.equal(t, tensors[r])
            assert isinstance(a, np.ndarray) and a.ndim == 1 and np.array_equal(a, arrays[r])
        groups.append(p)
    assert sorted(groups) == [0, 1, 2]
    assert dock.all_consumed("c")


def test_c01_capacity_is_prompts_times_samples():
    dock = make_dock(prompts_num=5, n=3)
    assert dock.capacity == 15
    assert dock.get_column_status()["a"] == {"written": 0, "total": 15}
    put_rows(dock, ["a"], [14])
    with pytest.raises(DockIndexError):
        put_rows(dock, ["a"], [15])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(DockValueError):
            make_dock(prompts_num=bad)
        with pytest.raises(DockValueError):
            make_dock(n=bad)


# ---------------------------------------------------------------------------------------------- contract 2


def test_c02_exact_count_when_ready_else_empty():
    dock = make_dock(prompts_num=10)
    put_rows(dock, ["a", "b"], range(5))
    data, idx = dock.get_experience("c1", ["a", "b"], 3)
    assert len(idx) == 3 and set(idx) <= set(range(5)) and len(set(idx)) == 3
    assert_data_matches(data, idx, ["a", "b"])
    # 2 ready, 7 untaken in the step: not the tail, so nothing rather than a short batch.
    assert dock.get_experience("c1", ["a", "b"], 3) == ({}, [])
    data, idx2 = dock.get_experience("c1", ["a", "b"], 2)
    assert sorted(idx + idx2) == [0, 1, 2, 3, 4]
    # c2 is independent of c1.
    _, idx3 = dock.get_experience("c2", ["a"], 5)
    assert sorted(idx3) == [0, 1, 2, 3, 4]


def test_c02_tail_returns_fewer_rows():
    dock = make_dock(prompts_num=7)
    put_rows(dock, ["a"], range(7))
    assert [len(b) for b in drain(dock, "c1", ["a"], 3)] == [3, 3, 1]
    assert dock.all_consumed("c1")
    assert dock.get_experience("c1", ["a"], 3, blocking=True, timeout=5) == ({}, [])


def test_c02_tail_waits_for_all_remaining_rows():
    dock = make_dock(prompts_num=7)
    put_rows(dock, ["a"], range(5))
    assert len(dock.get_experience("c1", ["a"], 4)[1]) == 4
    # 3 rows left in the step, only 1 of them written: the tail batch is the 3, not the 1.
    assert dock.get_experience("c1", ["a"], 4) == ({}, [])
    put_rows(dock, ["a"], [5, 6])
    data, idx = dock.get_experience("c1", ["a"], 4)
    assert len(idx) == 3
    assert_data_matches(data, idx, ["a"])


def test_c02_partly_written_rows_are_never_handed_out():
    dock = make_dock(prompts_num=6)
    put_rows(dock, ["a"], range(6))
    put_rows(dock, ["b"], [1, 4])
    data, idx = dock.get_experience("c1", ["a", "b"], 6, blocking=False)
    assert idx == []
    data, idx = dock.get_experience("c1", ["a", "b"], 2)
    assert sorted(idx) == [1, 4]
    assert_data_matches(data, idx, ["a", "b"])
    assert dock.get_experience("c1", ["a", "b"], 1) == ({}, [])
    # Rows 0,2,3,5 are ready for a consumer asking for "a" only.
    assert sorted(dock.get_experience("c2", ["a"], 6)[1]) == [0, 1, 2, 3, 4, 5]


def test_c02_blocking_get_waits_until_count_rows_are_ready():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a", "b"], [0, 1])
    call = start(dock.get_experience, "c1", ["a", "b"], 4, blocking=True, timeout=30)
    assert still_blocked(call)
    put_rows(dock, ["a"], [2, 3])
    assert still_blocked(call), "rows with only column 'a' written must not complete the batch"
    put_rows(dock, ["b"], [2, 3])
    data, idx = call.outcome()
    assert sorted(idx) == [0, 1, 2, 3]
    assert_data_matches(data, idx, ["a", "b"])


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ordered=st.booleans())
def test_c02_gets_match_a_reference_model(data, ordered):
    """Random puts and gets against a model of what a get must return (any-ready and ordered)."""
    cap = data.draw(st.integers(1, 12), label="rows")
    dock = make_dock(prompts_num=cap, guarantee_order=ordered)
    written = {"a": set(), "b": set()}
    taken = {"c1": set(), "c2": set()}
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        if data.draw(st.booleans(), label="put?"):
            col = data.draw(st.sampled_from(["a", "b"]))
            free = sorted(set(range(cap)) - written[col])
            if not free:
                continue
            rows = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
            put_rows(dock, [col], rows)
            written[col].update(rows)
            continue
        consumer = data.draw(st.sampled_from(["c1", "c2"]))
        cols = data.draw(st.sampled_from([["a"], ["b"], ["a", "b"]]))
        count = data.draw(st.integers(1, 5), label="count")
        got, idx = dock.get_experience(consumer, cols, count)
        untaken = sorted(set(range(cap)) - taken[consumer])
        ready = {r for r in untaken if all(r in written[c] for c in cols)}
        want = min(count, len(untaken))
        if ordered:
            head = untaken[:want]
            expected = head if want and all(r in ready for r in head) else []
            assert idx == expected
        elif want and len(ready) >= want:
            assert len(idx) == want and len(set(idx)) == want and set(idx) <= ready
        else:
            assert idx == []
        if idx:
            assert_data_matches(got, idx, cols)
        else:
            assert got == {}
        taken[consumer].update(idx)
        assert dock.all_consumed(consumer) == (len(taken[consumer]) == cap)


# ---------------------------------------------------------------------------------------------- contract 3


def test_c03_group_mode_hands_out_whole_ready_groups_only():
    dock = make_dock(prompts_num=3, n=4)
    put_rows(dock, ["a", "b"], [0, 1, 2])  # prompt 0 misses row 3
    put_rows(dock, ["a", "b"], [4, 5, 6, 7])  # prompt 1 complete
    put_rows(dock, ["a"], [8, 9, 10, 11])  # prompt 2 misses column b
    data, idx = dock.get_experience("c1", ["a", "b"], 4, get_n_samples=True)
    assert sorted(idx) == [4, 5, 6, 7]
    assert_data_matches(data, idx, ["a", "b"])
    put_rows(dock, ["b"], [8, 9])
    # Rows 0,1,2,8,9 are ready: enough rows, but no whole group.
    assert dock.get_experience("c1", ["a", "b"], 4, get_n_samples=True) == ({}, [])
    assert sorted(dock.get_experience("c2", ["a", "b"], 9)[1]) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    put_rows(dock, ["a", "b"], [3])
    put_rows(dock, ["b"], [10, 11])
    data, idx = dock.get_experience("c1", ["a", "b"], 8, get_n_samples=True)
    assert sorted(idx) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert_data_matches(data, idx, ["a", "b"])


def test_c03_group_count_must_be_a_multiple_of_n():
    dock = make_dock(prompts_num=3, n=4)
    put_rows(dock, ["a"], range(12))
    before = fingerprint(dock)
    for count in (1, 6, 10):
        with pytest.raises(DockValueError, match=rf"count={count}.*multiple of n_samples_per_prompt=4"):
            dock.get_experience("c1", ["a"], count, get_n_samples=True)
    assert fingerprint(dock) == before


def test_c03_group_mode_tail():
    dock = make_dock(prompts_num=3, n=2)
    put_rows(dock, ["a"], range(6))
    batches = drain(dock, "c1", ["a"], 4, get_n_samples=True)
    assert [len(b) for b in batches] == [4, 2]
    for b in batches:
        assert sorted(b) == sorted(r for g in {r // 2 for r in b} for r in (2 * g, 2 * g + 1))
    assert sorted(sum(batches, [])) == list(range(6))


# ---------------------------------------------------------------------------------------------- contract 4


@pytest.mark.parametrize("mode", ["any_ready", "ordered", "length_balanced", "groups"])
def test_c04_each_row_goes_to_exactly_one_caller_once(mode):
    n = 4 if mode == "groups" else 1
    cap = 240
    kwargs = {}
    if mode == "ordered":
        kwargs["guarantee_order"] = True
    if mode == "length_balanced":
        kwargs["samplers"] = {"c1": LengthBalancedSampler(4), "c2": LengthBalancedSampler(4)}
    dock = make_dock(prompts_num=cap // n, n=n, **kwargs)
    cols = ["a", "b"]
    rng = random.Random(1234)

    def produce():
        cells = [(c, r) for c in cols for r in range(cap)]
        rng.shuffle(cells)
        while cells:
            k = rng.randint(1, 9)
            batch, cells[:] = cells[:k], cells[k:]
            for c in cols:
                rows = [r for cc, r in batch if cc == c]
                if rows:
                    put_rows(dock, [c], rows)

    got: dict[str, list[list[int]]] = {"c1": [], "c2": []}
    errors = []
    record = threading.Lock()

    def consume(consumer, count):
        try:
            while True:
                data, idx = dock.get_experience(consumer, cols, count, get_n_samples=(n > 1),
                                                blocking=True, timeout=20)
                if not idx:
                    return
                assert_data_matches(data, idx, cols)
                with record:
                    got[consumer].append(idx)
        except BaseException as e:
            errors.append(e)

    counts = [4, 8] if n > 1 else [1, 3, 4, 5]
    threads = [threading.Thread(target=consume, args=(c, counts[i % len(counts)]), daemon=True)
               for c in ("c1", "c2") for i in range(4)]
    assert not dock.all_consumed("c1")
    for t in threads:
        t.start()
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    for t in [producer, *threads]:
        t.join(30)
        assert not t.is_alive()
    assert not errors, errors
    for consumer, batches in got.items():
        rows = sorted(r for b in batches for r in b)
        assert rows == list(range(cap)), f"{consumer}: rows lost or duplicated"
        assert dock.all_consumed(consumer)
        if mode == "groups":
            assert all(sorted(b) == sorted(r for g in {r // n for r in b} for r in range(g * n, g * n + n))
                       for b in batches)
        if mode == "ordered":
            assert all(b == list(range(b[0], b[0] + len(b))) for b in batches)
    assert dock.get_metrics()["consumer/c1/rows_taken"] == cap


def test_c04_all_consumed_only_after_every_row():
    dock = make_dock(prompts_num=4)
    put_rows(dock, ["a"], range(4))
    assert not dock.all_consumed("c1")
    dock.get_experience("c1", ["a"], 3)
    assert not dock.all_consumed("c1")
    dock.get_experience("c1", ["a"], 3)
    assert dock.all_consumed("c1")
    assert not dock.all_consumed("c2")


# ---------------------------------------------------------------------------------------------- contract 5


def test_c05_index_read_returns_those_rows_and_marks_them_taken():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a", "b"], range(8))
    data, idx = dock.get_experience("c1", ["a", "b"], 2, indexes=[5, 2])
    assert idx == [5, 2]
    assert_data_matches(data, idx, ["a", "b"])
    assert dock.get_consumer_status()["c1"]["taken"] == 2
    rest = sum(drain(dock, "c1", ["a", "b"], 8), [])
    assert sorted(rest) == [0, 1, 3, 4, 6, 7]
    assert dock.all_consumed("c1")
    assert dock.get_consumer_status()["c2"]["taken"] == 0


def test_c05_index_read_of_unwritten_cells_raises_missing_data():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a"], range(4))
    put_rows(dock, ["b"], [0, 1])
    before = fingerprint(dock)
    with pytest.raises(MissingDataError) as err:
        dock.get_experience("c1", ["a", "b"], 3, indexes=[1, 2, 5])
    assert isinstance(err.value, ValueError) and isinstance(err.value, DockError)
    msg = str(err.value)
    assert "'c1'" in msg and "'a' at rows [5]" in msg and "'b' at rows [2, 5]" in msg
    assert fingerprint(dock) == before, "a failed index read must not take the rows that were there"


def test_c05_blocking_index_read_waits_for_the_put():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a"], [6])
    call = start(dock.get_experience, "c1", ["a"], 2, indexes=[6, 7], blocking=True, timeout=30)
    assert still_blocked(call)
    put_rows(dock, ["a"], [7])
    data, idx = call.outcome()
    assert idx == [6, 7]
    assert_data_matches(data, idx, ["a"])


def test_c05_index_read_of_rows_already_taken_raises_and_takes_nothing():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a", "b"], range(8))
    _, by_index = dock.get_experience("c1", ["a"], 2, indexes=[5, 2])
    _, sampled = dock.get_experience("c1", ["a"], 2)
    before = fingerprint(dock)
    # Rows taken by index, and by a sampled get; row 6 is untaken and must not be taken either.
    for again, taken in (([2, 6], [2]), ([6, sampled[1], sampled[0]], [sampled[1], sampled[0]])):
        for blocking in (False, True):
            t0 = time.monotonic()
            with pytest.raises(DockValueError) as err:
                dock.get_experience("c1", ["a", "b"], 2, indexes=again, blocking=blocking, timeout=30)
            assert time.monotonic() - t0 < 5, "waiting cannot un-take a row: it must raise at once"
            assert type(err.value) is DockValueError, type(err.value)
            msg = str(err.value)
            assert "consumer 'c1'" in msg and f"already took rows {taken} ({len(taken)} rows)" in msg, msg
            assert fingerprint(dock) == before
    # Another consumer reads the same rows independently; c1 still gets each other row once.
    assert dock.get_experience("c2", ["a"], 2, indexes=[5, 2])[1] == [5, 2]
    rest = sum(drain(dock, "c1", ["a", "b"], 8), [])
    assert sorted(by_index + sampled + rest) == list(range(8))


def test_c05_a_waiting_index_read_raises_if_another_caller_takes_its_rows_meanwhile():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a"], [6])
    call = start(dock.get_experience, "c1", ["a"], 2, indexes=[6, 7], blocking=True, timeout=30)
    assert still_blocked(call)
    assert dock.get_experience("c1", ["a"], 1, indexes=[6])[1] == [6]  # a second caller of c1
    put_rows(dock, ["a"], [7])
    with pytest.raises(DockValueError, match=r"consumer 'c1' already took rows \[6\]"):
        call.outcome()
    assert dock.get_consumer_status()["c1"]["taken"] == 1, "the refused get took row 7"
    assert dock.get_experience("c1", ["a"], 1, indexes=[7])[1] == [7]


# ---------------------------------------------------------------------------------------------- contract 6


def _prepared_dock() -> TransferDock:
    """8 rows: a,b written at 0..3, b alone at 6; c1 has taken 2 of rows 0..3."""
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a", "b"], range(4))
    put_rows(dock, ["b"], [6])
    assert len(dock.get_experience("c1", ["a", "b"], 2)[1]) == 2
    return dock


def _i64(*rows):
    return [val(r, "a") for r in rows]


BAD_INPUTS = {
    "put_unknown_column": (lambda d: d.put_experience({"zz": _i64(4)}, [4]),
                           DockKeyError, ["'zz'", "['a', 'b']"]),
    "put_unknown_column_after_valid_one": (lambda d: d.put_experience({"a": _i64(4), "zz": _i64(4)}, [4]),
                                           DockKeyError, ["'zz'"]),
    "get_unknown_column": (lambda d: d.get_experience("c1", ["a", "zz"], 1), DockKeyError, ["'zz'", "'c1'"]),
    "get_unknown_consumer": (lambda d: d.get_experience("nobody", ["a"], 1),
                             DockKeyError, ["'nobody'", "['c1', 'c2']"]),
    "all_consumed_unknown_consumer": (lambda d: d.all_consumed("nobody"), DockKeyError, ["'nobody'"]),
    "put_length_mismatch": (lambda d: d.put_experience({"a": _i64(4, 5)}, [4, 5, 7]),
                            DockValueError, ["'a'", "2 values for 3 indexes"]),
    "put_length_mismatch_in_later_column": (
        lambda d: d.put_experience({"a": _i64(4, 5), "b": [val(4, "b")]}, [4, 5]),
        DockValueError, ["'b'", "1 values for 2 indexes"]),
    "put_index_out_of_range": (lambda d: d.put_experience({"a": _i64(4, 5)}, [4, 8]),
                               DockIndexError, ["[8]", "0 .. 7"]),
    "get_index_out_of_range": (lambda d: d.get_experience("c1", ["a"], 2, indexes=[0, 99]),
                               DockIndexError, ["[99]", "0 .. 7"]),
    "put_negative_index": (lambda d: d.put_experience({"a": _i64(4)}, [-1]), DockIndexError, ["[-1]", "0 .. 7"]),
    "get_negative_index": (lambda d: d.get_experience("c2", ["a"], 1, indexes=[-3]), DockIndexError, ["[-3]"]),
    "put_duplicate_indexes": (lambda d: d.put_experience({"a": _i64(4, 4)}, [4, 4]),
                              DockValueError, ["duplicate", "[4]"]),
    "get_duplicate_indexes": (lambda d: d.get_experience("c2", ["a"], 2, indexes=[0, 0]),
                              DockValueError, ["duplicate", "[0]"]),
    "put_already_written_cell": (lambda d: d.put_experience({"a": _i64(1)}, [1]),
                                 DockValueError, ["'a'", "already written", "[1]", "overwrite=True"]),
    "put_already_written_cell_in_later_column": (
        lambda d: d.put_experience({"a": _i64(6, 7), "b": [val(6, "b"), val(7, "b")]}, [6, 7]),
        DockValueError, ["'b'", "already written", "[6]"]),
    "count_zero": (lambda d: d.get_experience("c2", ["a"], 0), DockValueError, ["'c2'", "count=0", "> 0"]),
    "count_negative": (lambda d: d.get_experience("c2", ["a"], -2), DockValueError, ["count=-2"]),
    "count_not_an_int": (lambda d: d.get_experience("c2", ["a"], 1.5), DockValueError, ["count=1.5"]),
    "put_2d_value_in_list": (lambda d: d.put_experience({"a": [np.zeros((2, 2), dtype=np.int64)]}, [4]),
                             DockValueError, ["'a'", "1-D", "(2, 2)"]),
    "put_0d_tensor_value": (lambda d: d.put_experience({"a": [torch.tensor(3)]}, [4]),
                            DockValueError, ["'a'", "1-D"]),
    "put_1d_tensor_as_whole_column": (lambda d: d.put_experience({"a": torch.arange(2)}, [4, 5]),
                                      DockValueError, ["'a'", "1-D"]),
    "put_bad_value_in_later_column": (
        lambda d: d.put_experience({"a": _i64(4, 5), "b": [val(4, "b"), np.zeros((1, 3))]}, [4, 5]),
        DockValueError, ["'b'", "value 1", "1-D"]),
    "put_mixed_dtypes": (lambda d: d.put_experience({"a": [val(4, "a"), np.zeros(3, dtype=np.float32)]}, [4, 5]),
                         DockValueError, ["'a'", "int64", "float32"]),
    "put_mixed_tensor_and_array": (
        lambda d: d.put_experience({"a": [torch.zeros(3, dtype=torch.int64), val(5, "a")]}, [4, 5]),
        DockValueError, ["'a'", "ndarray", "Tensor"]),
    "get_index_already_taken": (lambda d: d.get_experience("c1", ["a", "b"], 2, indexes=d.state_dict()["taken"]["c1"]),
                                DockValueError, ["consumer 'c1'", "already took rows"]),
    "put_set_indexes": (lambda d: d.put_experience({"a": _i64(4, 5)}, {4, 5}), DockValueError,
                        ["set [4, 5]", "no order", "sorted(indexes)"]),
    "put_frozenset_indexes": (lambda d: d.put_experience({"a": _i64(4)}, frozenset([4])), DockValueError,
                              ["frozenset", "no order"]),
    "get_set_indexes": (lambda d: d.get_experience("c2", ["a"], 2, indexes={0, 1}), DockValueError,
                        ["get_experience", "set [0, 1]", "no order"]),
    "put_object_array_indexes": (lambda d: d.put_experience({"a": _i64(4, 5)}, np.array([4, 5], dtype=object)),
                                 DockValueError, ["dtype object", "astype(np.int64)"]),
    "get_object_array_indexes": (lambda d: d.get_experience("c2", ["a"], 2, indexes=np.array([0, 1], dtype=object)),
                                 DockValueError, ["get_experience", "dtype object"]),
    "put_0d_array_index": (lambda d: d.put_experience({"a": _i64(4)}, np.array(0)), DockValueError,
                           ["0-d ndarray", "[0]"]),
    "get_0d_tensor_index": (lambda d: d.get_experience("c2", ["a"], 1, indexes=torch.tensor(0)), DockValueError,
                            ["0-d Tensor", "[0]"]),
    "put_bytes_indexes": (lambda d: d.put_experience({"a": _i64(4, 5)}, b"\x04\x05"), DockValueError, ["bytes"]),
    "put_mixed_dtypes_in_later_column": (
        lambda d: d.put_experience({"a": _i64(4, 5), "b": [torch.zeros(2), torch.zeros(2, dtype=torch.int32)]},
                                   [4, 5]),
        DockValueError, ["'b'", "dtype"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_c06_bad_input_raises_and_leaves_dock_unchanged(case):
    call, exc_type, words = BAD_INPUTS[case]
    dock = _prepared_dock()
    before = fingerprint(dock)
    with pytest.raises(exc_type) as err:
        call(dock)
    assert isinstance(err.value, DockError)
    base = {DockKeyError: KeyError, DockIndexError: IndexError, DockValueError: ValueError}[exc_type]
    assert isinstance(err.value, base)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert fingerprint(dock) == before
    _assert_prepared_dock_works(dock)


def _assert_prepared_dock_works(dock: TransferDock) -> None:
    """Nothing invisible to the state (the ready-row bookkeeping) of `_prepared_dock` moved."""
    assert sorted(dock.get_experience("c2", ["a", "b"], 4)[1]) == [0, 1, 2, 3]
    assert len(dock.get_experience("c1", ["a", "b"], 2)[1]) == 2
    assert dock.get_experience("c1", ["a"], 1) == ({}, [])
    assert dock.get_experience("c2", ["b"], 1)[1] == [6]


def test_c06_overwrite_true_replaces_the_cell():
    dock = _prepared_dock()
    new = np.array([-1, -2, -3], dtype=np.int64)
    dock.put_experience({"a": [new]}, [0], overwrite=True)
    assert dock.get_column_status()["a"]["written"] == 4
    assert dock.state_dict()["cells"]["a"][0] is new
    data, idx = dock.get_experience("c2", ["a"], 1, indexes=[0])
    assert np.array_equal(data["a"][0], new)


# ---------------------------------------------------------------------------------------------- contract 7


def test_c07_blocked_get_wakes_promptly_on_put_from_another_thread():
    dock = make_dock(prompts_num=8)
    call = start(dock.get_experience, "c1", ["a", "b"], 2, blocking=True, timeout=30)
    assert still_blocked(call)
    put_rows(dock, ["a"], [3, 5])
    assert still_blocked(call)
    put_rows(dock, ["b"], [3, 5])
    data, idx = call.outcome(timeout=10)
    assert sorted(idx) == [3, 5]
    assert_data_matches(data, idx, ["a", "b"])
    assert call.elapsed < 10, "woke on the put, not on its 30 s timeout"


def test_c07_timeout_raises_descriptive_error():
    dock = make_dock(prompts_num=8)
    put_rows(dock, ["a", "b"], [0, 1])
    put_rows(dock, ["a"], [2, 3])
    dock.get_experience("c1", ["a", "b"], 2)
    t = time.monotonic()
    with pytest.raises(DockTimeoutError) as err:
        dock.get_experience("c1", ["a", "b"], 2, blocking=True, timeout=0.2)
    assert time.monotonic() - t >= 0.19
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, DockError)
    msg = str(err.value)
    for w in ("'c1'", "['a', 'b']", "Ready now: 0", "taken: 2/8", "'a' written 4/8", "'b' written 2/8",
              "'a' missing at rows [4, 5, 6, 7] (4 rows)", "'b' missing at rows [2, 3, 4, 5, 6, 7] (6 rows)"):
        assert w in msg, (w, msg)
    assert dock.get_consumer_status()["c1"]["taken"] == 2


def test_c07_default_timeout_bounds_a_blocking_get():
    dock = make_dock(prompts_num=2, default_timeout=0.1)
    with pytest.raises(DockTimeoutError, match="'c2'"):
        dock.get_experience("c2", ["a"], 1, blocking=True)


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5])
def test_c07_refuses_non_positive_default_timeout(bad):
    with pytest.raises(DockValueError, match="default_timeout"):
        make_dock(default_timeout=bad)


# ---------------------------------------------------------------------------------------------- contract 8


def test_c08_clear_frees_cells_and_memory_returns_to_baseline():
    rows = list(range(8))
    dock = make_dock(("x", "y"), ("c",), prompts_num=8, event_log_size=4)
    tracemalloc.start()
    try:
        baseline = None
        for step in range(1, 51):
            xs = [np.full(8192, step, dtype=np.float64) for _ in rows]  # 8 x 64 KiB, traced
            ys = [torch.full((16384,), float(step)) for _ in rows]  # 8 x 64 KiB
            refs = [weakref.ref(v) for v in xs + ys]
            dock.put_experience({"x": xs, "y": ys}, rows)
            del xs, ys
            taken = 0
            while not dock.all_consumed("c"):
                data, idx = dock.get_experience("c", ["x", "y"], 1)
                assert data["x"][0][0] == step
                taken += len(idx)
                del data
            assert taken == 8
            dock.clear()
            assert dock.step == step
            assert dock.get_column_status()["x"]["written"] == 0
            alive = sum(r() is not None for r in refs)
            assert alive == 0, f"step {step}: {alive} cells still referenced after clear()"
            if step == 10:
                baseline = tracemalloc.get_traced_memory()[0]
        end = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert end <= baseline + 16 * 1024, f"traced memory grew from {baseline} to {end} bytes over 40 steps"
    assert len(dock.get_event_log()) == 4
    # The next step works normally after all those clears.
    put_rows(dock, ["x", "y"], rows)
    assert sorted(dock.get_experience("c", ["x", "y"], 8)[1]) == rows


def test_c08_clear_resets_progress_and_wakes_nothing_stale():
    dock = make_dock(prompts_num=4, samplers={"c2": LengthBalancedSampler(2)})
    put_rows(dock, ["a", "b"], range(4))
    dock.get_experience("c1", ["a"], 3)
    dock.get_experience("c2", ["a"], 1)  # leaves rows reserved in the balanced sampler
    dock.clear()
    assert dock.get_consumer_status() == {c: {"taken": 0, "retired": 0, "total": 4, "all_consumed": False} for c in ("c1", "c2")}
    assert dock.get_experience("c1", ["a"], 1) == ({}, [])
    assert dock.get_experience("c2", ["a"], 1) == ({}, [])
    put_rows(dock, ["a", "b"], range(4))  # the same cells can be written again in the new step
    for c in ("c1", "c2"):
        assert sorted(sum(drain(dock, c, ["a", "b"], 1), [])) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- contract 9


def test_c09_guarantee_order_hands_out_blocks_in_index_order():
    dock = make_dock(prompts_num=12, guarantee_order=True)
    put_rows(dock, ["a"], range(4, 12))
    assert dock.get_experience("c1", ["a"], 4) == ({}, []), "must wait for rows 0..3, not skip ahead"
    assert dock.get_experience("c1", ["a"], 1) == ({}, [])
    put_rows(dock, ["a"], [2, 3])
    assert dock.get_experience("c1", ["a"], 1) == ({}, [])
    put_rows(dock, ["a"], [0, 1])
    assert [b for b in drain(dock, "c1", ["a"], 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_c09_guarantee_order_is_independent_of_put_order():
    def batches(put_order):
        dock = make_dock(prompts_num=20, guarantee_order=True)
        out = []
        for r in put_order:
            put_rows(dock, ["a", "b"], [r])
            data, idx = dock.get_experience("c1", ["a", "b"], 3)
            if idx:
                out.append(idx)
        out += drain(dock, "c1", ["a", "b"], 3)
        return out

    forward = batches(list(range(20)))
    shuffled = list(range(20))
    random.Random(7).shuffle(shuffled)
    assert batches(shuffled) == forward == [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]


def test_c09_blocked_ordered_get_waits_for_the_next_rows_in_order():
    dock = make_dock(prompts_num=8, guarantee_order=True)
    call = start(dock.get_experience, "c1", ["a"], 2, blocking=True, timeout=30)
    put_rows(dock, ["a"], [2, 3, 4, 5])
    assert still_blocked(call), "later rows are ready, but rows 0 and 1 are not"
    put_rows(dock, ["a"], [0, 1])
    assert call.outcome()[1] == [0, 1]
    assert dock.get_experience("c1", ["a"], 2)[1] == [2, 3]


def test_c09_guarantee_order_group_mode():
    dock = make_dock(prompts_num=4, n=2, guarantee_order=True)
    put_rows(dock, ["a"], [4, 5, 6, 7, 0])
    assert dock.get_experience("c1", ["a"], 2, get_n_samples=True) == ({}, [])
    put_rows(dock, ["a"], [1, 2, 3])
    assert drain(dock, "c1", ["a"], 4, get_n_samples=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---------------------------------------------------------------------------------------------- contract 10


def _token_sums(batches, lengths):
    return [sum(lengths[r] for r in b) for b in batches]


def test_c10_samplers_are_pluggable_per_consumer():
    dock = make_dock(consumers=("any", "ord", "bal"), prompts_num=12,
                     samplers={"any": AnyReadySampler(), "ord": OrderedSampler(), "bal": LengthBalancedSampler(2)})
    put_rows(dock, ["a"], range(6, 12))
    assert dock.get_experience("ord", ["a"], 2) == ({}, []), "ordered consumer waits for rows 0,1"
    assert set(dock.get_experience("any", ["a"], 2)[1]) <= set(range(6, 12))
    assert set(dock.get_experience("bal", ["a"], 2)[1]) <= set(range(6, 12))
    put_rows(dock, ["a"], range(6))
    assert dock.get_experience("ord", ["a"], 2)[1] == [0, 1]
    with pytest.raises(DockKeyError, match="nobody"):
        make_dock(samplers={"nobody": OrderedSampler()})
    with pytest.raises(ValueError):
        LengthBalancedSampler(0)


def test_c10_length_balanced_micro_batches_beat_a_contiguous_split():
    dp, count, cap = 4, 4, 70
    lengths = [1 + 9 * r for r in range(cap)]  # longer with the index: a contiguous split is lopsided
    dock = TransferDock(["resp"], ["train"], cap, samplers={"train": LengthBalancedSampler(dp)})
    dock.put_experience({"resp": [np.ones(n, dtype=np.int32) for n in lengths]}, list(range(cap)))
    seen = []
    balanced_spread = naive_spread = 0
    for _ in range(cap // (dp * count)):
        together = []
        for _rank in range(dp):
            data, idx = dock.get_experience("train", ["resp"], count)
            assert len(idx) == count
            assert [len(v) for v in data["resp"]] == [lengths[r] for r in idx]
            together.append(idx)
        sums = _token_sums(together, lengths)
        balanced_spread += max(sums) - min(sums)
        pool = sorted(r for b in together for r in b)
        naive = _token_sums([pool[i:i + count] for i in range(0, len(pool), count)], lengths)
        naive_spread += max(naive) - min(naive)
        seen += pool
    assert naive_spread > 0
    assert balanced_spread * 10 < naive_spread, (balanced_spread, naive_spread)
    tail = drain(dock, "train", ["resp"], count, check=False)
    assert [len(b) for b in tail] == [4, 2]
    seen += [r for b in tail for r in b]
    assert sorted(seen) == list(range(cap)), "a row was lost or handed out twice"
    assert dock.all_consumed("train")


def test_c10_length_balanced_group_mode_hands_out_whole_groups():
    dock = make_dock(prompts_num=4, n=3, samplers={"c1": LengthBalancedSampler(2)})
    put_rows(dock, ["a"], range(12))
    batches = drain(dock, "c1", ["a"], 6, get_n_samples=True)
    assert sorted(sum(batches, [])) == list(range(12))
    for b in batches:
        assert len(b) == 6 and all(sum(1 for r in b if r // 3 == g) in (0, 3) for g in range(4))


def test_c10_length_balanced_reserved_rows_respect_requested_columns():
    """Rows the balanced sampler reserved for a get of column 'a' must not be handed to a get that
    also needs 'b' before 'b' is written (contract 2: no partly written row is ever handed out)."""
    dock = make_dock(prompts_num=8, samplers={"c1": LengthBalancedSampler(2)})
    put_rows(dock, ["a"], range(4))
    _, first = dock.get_experience("c1", ["a"], 2)  # cuts rows 0..3 into 2 batches, reserves one
    assert len(first) == 2
    assert dock.get_experience("c1", ["a", "b"], 2) == ({}, []), "column 'b' is written nowhere yet"
    put_rows(dock, ["a"], range(4, 8))
    put_rows(dock, ["b"], range(8))
    rest = sum(drain(dock, "c1", ["a", "b"], 2), [])
    assert sorted(first + rest) == list(range(8))


def test_c10_length_balanced_never_re_hands_a_row_taken_by_index():
    """A row read by index is taken; a later sampled get must not hand it out again, even if the
    balanced sampler had reserved it before the index read."""
    dock = make_dock(prompts_num=8, samplers={"c1": LengthBalancedSampler(2)})
    put_rows(dock, ["a"], range(4))
    _, first = dock.get_experience("c1", ["a"], 2)  # pool is rows 0..3: the other two are reserved
    reserved = sorted(set(range(4)) - set(first))
    _, by_index = dock.get_experience("c1", ["a"], 2, indexes=reserved)
    assert by_index == reserved
    put_rows(dock, ["a"], range(4, 8))
    rest = sum(drain(dock, "c1", ["a"], 2), [])
    assert sorted(rest) == [4, 5, 6, 7], f"rows {sorted(set(rest) & set(range(4)))} handed out a second time"


# ---------------------------------------------------------------------------------------------- contract 11


def test_c11_state_dict_round_trip_mid_step():
    dock = make_dock(prompts_num=4, n=2)
    put_rows(dock, ["a"], range(8))
    put_rows(dock, ["b"], range(4))
    _, c1_first = dock.get_experience("c1", ["a"], 3)
    dock.get_experience("c2", ["a", "b"], 2, indexes=[0, 1])
    state = dock.state_dict()
    saved_status = dock.get_column_status(), dock.get_consumer_status()
    dock.get_experience("c1", ["a"], 5)  # progress after the save is not part of the saved state

    fresh = make_dock(prompts_num=4, n=2)
    fresh.load_state_dict(state)
    assert (fresh.get_column_status(), fresh.get_consumer_status()) == saved_status
    c1_rest = sum(drain(fresh, "c1", ["a"], 2), [])
    assert sorted(c1_first + c1_rest) == list(range(8))
    assert sorted(sum(drain(fresh, "c2", ["a", "b"], 1), [])) == [2, 3]
    with pytest.raises(DockValueError, match="already written"):
        put_rows(fresh, ["b"], [3])
    put_rows(fresh, ["b"], range(4, 8))
    assert sorted(sum(drain(fresh, "c2", ["a", "b"], 2), [])) == [4, 5, 6, 7]
    assert fresh.all_consumed("c1") and fresh.all_consumed("c2")


def test_c11_state_dict_keeps_the_step_and_ordered_cursor():
    dock = make_dock(prompts_num=6, guarantee_order=True)
    dock.clear()
    dock.clear()
    put_rows(dock, ["a"], range(6))
    assert dock.get_experience("c1", ["a"], 2)[1] == [0, 1]
    fresh = make_dock(prompts_num=6, guarantee_order=True)
    fresh.load_state_dict(dock.state_dict())
    assert fresh.step == 2
    assert drain(fresh, "c1", ["a"], 2) == [[2, 3], [4, 5]]


def test_c11_rows_reserved_by_length_balanced_sampler_survive_restore():
    dock = make_dock(prompts_num=16, samplers={"c1": LengthBalancedSampler(4)})
    put_rows(dock, ["a"], range(16))
    _, first = dock.get_experience("c1", ["a"], 2)  # cuts 8 rows into 4 batches: 6 rows reserved
    fresh = make_dock(prompts_num=16, samplers={"c1": LengthBalancedSampler(4)})
    fresh.load_state_dict(dock.state_dict())
    rest = sum(drain(fresh, "c1", ["a"], 2), [])
    assert sorted(first + rest) == list(range(16))
    assert fresh.all_consumed("c1")


@pytest.mark.parametrize("other, key", [
    (dict(columns=("a", "x")), "columns"),
    (dict(consumers=("c1",)), "consumers"),
    (dict(prompts_num=9), "prompts_num"),
    (dict(prompts_num=4, n=2), "prompts_num"),
    (dict(prompts_num=8, n=2), "n_samples_per_prompt"),
])
def test_c11_load_rejects_a_state_with_another_layout(other, key):
    source = make_dock(prompts_num=8)
    put_rows(source, ["a"], range(8))
    target = make_dock(**other)
    before = fingerprint(target)
    with pytest.raises(DockValueError) as err:
        target.load_state_dict(source.state_dict())
    assert f"saved {key}=" in str(err.value) and "this dock has" in str(err.value)
    assert fingerprint(target) == before


def test_c11_load_rejects_an_incomplete_state():
    state = make_dock().state_dict()
    del state["taken"]
    with pytest.raises(DockValueError, match="'taken'"):
        make_dock().load_state_dict(state)


def _set(mapping: dict, key, value) -> None:
    mapping[key] = value


def _drop(mapping: dict, key) -> None:
    del mapping[key]


# Each case spoils one thing in a good state (column 'b' comes after 'a', so a load that restored
# column by column would already have replaced 'a'): (spoil(state), error, words in its message).
BAD_STATES = {
    "cell_row_out_of_range": (lambda s: _set(s["cells"]["b"], 99, val(1, "b")), DockIndexError,
                              ["column 'b'", "[99]", "0 .. 7"]),
    "cell_row_negative": (lambda s: _set(s["cells"]["b"], -1, val(1, "b")), DockIndexError, ["column 'b'", "[-1]"]),
    "cell_row_not_an_int": (lambda s: _set(s["cells"]["b"], "3", val(3, "b")), DockValueError,
                            ["column 'b'", "ints"]),
    "cell_of_another_dtype": (lambda s: _set(s["cells"]["b"], 5, np.zeros(3, dtype=np.float32)), DockValueError,
                              ["column 'b', row 5", "numpy.float32", "numpy.int64"]),
    "cell_tensor_among_arrays": (lambda s: _set(s["cells"]["b"], 5, torch.zeros(3, dtype=torch.int64)),
                                 DockValueError, ["column 'b', row 5", "torch.int64"]),
    "cell_2d": (lambda s: _set(s["cells"]["b"], 5, np.zeros((2, 2), dtype=np.int64)), DockValueError,
                ["column 'b', row 5", "(2, 2)", "1-D"]),
    "cell_not_an_array": (lambda s: _set(s["cells"]["b"], 5, [1, 2, 3]), DockValueError,
                          ["column 'b', row 5", "list"]),
    "cells_of_unknown_column": (lambda s: _set(s["cells"], "zz", {}), DockKeyError, ["['zz']", "['a', 'b']"]),
    "cells_of_a_column_missing": (lambda s: _drop(s["cells"], "b"), DockKeyError, ["'cells'", "['b']"]),
    "cells_of_a_column_not_a_dict": (lambda s: _set(s["cells"], "b", [val(0, "b")]), DockValueError,
                                     ["column 'b'", "list"]),
    "cells_not_a_dict": (lambda s: _set(s, "cells", [1]), DockValueError, ["'cells'", "list"]),
    "taken_by_unknown_consumer": (lambda s: _set(s["taken"], "ghost", []), DockKeyError, ["['ghost']", "['c1', 'c2']"]),
    "taken_of_a_consumer_missing": (lambda s: _drop(s["taken"], "c2"), DockKeyError, ["'taken'", "['c2']"]),
    "taken_row_out_of_range": (lambda s: _set(s["taken"], "c2", [1, 8]), DockIndexError, ["consumer 'c2'", "[8]"]),
    "taken_row_twice": (lambda s: _set(s["taken"], "c2", [1, 1]), DockValueError, ["consumer 'c2'", "duplicate"]),
    "taken_rows_not_ints": (lambda s: _set(s["taken"], "c2", [0.5]), DockValueError, ["consumer 'c2'", "float"]),
    "step_negative": (lambda s: _set(s, "step", -1), DockValueError, ["step=-1"]),
}


def _good_state() -> dict:
    """A state unlike `_prepared_dock`'s: all 8 rows of a and b written, c2 took 3 rows."""
    source = make_dock(prompts_num=8)
    put_rows(source, ["a", "b"], range(8))
    source.get_experience("c2", ["a"], 3)
    return source.state_dict()


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_c11_load_rejects_a_bad_state_and_leaves_the_dock_as_it_was(case):
    spoil, exc_type, words = BAD_STATES[case]
    state = _good_state()
    spoil(state)
    dock = _prepared_dock()
    before = fingerprint(dock)
    with pytest.raises(DockError) as err:
        dock.load_state_dict(state)
    assert type(err.value) is exc_type, f"{type(err.value).__name__}: {err.value}"
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert fingerprint(dock) == before, "a rejected state changed the dock"
    _assert_prepared_dock_works(dock)


def test_c11_load_rejects_a_state_that_is_not_a_dict():
    dock = _prepared_dock()
    before = fingerprint(dock)
    with pytest.raises(DockValueError, match="the state is a list"):
        dock.load_state_dict([("cells", {})])
    assert fingerprint(dock) == before


def test_c11_a_good_state_loads_after_a_rejected_one():
    dock = _prepared_dock()
    bad = _good_state()
    bad["cells"]["b"][99] = val(1, "b")
    with pytest.raises(DockIndexError):
        dock.load_state_dict(bad)
    good = _good_state()
    dock.load_state_dict(good)
    assert fingerprint(dock)[0] == {**good, "cells": {c: {r: v.tolist() for r, v in cs.items()}
                                                      for c, cs in good["cells"].items()}}
    with pytest.raises(DockValueError, match="numpy.int64 rows this step"):  # the loaded column's dtype holds
        dock.put_experience({"a": [np.zeros(2, dtype=np.float32)]}, [0], overwrite=True)


# ---------------------------------------------------------------------------------------------- contract 12


def _assert_examined_tracks_count(dock, consumer, count, gets, **kwargs):
    for _ in range(gets):
        before = dock.get_metrics()["rows_examined"]
        _, idx = dock.get_experience(consumer, ["a"], count, **kwargs)
        grew = dock.get_metrics()["rows_examined"] - before
        assert len(idx) == count
        assert 1 <= grew <= 2 * count, f"{consumer}: examined {grew} rows for a get of {count}"


@pytest.mark.slow
def test_c12_rows_examined_grows_with_count_not_capacity_at_1m_rows():
    cap = 1_000_000
    dock = TransferDock(["a"], ["any", "ord"], cap, samplers={"ord": OrderedSampler()})
    shared = np.zeros(2, dtype=np.int32)
    dock.put_experience({"a": [shared] * cap}, np.arange(cap))
    for consumer in ("any", "ord"):
        _assert_examined_tracks_count(dock, consumer, 64, 50)
        _assert_examined_tracks_count(dock, consumer, 5000, 100)  # half the step
        _assert_examined_tracks_count(dock, consumer, 64, 50)
    assert dock.get_consumer_status()["ord"]["taken"] == 2 * 50 * 64 + 100 * 5000
    assert dock.get_metrics()["rows_examined"] <= 2 * 2 * (2 * 50 * 64 + 100 * 5000)


def test_c12_rows_examined_in_group_mode():
    n = 4
    dock = TransferDock(["a"], ["any", "ord"], 100_000, n, samplers={"ord": OrderedSampler()})
    shared = np.zeros(2, dtype=np.int32)
    dock.put_experience({"a": [shared] * dock.capacity}, np.arange(dock.capacity))
    for consumer in ("any", "ord"):
        _assert_examined_tracks_count(dock, consumer, 64, 50, get_n_samples=True)
        _assert_examined_tracks_count(dock, consumer, 4000, 25, get_n_samples=True)
        _assert_examined_tracks_count(dock, consumer, 64, 50, get_n_samples=True)


# ---------------------------------------------------------------------------------------------- observability


def test_metrics_after_a_known_sequence():
    dock = make_dock(prompts_num=5)
    a_rows = [np.arange(2, dtype=np.int64) + r for r in range(4)]  # 16 bytes each
    b_rows = [np.zeros(3, dtype=np.float32) for _ in range(2)]  # 12 bytes each
    dock.put_experience({"a": a_rows}, range(4), producer="rollout")
    dock.put_experience({"b": b_rows}, [0, 1])
    assert len(dock.get_experience("c1", ["a"], 3)[1]) == 3
    assert dock.get_experience("c1", ["a"], 3) == ({}, [])  # 1 ready, 2 untaken: not a tail
    assert sorted(dock.get_experience("c2", ["a", "b"], 2)[1]) == [0, 1]
    with pytest.raises(DockTimeoutError):
        dock.get_experience("c2", ["a", "b"], 2, blocking=True, timeout=0.05)
    m = dock.get_metrics()
    expected = {
        "bytes_in": 4 * 16 + 2 * 12, "bytes_out": 3 * 16 + 2 * (16 + 12), "puts": 2, "step": 0,
        "column/a/rows_written": 4, "column/b/rows_written": 2,
        "column/a/step_rows_written": 4, "column/b/step_rows_written": 2,
        "consumer/c1/rows_taken": 3, "consumer/c1/calls": 2, "consumer/c1/empty_calls": 1,
        "consumer/c2/rows_taken": 2, "consumer/c2/calls": 2, "consumer/c2/empty_calls": 1,
        "consumer/c1/step_rows_taken": 3, "consumer/c2/step_rows_taken": 2,
    }
    assert {k: m[k] for k in expected} == expected
    assert m["consumer/c2/wait_s"] >= 0.05 > m["consumer/c1/wait_s"]
    dock.clear()
    m = dock.get_metrics()
    assert m["step"] == 1 and m["consumer/c1/step_rows_taken"] == 0 and m["column/a/step_rows_written"] == 0
    assert m["consumer/c1/rows_taken"] == 3 and m["bytes_in"] == 88, "counters run since the dock was made"


def test_event_log_records_puts_and_gets_with_stages_and_seq():
    dock = make_dock(prompts_num=6)
    dock.put_experience({"a": _i64(0, 1)}, [0, 1], producer="rollout")
    put_rows(dock, ["a", "b"], [2, 3])
    dock.get_experience("c1", ["a"], 2)
    dock.get_experience("c1", ["a", "b"], 4)  # empty: not an event
    dock.get_experience("c2", ["a", "b"], 2)
    events = dock.get_event_log()
    assert [(e["op"], e["stage"], e["rows"]) for e in events] == [
        ("put", "rollout", 2), ("put", "a+b", 2), ("get", "c1", 2), ("get", "c2", 2)]
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(e["step"] == 0 and e["t_end"] >= e["t_start"] for e in events)
    assert events[0]["bytes"] == sum(v.nbytes for v in _i64(0, 1))
    assert dock.get_event_log(since=seqs[1]) == events[2:]
    assert dock.get_event_log(since=seqs[-1]) == []


def test_event_log_is_bounded():
    dock = make_dock(prompts_num=10, event_log_size=3)
    for r in range(10):
        put_rows(dock, ["a"], [r])
    events = dock.get_event_log()
    assert len(events) == 3
    assert [e["seq"] for e in events] == [8, 9, 10]


def test_consumer_and_column_status():
    dock = make_dock(prompts_num=3, n=2)
    put_rows(dock, ["a"], range(6))
    put_rows(dock, ["b"], [0])
    dock.get_experience("c1", ["a"], 6)
    dock.get_experience("c2", ["a"], 1, indexes=[4])
    assert dock.get_column_status() == {"a": {"written": 6, "total": 6}, "b": {"written": 1, "total": 6}}
    assert dock.get_consumer_status() == {
        "c1": {"taken": 6, "retired": 0, "total": 6, "all_consumed": True},
        "c2": {"taken": 1, "retired": 0, "total": 6, "all_consumed": False},
    }


def test_grpo_dock_columns_and_consumers():
    assert list(GRPO_COLUMNS) == ["prompts", "prompt_length", "responses", "response_length", "input_ids", "labels",
                                  "rm_scores", "token_level_rewards", "old_log_prob", "ref_log_prob", "advantages",
                                  "returns"]
    assert list(GRPO_CONSUMERS) == ["actor_rollout", "rule_reward", "reward_scores", "ref_log_prob",
                                    "actor_log_prob", "compute_advantage", "actor_train", "grpo_metrics"]
    dock = GRPOTransferDock(3, 2, extra_columns=["values"], extra_consumers=["critic_train"],
                            guarantee_order=True)
    assert dock.columns == [*GRPO_COLUMNS, "values"]
    assert dock.consumers == [*GRPO_CONSUMERS, "critic_train"]
    assert dock.capacity == 6 and dock.guarantee_order
    dock.put_experience({"prompts": [torch.arange(3)] * 6, "values": [torch.ones(2)] * 6}, range(6))
    data, idx = dock.get_experience("critic_train", ["prompts", "values"], 2, get_n_samples=True)
    assert idx == [0, 1] and torch.equal(data["values"][0], torch.ones(2))
    with pytest.raises(DockKeyError, match="critic_train"):
        GRPOTransferDock(3).get_experience("critic_train", ["prompts"], 1)


def test_a_2d_tensor_stands_for_its_rows():
    dock = make_dock(prompts_num=3)
    block = torch.arange(12).reshape(3, 4)
    dock.put_experience({"a": block, "b": np.arange(6, dtype=np.float32).reshape(3, 2)}, [2, 0, 1])
    data, idx = dock.get_experience("c1", ["a", "b"], 3, indexes=[0, 1, 2])
    assert [t.tolist() for t in data["a"]] == [block[1].tolist(), block[2].tolist(), block[0].tolist()]
    assert [v.tolist() for v in data["b"]] == [[2, 3], [4, 5], [0, 1]]
    with pytest.raises(DockValueError, match="'a' has 3 values for 2 indexes"):
        dock.put_experience({"a": torch.zeros(3, 4)}, [0, 1], overwrite=True)
