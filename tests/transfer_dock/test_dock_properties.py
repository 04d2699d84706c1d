"""Property-based tests of the plain `TransferDock` (no Ray).

A hypothesis state machine drives one dock with random puts, gets and clears and checks every
answer against a small model of what is written and what each consumer has taken. A threaded
property test then runs producers and data-parallel consumer threads against one dock at once.
"""
from __future__ import annotations

import random
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from mindspeed_rl.transfer_dock import (DockError, DockIndexError, DockKeyError, DockTimeoutError, DockValueError,
                                        MissingDataError, TransferDock)

COLUMNS = ("a", "b", "c")
CONSUMERS = ("x", "y")
# One dtype / container per column, so a row that comes back under the wrong column shows.
_MAKERS = {
    "a": lambda vals: torch.tensor(vals, dtype=torch.int64),
    "b": lambda vals: torch.tensor(vals, dtype=torch.float32),
    "c": lambda vals: np.asarray(vals, dtype=np.float64),
}


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)


class DockMachine(RuleBasedStateMachine):
    """Random puts/gets/clears on one dock; the model says what each get must return."""

    guarantee_order = False

    @initialize(prompts_num=st.integers(1, 4), n=st.integers(1, 3))
    def make_dock(self, prompts_num, n):
        self.n = n
        self.capacity = prompts_num * n
        self.dock = TransferDock(COLUMNS, CONSUMERS, prompts_num, n, guarantee_order=self.guarantee_order)
        self.step = 0
        self.written: dict[str, dict[int, object]] = {c: {} for c in COLUMNS}
        self.taken: dict[str, set[int]] = {c: set() for c in CONSUMERS}

    # ------------------------------------------------------------------ model helpers
    def _untaken(self, consumer) -> list[int]:
        return [r for r in range(self.capacity) if r not in self.taken[consumer]]

    def _ready(self, consumer, columns) -> set[int]:
        return {r for r in self._untaken(consumer) if all(r in self.written[c] for c in columns)}

    def _groups(self, rows) -> list[int]:
        """Groups all of whose rows are in `rows`, ascending."""
        rows = set(rows)
        return [g for g in range(self.capacity // self.n)
                if all(r in rows for r in range(g * self.n, g * self.n + self.n))]

    def _expected(self, consumer, columns, count, group):
        """What the contract says: ('done',) / ('empty',) / ('size', k, allowed) / ('exact', rows)."""
        left = self.capacity - len(self.taken[consumer])
        if left == 0:
            return ("done",)
        want = min(count, left)
        if group:  # only groups none of whose rows this consumer took can still go out whole
            untouched = [g for g in range(self.capacity // self.n)
                         if not any(r in self.taken[consumer] for r in range(g * self.n, g * self.n + self.n))]
            want = min(count, len(untouched) * self.n)
            if want == 0:
                return ("done",)
        ready = self._ready(consumer, columns)
        if self.guarantee_order:
            if group:  # the lowest whole groups nobody has taken a row of, all ready, or nothing
                candidates = self._groups(self._untaken(consumer))[: want // self.n]
                assert len(candidates) == want // self.n, "model: not enough untaken groups"
                rows = [r for g in candidates for r in range(g * self.n, g * self.n + self.n)]
            else:  # the lowest untaken rows, all ready, or nothing
                rows = self._untaken(consumer)[:want]
            return ("exact", rows) if all(r in ready for r in rows) else ("empty",)
        if group:
            return ("size", want, ready) if len(self._groups(ready)) >= want // self.n else ("empty",)
        return ("size", want, ready) if len(ready) >= want else ("empty",)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: any(len(self.written[c]) < self.capacity for c in COLUMNS))
    @rule(data=st.data())
    def put(self, data):
        """Write one column (sometimes several at once) on rows not yet written there."""
        open_columns = [c for c in COLUMNS if len(self.written[c]) < self.capacity]
        columns = data.draw(st.lists(st.sampled_from(open_columns), min_size=1, max_size=3, unique=True),
                            label="columns")
        free = [r for r in range(self.capacity) if all(r not in self.written[c] for c in columns)]
        if not free:
            columns = columns[:1]
            free = [r for r in range(self.capacity) if r not in self.written[columns[0]]]
        rows = data.draw(st.one_of(st.lists(st.sampled_from(free), min_size=1, unique=True),
                                   st.permutations(free)), label="rows")
        batch = {}
        for column in columns:
            # Length 2..4: the row, the step, then filler; the value says where it belongs.
            batch[column] = [_MAKERS[column]([r, self.step] + [r * 10 + k for k in range(data.draw(
                st.integers(0, 2), label="extra"))]) for r in rows]
        self.dock.put_experience(batch, rows, producer="+".join(columns))
        for column, values in batch.items():
            self.written[column].update(zip(rows, values))

    @rule(consumer=st.sampled_from(CONSUMERS), data=st.data())
    def get(self, consumer, data):
        # Mostly columns that have data, so that many gets have something to hand out.
        with_data = [c for c in COLUMNS if self.written[c]] or list(COLUMNS)
        pool = data.draw(st.sampled_from([with_data, with_data, list(COLUMNS)]), label="column_pool")
        columns = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True), label="columns")
        group = data.draw(st.booleans(), label="get_n_samples")
        if group:
            count = self.n * data.draw(st.one_of(st.just(1), st.integers(1, self.capacity // self.n + 1)),
                                       label="groups")
        else:
            count = data.draw(st.one_of(st.integers(1, 2), st.integers(1, self.capacity + 1)), label="count")
        expected = self._expected(consumer, columns, count, group)
        event(f"get: {expected[0]}{' (n-groups)' if group else ''}")
        blocking = expected[0] == "empty" and data.draw(st.integers(0, 7), label="try_blocking") == 7

        if blocking:  # nothing can be handed out: a short blocking get must time out and take nothing
            with pytest.raises(DockTimeoutError, match=f"consumer '{consumer}'"):
                self.dock.get_experience(consumer, columns, count, get_n_samples=group, blocking=True, timeout=0.01)
            return
        out, rows = self.dock.get_experience(consumer, columns, count, get_n_samples=group)

        if expected[0] in ("done", "empty"):
            assert (out, rows) == ({}, []), f"expected nothing ({expected[0]}), got rows {rows}"
            return
        # Exactly once per consumer per step, and only rows whose columns were all written.
        assert len(rows) == len(set(rows)), f"duplicate rows in one get: {rows}"
        assert not set(rows) & self.taken[consumer], f"rows {set(rows) & self.taken[consumer]} handed out twice"
        if expected[0] == "exact":
            assert rows == expected[1], f"ordered dock handed out {rows}, expected {expected[1]}"
        else:
            _, size, ready = expected
            assert len(rows) == size, f"asked {count}, {len(ready)} ready, got {len(rows)} rows"
            assert set(rows) <= ready, f"rows {set(rows) - ready} were not ready for columns {columns}"
        if group:
            assert len(rows) % self.n == 0
            groups = Counter(r // self.n for r in rows)
            assert all(k == self.n for k in groups.values()), f"partial prompt groups in {rows}"
        assert set(out) == set(columns)
        for c in columns:
            assert len(out[c]) == len(rows)
            for r, v in zip(rows, out[c]):
                assert _same(v, self.written[c][r]), f"column {c} row {r}: got {v}, put {self.written[c][r]}"
        self.taken[consumer].update(rows)

    @rule(consumer=st.sampled_from(CONSUMERS), data=st.data())
    def get_by_index(self, consumer, data):
        """A by-index get hands out exactly those rows, in that order; rows this consumer took
        already, or unwritten cells, raise and take nothing."""
        columns = data.draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True), label="columns")
        fresh = [r for r in self._untaken(consumer) if all(r in self.written[c] for c in columns)]
        pool = data.draw(st.sampled_from([fresh, list(range(self.capacity))] if fresh else [list(range(self.capacity))]),
                         label="row_pool")
        rows = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True), label="rows")
        again = [r for r in rows if r in self.taken[consumer]]
        missing = [r for r in rows if any(r not in self.written[c] for c in columns)]
        event(f"get_by_index: {'taken' if again else 'missing' if missing else 'ok'}")
        before = _cells_of(self.dock)
        if again:
            with pytest.raises(DockValueError, match=rf"consumer '{consumer}' already took rows \[{again[0]}"):
                self.dock.get_experience(consumer, columns, 1, indexes=rows, blocking=data.draw(st.booleans()),
                                         timeout=10.0)
        elif missing:
            with pytest.raises(MissingDataError):
                self.dock.get_experience(consumer, columns, 1, indexes=rows)
        else:
            out, got = self.dock.get_experience(consumer, columns, 1, indexes=rows)
            assert got == rows
            for c in columns:
                assert all(_same(v, self.written[c][r]) for r, v in zip(rows, out[c])), f"column {c}"
            self.taken[consumer].update(rows)
            return
        assert _cells_of(self.dock) == before, "a refused by-index get changed the dock"

    @rule(data=st.data())
    def load_a_spoiled_state(self, data):
        """A state with one bad row or name is refused as a whole: nothing changes (the model and
        the later gets check that the dock goes on as if the load never happened)."""
        state = self.dock.state_dict()
        column = data.draw(st.sampled_from(COLUMNS), label="column")
        spoil = data.draw(st.sampled_from(["row_out_of_range", "cell_2d", "cell_dtype", "taken_unknown",
                                           "taken_out_of_range"]), label="spoil")
        cells = dict(state["cells"][column])
        if spoil == "row_out_of_range":
            cells[self.capacity + data.draw(st.integers(0, 3))], error = _MAKERS[column]([0]), DockIndexError
        elif spoil == "cell_2d":
            cells[0], error = _MAKERS[column]([[0, 1]]), DockValueError
        elif spoil == "cell_dtype":  # a column's own dtype under the other container type
            other = torch.tensor([0], dtype=torch.float64) if column == "c" else np.zeros(1, dtype=np.float16)
            cells[data.draw(st.integers(0, self.capacity - 1))], error = other, DockValueError
        elif spoil == "taken_unknown":
            state["taken"] = {**state["taken"], "ghost": []}
            error = DockKeyError
        else:
            state["taken"] = {**state["taken"], CONSUMERS[0]: [self.capacity]}
            error = DockIndexError
        state["cells"] = {**state["cells"], column: cells}
        if spoil == "cell_dtype" and len(cells) == 1:
            error = None  # the only cell of its column: a column of another dtype, which is fine
        event(f"load_a_spoiled_state: {spoil}")
        before = _cells_of(self.dock)
        if error is None:
            return
        with pytest.raises(DockError) as err:
            self.dock.load_state_dict(state)
        assert type(err.value) is error, f"{spoil}: {type(err.value).__name__}: {err.value}"
        assert _cells_of(self.dock) == before, f"a refused state ({spoil}) changed the dock"

    @precondition(lambda self: any(self.written[c] for c in COLUMNS))
    @rule(data=st.data())
    def clear(self, data):
        # Clear mostly at the end of a step; sometimes mid-step.
        if not any(len(t) == self.capacity for t in self.taken.values()):
            if data.draw(st.integers(0, 5), label="clear_mid_step") != 5:
                return
        self.dock.clear()
        self.step += 1
        self.written = {c: {} for c in COLUMNS}
        self.taken = {c: set() for c in CONSUMERS}

    # ------------------------------------------------------------------ invariants
    @invariant()
    def progress_matches_model(self):
        for c in CONSUMERS:
            assert self.dock.all_consumed(c) == (len(self.taken[c]) == self.capacity), \
                f"all_consumed('{c}') is wrong: the model says {len(self.taken[c])}/{self.capacity} taken"
        taken = {c: s["taken"] for c, s in self.dock.get_consumer_status().items()}
        assert taken == {c: len(t) for c, t in self.taken.items()}, f"consumer status {taken}"
        written = {c: s["written"] for c, s in self.dock.get_column_status().items()}
        assert written == {c: len(w) for c, w in self.written.items()}, f"column status {written}"
        assert self.dock.step == self.step


