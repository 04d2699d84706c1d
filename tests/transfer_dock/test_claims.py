"""Local claims (`claims.py`): consumers on the dock's node take rows in shared memory themselves.

The contract must hold as on every other path: every row to each consumer exactly once per step,
whatever the interleaving of local claims, the actor's own gets (sampled and by index), puts,
clears and restores, across real processes; status, metrics, the event log and state_dict count
the rows taken locally; a dead or closed dock is not claimed from.

Most tests run the actor's side in this process (`LocalDock`: shared-memory cells, a
`SharedDock`, its `ClaimBoard`) against `ClaimClient`s in this process and in spawned
processes, so they need no Ray; the last ones go through `create_transfer_dock`.
"""
from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

from mindspeed_rl.transfer_dock import DockTimeoutError, DockValueError, MissingDataError, claim_files, claims, shm
from mindspeed_rl.transfer_dock.actor import _cells, reply_parts
from mindspeed_rl.transfer_dock.client import assemble
from mindspeed_rl.transfer_dock.codec import pack, unpack
from mindspeed_rl.transfer_dock.rows import checked_rows
from mindspeed_rl.transfer_dock.shared_dock import SharedDock
from mindspeed_rl.transfer_dock.samplers import LengthBalancedSampler

from . import claim_procs
from .claim_procs import x_row, y_row
from .test_dock_properties import DockMachine, _same

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")


class LocalDock:
    """The dock actor's data path, in this process: rows go to shared memory (or stay inline for
    `inline_columns`), the actor's `SharedDock` keeps its `ClaimBoard` in step, and a get tries a
    local claim first, as `TransferDockClient` does, then asks the dock."""

    def __init__(self, columns, consumers, prompts_num, n=1, inline_columns=(), **kwargs):
        self.tag = f"test{os.getpid()}x{uuid.uuid4().hex[:8]}"
        self.gen = shm.Generation(self.tag)
        self.arena = shm.ShmArena(self.tag, self.gen.path, "local")
        self.dock = SharedDock(columns, consumers, prompts_num, n, **kwargs)
        self.board = claims.ClaimBoard(self.tag, self.dock.columns, self.dock.consumers, self.dock.capacity, "local")
        self.dock.attach(self.board)
        self.claimer = claims.ClaimClient(self.board.info())
        self.inline = set(inline_columns)

    @property
    def step(self) -> int:
        return self.dock.step

    @property
    def info(self) -> dict:
        return self.board.info()

    def put_experience(self, data, indexes, overwrite=False, producer=None):
        blocks = {}
        for column, values in data.items():
            block = pack(checked_rows(column, values))
            blocks[column] = block if column in self.inline else self.arena.write(block)
        self.dock.put_cells({c: _cells(b) for c, b in blocks.items()}, indexes, overwrite=overwrite,
                            producer=producer, kinds={c: b.kind for c, b in blocks.items()})

    def get_experience(self, consumer, columns, count, indexes=None, get_n_samples=False, blocking=False,
                       timeout=None, copy=True, local=True):
        columns = [columns] if isinstance(columns, str) else list(columns)
        if local and indexes is None and not get_n_samples:
            got = self.claimer.claim(consumer, columns, count, "test", copy)
            if got is not None:
                return got
        data, rows = self.dock.get_experience(consumer, columns, count, indexes, get_n_samples, blocking, timeout)
        refs: list = []
        parts = {c: reply_parts(cells, refs) for c, cells in data.items()}
        return assemble(parts, len(rows), refs, copy), rows

    def state_dict(self):  # as TransferDockActor.state_dict
        state = self.dock.state_dict()
        for column, cells in state["cells"].items():
            for r, cell in list(cells.items()):
                src = cell.source
                block = shm.reader().block(src) if isinstance(src, shm.ShmBlock) else src
                cells[r] = unpack(block.take([cell.pos]))[0]
        return state

    def load_state_dict(self, state):  # as TransferDockActor.load_state_dict
        kinds = self.dock.checked_state(state)
        state = dict(state)
        cells = {}
        for column, rows in state["cells"].items():
            order = sorted(rows)
            cells[column] = dict(zip(order, _cells(pack([rows[r] for r in order])))) if rows else {}
        state["cells"] = cells
        self.dock.restore_state(state, kinds)

    def clear(self):
        self.dock.clear()
        self.gen.bump()

    def __getattr__(self, name):  # all_consumed, get_consumer_status, get_metrics, ...
        return getattr(self.__dict__["dock"], name)

    def close(self):
        self.dock.detach()
        shm.remove_dock_files(self.tag)


def processes():
    """Real processes, not forks of this one (it may run Ray's threads): a forkserver that has
    imported torch and the dock once, so that each process starts in well under a second."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([claim_procs.__name__])
    return ctx


@pytest.fixture
def docks():
    made: list[LocalDock] = []

    def make(*args, **kwargs):
        d = LocalDock(*args, **kwargs)
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()


# ---------------------------------------------------------------------- one process
def test_a_local_claim_takes_ready_rows_and_the_dock_counts_them(docks):
    d = docks(["x", "y"], ["c", "e"], 16)
    d.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)), producer="gen")
    assert d.claimer.claim("c", ["x"], 2, None, True) is None, "no ready list before the dock's first get"
    _, first = d.get_experience("c", ["x"], 2)  # through the dock: makes the ready list
    before = d.claimer.claims_made
    out, rows = d.get_experience("c", ["x"], 3, copy=False)
    assert d.claimer.claims_made == before + 1, "the second get was not claimed locally"
    assert len(rows) == 3 and not set(rows) & set(first)
    assert [v.tolist() for v in out["x"]] == [x_row(r).tolist() for r in rows]
    assert d.claimer.claim("c", ["x"], 4, None, True) is None, "3 rows ready: a get of 4 must go to the dock"
    status = d.get_consumer_status()
    assert status["c"]["taken"] == 5 and status["e"]["taken"] == 0
    m = d.get_metrics()
    assert m["consumer/c/rows_taken"] == 5 and m["consumer/c/calls"] == 2 and m["consumer/c/step_rows_taken"] == 5
    assert m["bytes_out"] == sum(x_row(r).numel() * 4 for r in first + rows)
    gets = [e for e in d.get_event_log() if e["op"] == "get"]
    assert [(e["stage"], e["rows"], e["worker"], e["step"]) for e in gets] == [("c", 2, None, 0), ("c", 3, "test", 0)]
    assert sorted(d.state_dict()["taken"]["c"]) == sorted(first + rows)
    # the dock's own gets see the local claims: by index, and the step's tail
    with pytest.raises(DockValueError, match=f"already took rows \\[{rows[0]}"):
        d.get_experience("c", ["x"], 1, indexes=[rows[0]])
    _, rest = d.get_experience("c", ["x"], 3)
    assert sorted(first + rows + rest) == list(range(8))
    d.put_experience({"x": [x_row(r) for r in range(8, 16)]}, list(range(8, 16)))
    _, rest = d.get_experience("c", ["x"], 10)  # the tail: fewer than asked
    assert sorted(rest) == list(range(8, 16)) and d.all_consumed("c")
    assert d.get_experience("c", ["x"], 8) == ({}, [])
    assert d.claimer.claims_made == before + 3


def test_the_tail_blocking_and_empty_gets_go_to_the_dock_and_keep_the_contract(docks):
    d = docks(["x"], ["c"], 6)
    d.put_experience({"x": [x_row(r) for r in range(4)]}, list(range(4)))
    d.get_experience("c", ["x"], 1)  # the ready list
    out, rows = d.get_experience("c", ["x"], 3)  # local
    assert len(rows) == 3 and d.claimer.claims_made == 1
    with pytest.raises(DockTimeoutError, match="consumer 'c'"):  # 0 ready, 2 unwritten: waits, then times out
        d.get_experience("c", ["x"], 2, blocking=True, timeout=0.05)
    threading.Timer(0.1, lambda: d.put_experience({"x": [x_row(4), x_row(5)]}, [4, 5])).start()
    _, rows = d.get_experience("c", ["x"], 5, blocking=True, timeout=5.0)  # the tail: fewer than count
    assert sorted(rows) == [4, 5] and d.all_consumed("c")


def test_columns_held_by_the_dock_and_other_samplers_are_served_by_the_dock(docks):
    d = docks(["x", "y"], ["c", "b"], 8, inline_columns=["y"], samplers={"b": LengthBalancedSampler(2)})
    d.put_experience({"x": [x_row(r) for r in range(8)], "y": [y_row(r) for r in range(8)]}, list(range(8)))
    for consumer in ("c", "b"):
        seen = []
        for _ in range(4):
            out, rows = d.get_experience(consumer, ["x", "y"] if consumer == "c" else ["x"], 2)
            assert [v.tolist() for v in out["x"]] == [x_row(r).tolist() for r in rows]
            seen += rows
        assert sorted(seen) == list(range(8))
    assert d.claimer.claims_made == 0, "'y' lives in the dock, 'b' reserves rows: no local claim may serve them"


def test_an_overwritten_cell_is_read_whole_by_a_later_claim(docks):
    d = docks(["x"], ["c"], 8)
    d.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)))
    d.get_experience("c", ["x"], 1)
    d.put_experience({"x": [x_row(r, step=7) for r in range(8)]}, list(range(8)), overwrite=True)
    out, rows = d.get_experience("c", ["x"], 7)
    assert d.claimer.claims_made == 1
    assert [v.tolist() for v in out["x"]] == [x_row(r, step=7).tolist() for r in rows]


def test_clear_and_load_state_dict_reset_what_clients_may_claim(docks):
    d = docks(["x"], ["c"], 8)
    d.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)))
    d.get_experience("c", ["x"], 2)
    d.get_experience("c", ["x"], 2)  # local
    state = d.state_dict()
    assert len(state["taken"]["c"]) == 4
    d.clear()
    assert d.claimer.claim("c", ["x"], 1, None, True) is None, "a cleared step has no ready rows"
    d.put_experience({"x": [x_row(r, 1) for r in range(8)]}, list(range(8)))
    out, rows = d.get_experience("c", ["x"], 3)  # the list survives clear(): local at once
    assert d.claimer.claims_made == 2 and [v.tolist() for v in out["x"]] == [x_row(r, 1).tolist() for r in rows]
    d.load_state_dict(state)  # back to step 0, 4 rows taken; restored cells live in the dock
    got = []
    while True:
        out, rows = d.get_experience("c", ["x"], 3)
        if not rows:
            break
        assert [v.tolist() for v in out["x"]] == [x_row(r).tolist() for r in rows]
        got += rows
    assert sorted(got + state["taken"]["c"]) == list(range(8))
    assert d.claimer.claims_made == 2, "restored cells are not in shared memory: no local claim"


def test_a_closed_dock_is_not_claimed_from(docks):
    d = docks(["x"], ["c"], 8)
    d.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)))
    d.get_experience("c", ["x"], 1)
    d.dock.detach()
    assert d.claimer.claim("c", ["x"], 1, None, True) is None
    _, rows = d.get_experience("c", ["x"], 7)
    assert len(rows) == 7 and d.all_consumed("c")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, np.float64, np.int32],
                         ids=lambda d: str(d).replace("torch.", "").replace("<class 'numpy.", "numpy.").rstrip("'>"))
@pytest.mark.parametrize("copy", [False, True], ids=["zero-copy", "copy"])
def test_rows_read_by_place_equal_the_rows_put_in_any_order(dtype, copy):
    """`ShmReader.rows_at` (what a claim reads): rows back to back, and rows in another order or
    from two blocks, zero-copy or into one private buffer, of every dtype; equal to `unpack`."""
    tag = f"test{os.getpid()}x{uuid.uuid4().hex[:8]}"
    gen = shm.Generation(tag)
    try:
        arena = shm.ShmArena(tag, gen.path, "local")
        if isinstance(dtype, torch.dtype):
            rows = [(torch.arange(r % 4 + 1) * 3 + r).to(dtype) for r in range(6)]
        else:
            rows = [(np.arange(r % 4 + 1) * 3 + r).astype(dtype) for r in range(6)]
        blocks = [arena.write(pack(rows[:4])), arena.write(pack(rows[4:]))]
        itemsize = blocks[0].itemsize

        def place(r):
            b, pos = (blocks[0], r) if r < 4 else (blocks[1], r - 4)
            return b.segment, b.offset + int(sum(b.numel[:pos])) * itemsize, int(b.numel[pos])
        for order in ([0, 1, 2, 3], [1, 2], [3, 0, 5, 1], [4, 5], [2, 4]):
            segs, offs, numels = zip(*(place(r) for r in order))
            got = shm.reader().rows_at(list(segs), blocks[0].dtype, blocks[0].torch_dtype, list(offs), list(numels),
                                       copy)
            for r, v in zip(order, got):
                assert type(v) is type(rows[r]) and v.dtype == rows[r].dtype, (order, r, v)
                assert (torch.equal(v, rows[r]) if isinstance(v, torch.Tensor) else np.array_equal(v, rows[r]))
            if copy:  # private: writing to it changes no other reader's rows
                got[0][0] = 99
                again = shm.reader().rows_at(list(segs), blocks[0].dtype, blocks[0].torch_dtype, list(offs),
                                             list(numels), False)
                assert again[0][0] == rows[order[0]][0]
    finally:
        shm.remove_dock_files(tag)


# ---------------------------------------------------------------------- state machine
class LocalClaimsMachine(DockMachine):
    """The plain dock's state machine (test_dock_properties.py), with the dock's actor side in
    this process and every get trying a local claim first: the same model must hold. Column 'c'
    stays in the dock (inline), so gets that read it go to the dock."""

    local_gets = 0

    @initialize(prompts_num=st.integers(1, 4), n=st.integers(1, 3))
    def make_dock(self, prompts_num, n):
        super().make_dock(prompts_num, n)
        self.dock = LocalDock(("a", "b", "c"), ("x", "y"), prompts_num, n, inline_columns=["c"])
        for consumer in ("x", "y"):  # the dock's first get of a column set makes its ready list
            for columns in (["a"], ["b"], ["a", "b"]):
                assert self.dock.get_experience(consumer, columns, 1) == ({}, [])

    @rule(consumer=st.sampled_from(("x", "y")), columns=st.sampled_from([["a"], ["b"], ["a", "b"], ["b", "a"]]),
          count=st.integers(1, 3), copy=st.booleans())
    def small_get(self, consumer, columns, count, copy):
        """A get that a local claim can often answer: columns in shared memory, a small count."""
        expected = self._expected(consumer, columns, count, False)
        out, rows = self.dock.get_experience(consumer, columns, count, copy=copy)
        if expected[0] in ("done", "empty"):
            assert (out, rows) == ({}, []), f"expected nothing ({expected[0]}), got rows {rows}"
            return
        _, size, ready = expected
        assert len(rows) == size == len(set(rows)), f"asked {count}, {len(ready)} ready, got {rows}"
        assert set(rows) <= ready, f"rows {set(rows) - ready} were not ready (or taken already)"
        assert list(out) == columns
        for c in columns:
            assert all(_same(v, self.written[c][r]) for r, v in zip(rows, out[c])), f"column {c}"
        self.taken[consumer].update(rows)

    def teardown(self):
        dock = getattr(self, "dock", None)
        if isinstance(dock, LocalDock):
            LocalClaimsMachine.local_gets += dock.claimer.claims_made
            dock.close()


@pytest.mark.slow
def test_dock_state_machine_with_local_claims():
    LocalClaimsMachine.local_gets = 0
    run_state_machine_as_test(LocalClaimsMachine, settings=settings(
        max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert LocalClaimsMachine.local_gets > 0, "the machine never claimed locally"  # typically 15-90


# ---------------------------------------------------------------------- processes
def test_processes_claiming_one_consumer_with_the_dock_take_every_row_exactly_once(docks):
    """4 processes claim consumer 'c' and 2 claim 'd' while this process puts rows in random
    micro-batches and order, and takes rows for both consumers through the dock itself, sampled
    and by index: per step, each consumer gets every row exactly once, with its data."""
    steps, capacity = 4, 96
    d = docks(["x", "y"], ["c", "d"], capacity)
    ctx = processes()
    step_now, step_done, reports = ctx.Value("i", -1), ctx.Value("i", -1), ctx.Queue()
    ranks = [("c", ["x"], k) for k in (1, 2, 3, 4)] + [("d", ["x", "y"], k) for k in (2, 3)]
    procs = [ctx.Process(target=claim_procs.claiming_process, args=(d.info, c, cols, k, step_now, step_done, reports, i, steps),
                         daemon=True) for i, (c, cols, k) in enumerate(ranks)]
    for p in procs:
        p.start()
    rng = random.Random(0)
    claimed_locally = 0
    try:
        for step in range(steps):
            mine: dict[str, list[int]] = {"c": [], "d": []}
            errors: list[BaseException] = []

            def produce():
                try:
                    puts = []
                    for column, maker in (("x", x_row), ("y", y_row)):
                        rows = list(range(capacity))
                        rng.shuffle(rows)
                        while rows:
                            k = rng.randint(1, 8)
                            puts.append((column, maker, rows[:k]))
                            rows = rows[k:]
                    rng.shuffle(puts)
                    for column, maker, rows in puts:
                        d.put_experience({column: [maker(r, step) for r in rows]}, rows)
                        time.sleep(rng.random() * 0.002)
                except BaseException as e:  # raised below
                    errors.append(e)

            def take_through_the_dock():
                try:
                    while not (d.all_consumed("c") and d.all_consumed("d")):
                        consumer = rng.choice(["c", "d"])
                        cols = ["x"] if consumer == "c" else ["x", "y"]
                        if rng.random() < 0.2:  # by index: a row someone else may have taken meanwhile
                            try:
                                out, rows = d.get_experience(consumer, cols, 1, indexes=[rng.randrange(capacity)])
                            except (DockValueError, MissingDataError):
                                continue
                        else:
                            out, rows = d.get_experience(consumer, cols, 2, local=False)
                        if not rows:
                            time.sleep(0.001)
                            continue
                        assert [v.tolist() for v in out["x"]] == [x_row(r, step).tolist() for r in rows]
                        mine[consumer] += rows
                        time.sleep(0.001)
                except BaseException as e:
                    errors.append(e)

            step_now.value = step
            threads = [threading.Thread(target=produce), threading.Thread(target=take_through_the_dock)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads), "the step did not finish in 60 s"
            if errors:
                raise errors[0]
            step_done.value = step
            got = {"c": list(mine["c"]), "d": list(mine["d"])}
            for _ in procs:  # generous: a process started from the forkserver on a loaded 2-core machine is slow
                consumer, s, rows, bad, made = reports.get(timeout=240)
                assert s == step and bad == [], f"{consumer}: rows {bad} came with the wrong data"
                got[consumer] += rows
                claimed_locally += made if step == steps - 1 else 0
            for consumer, rows in got.items():
                dup = sorted({r for r in rows if rows.count(r) > 1})
                assert not dup, f"step {step}: consumer {consumer} got rows {dup} twice"
                assert sorted(rows) == list(range(capacity)), \
                    f"step {step}: consumer {consumer} lost rows {sorted(set(range(capacity)) - set(rows))}"
            assert d.get_consumer_status()["c"]["taken"] == capacity
            d.clear()
    finally:
        step_now.value = step_done.value = steps  # a failed step: let the processes end
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert claimed_locally > 0, "no process claimed a row itself"
    m = d.get_metrics()
    assert m["consumer/c/rows_taken"] == m["consumer/d/rows_taken"] == steps * capacity
    log = d.get_event_log()
    assert sum(e["rows"] for e in log if e["op"] == "get" and e["stage"] == "c") == steps * capacity


@pytest.mark.slow
def test_processes_claiming_while_puts_arrive_get_the_type_and_dtype_that_was_put(docks):
    """Issue 24 (1b): claims read each cell's kind (numpy dtype, torch dtype or none) from the
    table while the dock writes other rows of the same columns. The kind was one record per
    column, zeroed and rewritten by every put, so a claim between the two read dtype '' (a
    TypeError) or no torch dtype (torch rows handed out as numpy arrays). Here 3 processes claim
    as fast as they can while this process puts one row of one column at a time, and every column
    changes kind (torch <-> numpy, dtypes of other sizes) at every clear: every row a process or
    the dock hands out must have the type, dtype and values put, every row go to each consumer
    exactly once, and no claim may raise. Without the fix it failed in each of 4 runs, in its first
    step, with tens to hundreds of claims raising `data type '' not understood` (once `'\\x00nt16'`:
    half of bfloat16's dtype)."""
    steps, capacity = len(claim_procs.KIND_STEPS), 256
    d = docks(["a", "b", "c"], ["p", "q"], capacity)
    ranks = [("p", ["a", "b", "c"]), ("p", ["c", "a", "b"]), ("q", ["c", "a"])]
    for consumer, cols in ranks:  # through the dock: makes each consumer's ready list (no row is ready)
        assert d.get_experience(consumer, cols, 1, local=False) == ({}, [])
    ctx = processes()
    started, step_now, step_done, reports = ctx.Value("i", 0), ctx.Value("i", -1), ctx.Value("i", -1), ctx.Queue()
    procs = [ctx.Process(target=claim_procs.checking_kinds_process,
                         args=(d.info, consumer, cols, started, step_now, step_done, reports, i, steps), daemon=True)
             for i, (consumer, cols) in enumerate(ranks)]
    for p in procs:
        p.start()
    rng = random.Random(1)
    claimed_locally = 0
    try:
        deadline = time.monotonic() + 240  # a bound, not a measurement: a loaded machine starts processes slowly
        while started.value < len(procs):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "the claiming processes did not start"
            time.sleep(0.01)
        for step in range(steps):
            step_now.value = step
            puts = [(column, r) for column in "abc" for r in range(capacity)]
            rng.shuffle(puts)
            for n, (column, r) in enumerate(puts):
                d.put_experience({column: [claim_procs.kind_row(column, r, step)]}, [r])
                if n % 128 == 0:
                    d.get_consumer_status()  # reads the claim logs, as the actor's status calls do
            step_done.value = step
            got: dict[str, list[int]] = {"p": [], "q": []}
            problems: list[str] = []
            for _ in procs:  # generous: processes on a loaded 2-core machine are slow
                consumer, s, rows, some, n_problems, made = reports.get(timeout=240)
                assert s == step
                if n_problems:
                    problems.append(f"{consumer}: {n_problems} problems, e.g. {some}")
                got[consumer] += rows
                claimed_locally += made if step == steps - 1 else 0
            assert not problems, f"step {step}: rows claimed with another type or dtype than put: {problems}"
            for consumer, cols in (("p", ["a", "b", "c"]), ("q", ["c", "a"])):
                out, rows = d.get_experience(consumer, cols, capacity, local=False)  # the rows left: the tail
                for column in cols:
                    assert claim_procs.kind_problems(column, rows, out.get(column, []), step) == []
                rows = got[consumer] + rows
                dup = sorted({r for r in rows if rows.count(r) > 1})
                assert not dup, f"step {step}: consumer {consumer} got rows {dup} twice"
                assert sorted(rows) == list(range(capacity)), f"step {step}: consumer {consumer} lost rows"
            d.clear()
    finally:
        step_now.value = step_done.value = steps  # a failed step: let the processes end
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert claimed_locally > 0, "no process claimed a row itself: the test tested nothing"


def test_a_stopped_lock_holder_is_a_timeout_error_and_a_killed_one_frees_the_lock(docks, monkeypatch):
    d = docks(["x"], ["c"], 8)
    d.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)))
    d.get_experience("c", ["x"], 1)
    ctx = processes()
    ready = ctx.Event()
    holder = ctx.Process(target=claim_procs.hold_the_lock, args=(d.info["consumer_files"][0], ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(60)
        monkeypatch.setattr(claim_files, "LOCK_TIMEOUT_S", 0.2)
        with pytest.raises(DockTimeoutError, match="consumer 'c'"):
            d.get_experience("c", ["x"], 1, local=False)
        with pytest.raises(DockTimeoutError, match="consumer 'c'"):
            d.claimer.claim("c", ["x"], 1, None, True)
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops a dead process's locks
        holder.join(10)
        _, rows = d.get_experience("c", ["x"], 7)
        assert len(rows) == 7 and d.claimer.claims_made == 1 and d.all_consumed("c")
    finally:
        holder.kill()


def test_flock_costs_little_next_to_a_get():
    """Why flock: it is released when its holder dies (a semaphore would stay taken and wedge
    the consumer), and uncontended it costs a few microseconds, nothing next to a get."""
    import _multiprocessing
    fd = os.open(os.path.join(shm.SHM_DIR, f"msrl-test{os.getpid()}-lockcost"), os.O_CREAT | os.O_RDWR, 0o600)
    sem = _multiprocessing.SemLock(1, 1, 1, f"/msrl-test{os.getpid()}", True)
    try:
        def cost(acquire, release, n=2000):
            t = time.perf_counter()
            for _ in range(n):
                acquire()
                release()
            return (time.perf_counter() - t) / n
        f = min(cost(lambda: fcntl.flock(fd, fcntl.LOCK_EX), lambda: fcntl.flock(fd, fcntl.LOCK_UN)) for _ in range(3))
        s = min(cost(sem.acquire, sem.release) for _ in range(3))
        assert f < 50e-6, f"flock costs {f * 1e6:.1f} us"
        print(f"flock {f * 1e6:.2f} us, POSIX semaphore {s * 1e6:.2f} us per acquire + release")
    finally:
        os.close(fd)
        os.unlink(os.path.join(shm.SHM_DIR, f"msrl-test{os.getpid()}-lockcost"))


# ---------------------------------------------------------------------- through Ray
ray = pytest.importorskip("ray")


def produce(client, capacity: int, micro: int) -> None:
    for k in range(0, capacity, micro):
        rows = list(range(k, min(capacity, k + micro)))
        client.put_experience({"x": torch.stack([torch.full((64,), float(r)) for r in rows])}, rows, wait=False)
    client.flush()


@ray.remote(num_cpus=0.1)
class ClaimWorker:
    def __init__(self, client):
        self.client = client

    def consume(self, consumer: str, count: int):
        got, bad = [], []
        while True:
            out, rows = self.client.get_experience(consumer, ["x"], count, blocking=True, timeout=30, copy=False)
            if not rows:
                break
            bad += [r for r, v in zip(rows, out["x"]) if not torch.equal(v, torch.full((64,), float(r)))]
            got += rows
        cl = claims.client_for(self.client.claims_info)
        return got, bad, cl.claims_made if cl else 0


@pytest.mark.slow
def test_ray_consumer_processes_claim_rows_exactly_once(ray_session):
    from mindspeed_rl.transfer_dock import create_transfer_dock
    capacity = 256
    dock = create_transfer_dock(["x"], ["c", "e"], capacity, inline_bytes=0, data_plane="shm", default_timeout=60)
    workers = [ClaimWorker.remote(dock) for _ in range(4)]
    try:
        assert dock.claims_info is not None
        gets = [w.consume.remote(c, k) for w, (c, k) in zip(workers, [("c", 4), ("c", 3), ("c", 5), ("e", 8)])]
        produce(dock, capacity, 4)  # this process is the producer
        results = ray.get(gets, timeout=120)
        for consumer, part in (("c", results[:3]), ("e", results[3:])):
            rows = [r for got, _, _ in part for r in got]
            assert sorted(rows) == list(range(capacity)), f"{consumer}: lost or duplicated rows"
            assert all(bad == [] for _, bad, _ in part)
        assert sum(made for _, _, made in results) > 0, "no consumer process claimed locally"
        status = dock.get_consumer_status()
        assert status["c"]["all_consumed"] and status["e"]["all_consumed"]
        assert dock.get_metrics()["consumer/c/rows_taken"] == capacity
    finally:
        dock.close()
        for a in workers + [dock.actor]:
            ray_session.kill(a, no_restart=True)


@pytest.mark.slow
def test_a_local_get_sends_nothing_to_the_dock_and_a_dead_dock_is_not_claimed_from(ray_session):
    from mindspeed_rl.transfer_dock import channel, create_transfer_dock
    dock = create_transfer_dock(["x"], ["c"], 8, inline_bytes=0, data_plane="shm")
    try:
        dock.put_experience({"x": [x_row(r) for r in range(8)]}, list(range(8)))
        dock.get_experience("c", ["x"], 1)  # through the dock: its ready list
        conn = dock._connection()
        sent = []
        send = conn.send
        conn.send = lambda method, args: sent.append(method) or send(method, args)
        out, rows = dock.get_experience("c", ["x"], 2)
        assert sent == [], f"a local get called the dock: {sent}"
        assert [v.tolist() for v in out["x"]] == [x_row(r).tolist() for r in rows]
        assert dock.get_consumer_status()["c"]["taken"] == 3
        ray_session.kill(dock.actor, no_restart=True)
        with pytest.raises(channel.ChannelError, match="died or was killed"):
            for _ in range(50):  # the kill takes effect within a few calls; none may claim meanwhile
                before = claims.client_for(dock.claims_info).claims_made
                dock.get_experience("c", ["x"], 1)
                time.sleep(0.1)
        assert claims.client_for(dock.claims_info).claims_made == before
        assert claims.client_for(dock.claims_info).claim("c", ["x"], 1, None, True) is None, \
            "rows of a dead dock were claimed"
    finally:
        try:
            dock.close()
        except Exception:
            pass