def _cells_of(dock: TransferDock) -> dict:
    """A dock's state_dict, cell by cell, in comparable form."""
    sd = dock.state_dict()
    return {**sd, "cells": {c: {r: (str(v.dtype), v.tolist()) for r, v in cs.items()} for c, cs in sd["cells"].items()}}


class OrderedDockMachine(DockMachine):
    guarantee_order = True


_MACHINE_SETTINGS = settings(max_examples=250, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
def test_dock_state_machine_any_order():
    run_state_machine_as_test(DockMachine, settings=_MACHINE_SETTINGS)


@pytest.mark.slow
def test_dock_state_machine_guarantee_order():
    run_state_machine_as_test(OrderedDockMachine, settings=_MACHINE_SETTINGS)


@settings(max_examples=60, deadline=None)
@given(guarantee_order=st.booleans(), prompts_num=st.integers(1, 4), n=st.integers(2, 3), data=st.data())
def test_n_sample_get_after_index_reads_returns_whole_groups_or_nothing(guarantee_order, prompts_num, n, data):
    """Rows read by index count as taken; a later whole-group get must skip the groups they broke
    and return whole untouched groups, or nothing, never fail."""
    dock = TransferDock(["a"], ["x"], prompts_num, n, guarantee_order=guarantee_order)
    capacity = dock.capacity
    dock.put_experience({"a": [torch.tensor([r]) for r in range(capacity)]}, list(range(capacity)))
    read = data.draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=capacity, unique=True), label="read")
    for r in read:
        dock.get_experience("x", ["a"], 1, indexes=[r])
    broken = {r // n for r in read}
    intact = [g for g in range(prompts_num) if g not in broken]
    groups = data.draw(st.integers(1, prompts_num), label="groups")

    out, rows = dock.get_experience("x", ["a"], groups * n, get_n_samples=True)

    assert all(k == n for k in Counter(r // n for r in rows).values()), f"partial groups {rows}"
    assert {r // n for r in rows} <= set(intact), f"rows {rows} include rows already read by index {read}"
    assert [int(v) for v in out.get("a", [])] == rows


# ---------------------------------------------------------------------- threads
@st.composite
def threaded_scenarios(draw):
    prompts_num = draw(st.integers(1, 12))
    n = draw(st.integers(1, 3))
    capacity = prompts_num * n
    # Each consumer reads a non-empty set of columns, with its own micro-batch size.
    consumers = {}
    for name in CONSUMERS:
        cols = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True))
        group = draw(st.booleans())
        count = n * draw(st.integers(1, 3)) if group else draw(st.integers(1, capacity + 1))
        ranks = draw(st.integers(1, 3))
        consumers[name] = (cols, count, group, ranks)
    n_producers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    return prompts_num, n, consumers, n_producers, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=threaded_scenarios(), guarantee_order=st.booleans())
def test_threaded_producers_and_dp_consumers_deliver_each_row_once(scenario, guarantee_order):
    prompts_num, n, consumers, n_producers, seed = scenario
    rng = random.Random(seed)
    dock = TransferDock(COLUMNS, CONSUMERS, prompts_num, n, guarantee_order=guarantee_order, default_timeout=10.0)
    capacity = dock.capacity

    # Every cell, in random order, dealt to producers in random micro-batches.
    cells = [(c, r) for c in COLUMNS for r in range(capacity)]
    rng.shuffle(cells)
    jobs: list[list[tuple[str, list[int]]]] = [[] for _ in range(n_producers)]
    i = 0
    while i < len(cells):
        column = cells[i][0]
        batch = [cells[i][1]]
        i += 1
        while i < len(cells) and cells[i][0] == column and len(batch) < rng.randint(1, 4):
            batch.append(cells[i][1])
            i += 1
        jobs[rng.randrange(n_producers)].append((column, batch))

    def value(column, r):
        return _MAKERS[column]([r, 7 * r + 1])

    errors: list[BaseException] = []
    received: dict[str, list[tuple[int, dict]]] = {c: [] for c in CONSUMERS}
    lock = threading.Lock()

    def produce(batches, seed):
        local = random.Random(seed)
        try:
            for column, rows in batches:
                dock.put_experience({column: [value(column, r) for r in rows]}, rows, producer=column)
                if local.random() < 0.3:
                    threading.Event().wait(local.random() * 0.002)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    def consume(consumer, cols, count, group):
        try:
            while True:
                out, rows = dock.get_experience(consumer, cols, count, get_n_samples=group, blocking=True, timeout=10.0)
                if not rows:
                    assert out == {}
                    assert dock.all_consumed(consumer), "an empty blocking get before the consumer took every row"
                    return
                if group:
                    assert all(k == n for k in Counter(r // n for r in rows).values()), f"partial groups {rows}"
                if guarantee_order:  # all ranks use one count: batches are consecutive, aligned rows
                    assert rows == list(range(rows[0], rows[0] + len(rows))) and rows[0] % count == 0, \
                        f"ordered dock handed out {rows} for count {count}"
                with lock:
                    received[consumer].extend((r, {c: out[c][j] for c in cols}) for j, r in enumerate(rows))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(jobs[p], rng.random())) for p in range(n_producers)]
    for name, (cols, count, group, ranks) in consumers.items():
        threads += [threading.Thread(target=consume, args=(name, cols, count, group)) for _ in range(ranks)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 60 s"
    if errors:
        raise errors[0]

    for name, (cols, _, _, _) in consumers.items():
        got = Counter(r for r, _ in received[name])
        assert sorted(got) == list(range(capacity)), f"consumer {name} missed rows {set(range(capacity)) - set(got)}"
        assert max(got.values()) == 1, f"consumer {name} got rows more than once: {[r for r, k in got.items() if k > 1]}"
        for r, values in received[name]:
            for c in cols:
                assert _same(values[c], value(c, r)), f"consumer {name}, column {c}, row {r}: {values[c]}"
        assert dock.all_consumed(name)
