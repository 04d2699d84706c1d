"""The dock as a Ray actor, used through `create_transfer_dock` / `TransferDockClient`.

Four data paths: all data inline through the actor (`inline_bytes=1<<40`), all data through shared
memory (`inline_bytes=0, data_plane="shm"`), all data by Ray object reference (`inline_bytes=0,
data_plane="ray"`), and shared memory with every call a Ray actor call (`local_channel=False`; the
other three call over the local channel, as every caller on the dock's node does).

Which tests run on which paths (each path costs a dock actor, ~2 s on 2 cores):
- all four: the tests whose subject is moving data -- eight clients get every row exactly once, rows
  got are private to the caller, state dict and resume, clear frees the object store;
- inline, shm, by-ref (one per kind of cell the dock holds; shm-ray-calls holds shm's cells):
  metrics, whose byte counts are taken from the cells;
- shm and shm-ray-calls (the local channel and Ray actor calls, the two ways a call and its error
  travel): a blocked get does not stall others, the timeout error, bad input, a failed put raised by
  flush;
- inline and shm (a cell inline and one in shared memory): a bad state is refused by load_state_dict;
- shm only: a failed put is not raised by itself (it patches the local channel, which the Ray-call
  path does not have; the other local-channel paths send puts the same way).
Every test uses the shared `ray_session` and closes and kills the docks it starts.
"""
from __future__ import annotations

import pickle
import random
import threading
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from mindspeed_rl.transfer_dock import (DockError, DockIndexError, DockKeyError, DockTimeoutError,  # noqa: E402
                                        DockValueError, MissingDataError, OrderedSampler, TransferDockClient,
                                        create_transfer_dock)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PATHS = {"inline": {"inline_bytes": 1 << 40, "data_plane": "ray"},
         "shm": {"inline_bytes": 0, "data_plane": "shm"},
         "by-ref": {"inline_bytes": 0, "data_plane": "ray"},
         "shm-ray-calls": {"inline_bytes": 0, "data_plane": "shm", "local_channel": False}}


@pytest.fixture(params=list(PATHS))
def data_path(request):
    return PATHS[request.param]


def on_paths(*names):
    """Run a test on these data paths only (the module docstring says why for each test)."""
    assert set(names) <= set(PATHS), names
    return pytest.mark.parametrize("data_path", names, indirect=True)


LOCAL_AND_RAY_CALLS = on_paths("shm", "shm-ray-calls")


@pytest.fixture
def actors(ray_session):
    """Collects actor handles (or clients); kills them all when the test ends."""
    started: list = []
    yield started
    for a in started:
        if isinstance(a, TransferDockClient):
            try:
                a.close()
            except Exception:  # a test may have killed it already
                pass
        ray_session.kill(a.actor if isinstance(a, TransferDockClient) else a, no_restart=True)


@pytest.fixture
def make_dock(ray_session, actors, data_path):
    def make(columns, consumers, prompts_num, n=1, **kwargs):
        client = create_transfer_dock(columns, consumers, prompts_num, n, **{**data_path, **kwargs})
        actors.append(client)
        return client
    return make


# ---------------------------------------------------------------------- row contents
def prompt_row(r: int) -> torch.Tensor:
    """Row r of 'prompts': variable length, says which row it is."""
    return torch.arange(r % 5 + 1, dtype=torch.int64) + 1000 * r


def response_row(r: int) -> torch.Tensor:
    return torch.full((r % 3 + 2,), r + 0.5, dtype=torch.float32)


def check_rows(out: dict, rows: list[int]) -> list[int]:
    """Rows whose cells are not what `prompt_row` / `response_row` put; [] if all are right."""
    bad = []
    makers = {"prompts": prompt_row, "responses": response_row}
    for column, values in out.items():
        assert len(values) == len(rows), f"column {column}: {len(values)} values for {len(rows)} rows"
        for r, v in zip(rows, values):
            expected = makers[column](r)
            if not (isinstance(v, torch.Tensor) and v.dtype == expected.dtype and torch.equal(v, expected)):
                bad.append(r)
    return bad

def refusal_problems(dock, calls: dict) -> list[str]:
    """Run each `name -> (call, error, text)`: every call must raise exactly `error`, with `text` in
    its message, and leave the dock's snapshot as it was. Returns what went wrong ([] if nothing)."""
    problems, before = [], snapshot(dock)
    for name, (call, error, text) in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001 -- sorted out below
            if type(e) is not error:
                problems.append(f"{name}: raised {type(e).__name__} ({e}), expected {error.__name__}")
            elif text not in str(e):
                problems.append(f"{name}: message {str(e)!r} does not mention {text!r}")
        else:
            problems.append(f"{name}: raised nothing")
        if snapshot(dock) != before:
            problems.append(f"{name}: changed the dock")
            before = snapshot(dock)
    return problems



@ray.remote(num_cpus=0.1)
class DockWorker:
    """One data-parallel rank of a stage, in its own process."""

    def __init__(self, client=None):
        self.client = client

    def attach(self, client) -> None:
        """Work against another dock (the pool below reuses these processes across data paths)."""
        self.client = client

    def produce(self, rows: list[int], micro: int, seed: int, wait: bool = True) -> int:
        rng = random.Random(seed)
        rows = list(rows)
        rng.shuffle(rows)
        batches = [rows[i:i + micro] for i in range(0, len(rows), micro)]
        # Each micro-batch's two columns arrive as separate puts, in random order.
        puts = [(c, b) for b in batches for c in ("prompts", "responses")]
        rng.shuffle(puts)
        makers = {"prompts": prompt_row, "responses": response_row}
        for column, batch in puts:
            self.client.put_experience({column: [makers[column](r) for r in batch]}, batch,
                                       producer=f"producer_{seed}", wait=wait)
            time.sleep(rng.random() * 0.01)
        self.client.flush()
        return len(puts)

    def consume(self, consumer: str, columns: list[str], count: int, timeout: float):
        """Blocking gets until the dock says this consumer has every row; returns
        (rows in the order received, rows whose data was wrong, sizes of the gets)."""
        got, bad, sizes = [], [], []
        while True:
            out, rows = self.client.get_experience(consumer, columns, count, blocking=True, timeout=timeout)
            if not rows:
                assert out == {}
                assert self.client.all_consumed(consumer)
                return got, bad, sizes
            assert sorted(out) == sorted(columns)
            bad += check_rows(out, rows)
            got += rows
            sizes.append(len(rows))


# ---------------------------------------------------------------------- many clients at once
@pytest.fixture(scope="module")
def worker_pool(ray_session):
    """10 worker processes for the module, each attached to a test's dock in turn: starting 10 actors
    per data path was a minute of the suite on 2 cores."""
    pool = [DockWorker.remote() for _ in range(10)]
    yield pool
    for w in pool:
        ray_session.kill(w, no_restart=True)


def test_eight_clients_of_one_consumer_get_every_row_exactly_once(ray_session, make_dock, worker_pool):
    prompts_num, n = 30, 4  # 120 rows
    dock = make_dock(["prompts", "responses"], ["train"], prompts_num, n, default_timeout=30.0)
    capacity = prompts_num * n
    ray.get([w.attach.remote(dock) for w in worker_pool], timeout=60)
    consumers, producers = worker_pool[:8], worker_pool[8:]

    count = 4
    gets = [w.consume.remote("train", ["prompts", "responses"], count, 20.0) for w in consumers]
    rows = list(range(capacity))
    random.Random(0).shuffle(rows)
    # Disjoint halves; one producer waits for each put's answer, the other pipelines them.
    puts = [producers[0].produce.remote(rows[: capacity // 2], 3, 1, True),
            producers[1].produce.remote(rows[capacity // 2:], 5, 2, False)]
    assert sum(ray.get(puts, timeout=60)) > 0
    results = ray.get(gets, timeout=60)

    delivered = [r for got, _, _ in results for r in got]
    assert sorted(delivered) == list(range(capacity)), \
        f"missing {sorted(set(range(capacity)) - set(delivered))}, duplicated " \
        f"{sorted(r for r in set(delivered) if delivered.count(r) > 1)}"
    assert [bad for _, bad, _ in results] == [[]] * 8, "some rows came with the wrong data"
    # capacity is a multiple of count: every get handed out exactly `count` rows.
    assert {s for _, _, sizes in results for s in sizes} == {count}
    assert dock.all_consumed("train")
    assert dock.get_consumer_status()["train"] == {"taken": capacity, "retired": 0, "total": capacity, "all_consumed": True}


# ---------------------------------------------------------------------- blocking
def wait_until(condition, timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout} s")
        time.sleep(0.01)


@LOCAL_AND_RAY_CALLS
def test_a_blocked_get_does_not_stall_other_callers(make_dock):
    # The waiter takes rows in index order (OrderedSampler): each attempt of its get at the dock looks
    # at its next row and counts it in the dock's rows_examined, which nothing else moves before the
    # other consumer's calls. Once it moves, the waiter's get has reached the dock, found nothing and
    # waits there (its gets never take the local-claims path, which serves AnyReadySampler only).
    dock = make_dock(["prompts", "responses"], ["waiter", "other"], 8, samplers={"waiter": OrderedSampler()})
    result: dict = {}

    def wait_for_responses():
        t0 = time.monotonic()
        try:
            result["got"] = dock.get_experience("waiter", ["responses"], 2, blocking=True, timeout=10.0)
        except BaseException as e:  # reported below
            result["error"] = e
        result["waited"] = time.monotonic() - t0

    blocked = threading.Thread(target=wait_for_responses)
    assert dock.get_metrics()["rows_examined"] == 0
    blocked.start()
    wait_until(lambda: dock.get_metrics()["rows_examined"] >= 1 or not blocked.is_alive(), 30.0,
               "the waiter's blocking get reaching the dock")
    assert blocked.is_alive(), f"the get on an unwritten column returned early: {result}"

    # Meanwhile another consumer's puts and gets go through.
    t0 = time.monotonic()
    for start in range(0, 8, 2):
        batch = [start, start + 1]
        dock.put_experience({"prompts": [prompt_row(r) for r in batch]}, batch)
        out, rows = dock.get_experience("other", ["prompts"], 2, blocking=True, timeout=5.0)
        assert check_rows(out, rows) == [] and len(rows) == 2
    assert dock.all_consumed("other")
    assert time.monotonic() - t0 < 5.0, "calls of another consumer waited behind the blocked get"
    assert blocked.is_alive(), f"the get on an unwritten column returned early: {result}"

    dock.put_experience({"responses": [response_row(r) for r in (0, 1)]}, [0, 1])  # the waiter's next rows
    blocked.join(timeout=10.0)
    assert not blocked.is_alive()
    assert "error" not in result, result.get("error")
    out, rows = result["got"]
    assert sorted(rows) == [0, 1] and check_rows(out, rows) == []
    assert result["waited"] < 9.0, "the blocked get was not woken by the put"


@LOCAL_AND_RAY_CALLS
def test_blocking_get_timeout_raises_dock_timeout_error_in_the_caller(make_dock):
    dock = make_dock(["prompts", "responses"], ["x"], 4, 2)
    dock.put_experience({"prompts": [prompt_row(r) for r in range(8)]}, list(range(8)))
    t0 = time.monotonic()
    with pytest.raises(DockTimeoutError) as info:
        dock.get_experience("x", ["prompts", "responses"], 4, blocking=True, timeout=0.5)
    assert 0.4 < time.monotonic() - t0 < 10.0
    err = info.value
    assert type(err) is DockTimeoutError, f"got {type(err).__mro__}"  # the dock's error, not Ray's wrapper
    assert isinstance(err, TimeoutError) and isinstance(err, DockError)
    message = str(err)
    assert "consumer 'x'" in message and "timed out" in message
    assert "'prompts' written 8/8" in message and "'responses' written 0/8" in message
    assert "'responses' missing at rows" in message
    with pytest.raises(DockTimeoutError, match=r"rows \[1, 3\]"):  # by index: names the rows it waited for
        dock.get_experience("x", ["responses"], 2, indexes=[1, 3], blocking=True, timeout=0.3)
    # The dock is still usable, and the timed-out gets took nothing.
    assert dock.get_consumer_status()["x"]["taken"] == 0
    out, rows = dock.get_experience("x", ["prompts"], 4)
    assert len(rows) == 4 and check_rows(out, rows) == []


@pytest.mark.parametrize("copy_kwargs", [{}, {"copy": True}], ids=["default", "copy=True"])
def test_rows_got_are_private_to_the_caller(make_dock, copy_kwargs):
    dock = make_dock(["responses"], ["x", "y"], 4)
    dock.put_experience({"responses": torch.stack([torch.full((64,), float(r)) for r in range(4)])}, list(range(4)))
    out, rows = dock.get_experience("x", ["responses"], 4, **copy_kwargs)
    for v in out["responses"]:
        v.mul_(-1.0)  # a consumer normalizing in place
    out_y, rows_y = dock.get_experience("y", ["responses"], 4, copy=True)
    for r, v in zip(rows_y, out_y["responses"]):
        assert torch.equal(v, torch.full((64,), float(r))), f"row {r} changed by another consumer's write: {v[:3]}"
    assert sorted(rows) == sorted(rows_y) == [0, 1, 2, 3]


# ---------------------------------------------------------------------- bad input
def snapshot(dock):
    sd = dock.state_dict()
    cells = {c: {r: (str(v.dtype), v.tolist()) for r, v in cs.items()} for c, cs in sd["cells"].items()}
    return {**sd, "cells": cells}, dock.get_column_status(), dock.get_consumer_status()


BAD_CALLS = {
    "put_unknown_column": (lambda d: d.put_experience({"nope": [prompt_row(0)]}, [0]), DockKeyError, "nope"),
    "put_duplicate_index": (lambda d: d.put_experience({"prompts": [prompt_row(4), prompt_row(4)]}, [4, 4]),
                            DockValueError, "duplicate"),
    "put_index_out_of_range": (lambda d: d.put_experience({"prompts": [prompt_row(0)]}, [99]), DockIndexError, "99"),
    "put_cell_written_twice": (lambda d: d.put_experience(
        {"prompts": [prompt_row(1), prompt_row(5)], "responses": [response_row(1), response_row(5)]}, [1, 5]),
        DockValueError, "already written"),
    "put_wrong_length": (lambda d: d.put_experience({"prompts": [prompt_row(4)]}, [4, 5]), DockValueError, "1 values"),
    "put_2d_row": (lambda d: d.put_experience({"prompts": [torch.zeros(2, 2)]}, [4]), DockValueError, "1-D"),
    "get_unknown_column": (lambda d: d.get_experience("x", ["nope"], 1), DockKeyError, "nope"),
    "get_unknown_consumer": (lambda d: d.get_experience("ghost", ["prompts"], 1), DockKeyError, "ghost"),
    "get_missing_by_index": (lambda d: d.get_experience("x", ["responses"], 1, indexes=[6]), MissingDataError,
                             "unwritten"),
    "get_bad_group_count": (lambda d: d.get_experience("x", ["prompts"], 3, get_n_samples=True), DockValueError,
                            "multiple"),
    # y took row 3 by index (and two more by a sampled get): asking for it again takes nothing
    "get_index_already_taken": (lambda d: d.get_experience("y", ["prompts"], 2, indexes=[2, 3]), DockValueError,
                                "consumer 'y' already took rows [3]"),
    "get_index_already_taken_blocking": (lambda d: d.get_experience("y", ["prompts"], 1, indexes=[3], blocking=True,
                                                                    timeout=20.0), DockValueError, "already took"),
    # the client must refuse the caller's own object, not the list it would make of it
    "put_set_indexes": (lambda d: d.put_experience({"prompts": [prompt_row(4), prompt_row(5)]}, {4, 5}),
                        DockValueError, "set [4, 5]"),
    "put_object_array_indexes": (lambda d: d.put_experience({"prompts": [prompt_row(4), prompt_row(5)]},
                                                            np.array([4, 5], dtype=object)), DockValueError,
                                 "dtype object"),
    "get_set_indexes": (lambda d: d.get_experience("x", ["prompts"], 2, indexes={0, 1}), DockValueError, "set [0, 1]"),
    "get_object_array_indexes": (lambda d: d.get_experience("x", ["prompts"], 2, indexes=np.array([0, 1], dtype=object)),
                                 DockValueError, "dtype object"),
}


@LOCAL_AND_RAY_CALLS
def test_bad_input_raises_the_dock_error_in_the_caller_and_changes_nothing(make_dock):
    # One dock for all the cases (a dock actor costs ~2 s to start): each case must leave it as it was.
    dock = make_dock(["prompts", "responses"], ["x", "y"], 4, 2)
    dock.put_experience({"prompts": [prompt_row(r) for r in range(4)]}, list(range(4)))
    dock.put_experience({"responses": [response_row(r) for r in (0, 1)]}, [0, 1])
    dock.get_experience("y", ["prompts"], 1, indexes=[3])
    dock.get_experience("y", ["prompts"], 2)

    problems = refusal_problems(dock, {name: (lambda fn=fn: fn(dock), error, text)
                                       for name, (fn, error, text) in BAD_CALLS.items()})
    assert not problems, "\n".join(problems)

    dock.put_experience({"responses": [response_row(5)]}, [5])  # the dock still works
    assert dock.get_column_status()["responses"]["written"] == 3
    out, rows = dock.get_experience("x", ["prompts"], 4)
    assert sorted(rows) == [0, 1, 2, 3] and check_rows(out, rows) == []


@LOCAL_AND_RAY_CALLS
def test_a_failed_put_without_waiting_is_raised_by_flush(make_dock):
    dock = make_dock(["prompts", "responses"], ["x"], 4)
    dock.put_experience({"prompts": [prompt_row(0)]}, [0])
    before = snapshot(dock)
    dock.put_experience({"prompts": [prompt_row(0)]}, [0], wait=False)  # written twice
    with pytest.raises(DockValueError, match="already written"):
        dock.flush()
    assert snapshot(dock) == before
    dock.put_experience({"prompts": [prompt_row(1)]}, [1], wait=False)
    dock.flush()
    assert dock.get_column_status()["prompts"]["written"] == 2


@on_paths("shm")
def test_a_failed_put_is_not_raised_by_itself_however_fast_the_dock_answers(make_dock):
    """The documented rule: a `wait=False` put's error comes from a later call or `flush()`. The
    dock answering before `put_experience` returns (its connection threads can) must not change
    that: here every send waits until the answer is in the socket."""
    import select
    dock = make_dock(["prompts", "responses"], ["x"], 4)
    conn = dock._connection()
    assert conn is not None, "the shm path calls the dock over the local channel"
    send = conn.send

    def send_then_wait_for_the_answer(method, args):
        rid = send(method, args)
        assert select.select([conn._sock], [], [], 10)[0], "the dock did not answer in 10 s"
        return rid

    conn.send = send_then_wait_for_the_answer
    dock.put_experience({"prompts": [prompt_row(0)]}, [0])
    dock.put_experience({"prompts": [prompt_row(0)]}, [0], wait=False)  # written twice: returns all the same
    with pytest.raises(DockValueError, match="already written"):
        dock.flush()
    assert dock.get_column_status()["prompts"]["written"] == 1


# ---------------------------------------------------------------------- checkpoints
def test_state_dict_has_real_tensors_and_a_fresh_dock_resumes_mid_step(make_dock, actors):
    columns, consumers = ["prompts", "responses"], ["x", "y"]
    dock = make_dock(columns, consumers, 4, 2)
    dock.put_experience({"prompts": [prompt_row(r) for r in range(5)]}, list(range(5)))
    dock.put_experience({"prompts": [prompt_row(r) for r in (7, 5, 6)]}, [7, 5, 6])
    dock.put_experience({"responses": [response_row(r) for r in (0, 1, 2, 3, 6, 7)]}, [0, 1, 2, 3, 6, 7])
    x_before = dock.get_experience("x", columns, 3)[1]
    y_before = dock.get_experience("y", ["prompts"], 2, get_n_samples=True)[1]
    y_before += dock.get_experience("y", ["prompts"], 4, get_n_samples=True)[1]

    state = dock.state_dict()
    for column, maker in (("prompts", prompt_row), ("responses", response_row)):
        for r, v in state["cells"][column].items():
            assert isinstance(v, torch.Tensor), f"{column}[{r}] is a {type(v).__name__}, not a tensor"
            assert v.dtype == maker(r).dtype and torch.equal(v, maker(r)), f"{column}[{r}]"
    assert sorted(state["cells"]["prompts"]) == list(range(8))
    assert sorted(state["cells"]["responses"]) == [0, 1, 2, 3, 6, 7]
    assert sorted(state["taken"]["x"]) == sorted(x_before) and sorted(state["taken"]["y"]) == sorted(y_before)
    state = pickle.loads(pickle.dumps(state))  # as a checkpoint file would

    for a in actors:  # the old dock is gone
        ray.kill(a.actor, no_restart=True)
    actors.clear()
    fresh = make_dock(columns, consumers, 4, 2)
    fresh.load_state_dict(state)
    assert fresh.get_column_status() == {"prompts": {"written": 8, "total": 8},
                                         "responses": {"written": 6, "total": 8}}
    assert fresh.get_consumer_status()["x"]["taken"] == 3 and fresh.get_consumer_status()["y"]["taken"] == 6

    with pytest.raises(DockValueError, match="torch.float32 rows"):  # the restored column keeps its dtype
        fresh.put_experience({"responses": [torch.zeros(2, dtype=torch.float64)]}, [4])
    fresh.put_experience({"responses": [response_row(r) for r in (4, 5)]}, [4, 5])
    for consumer, before, cols in (("x", x_before, columns), ("y", y_before, ["prompts"])):
        after = []
        while True:
            out, rows = fresh.get_experience(consumer, cols, 2)
            if not rows:
                break
            assert check_rows(out, rows) == []
            after += rows
        assert sorted(before + after) == list(range(8)), f"{consumer}: before {before}, after {after}"
        assert fresh.all_consumed(consumer)


def _set(mapping: dict, key, value) -> None:
    mapping[key] = value


# (spoil(state), error, words): one bad row or name in a good state; 'responses' comes after
# 'prompts', so a load that restored column by column would have replaced 'prompts' already.
BAD_STATES = {
    "cell_row_out_of_range": (lambda s: _set(s["cells"]["responses"], 99, response_row(1)), DockIndexError, "[99]"),
    "cell_of_another_dtype": (lambda s: _set(s["cells"]["responses"], 5, torch.zeros(3, dtype=torch.float64)),
                              DockValueError, "torch.float64"),
    "cell_2d": (lambda s: _set(s["cells"]["responses"], 5, torch.zeros(2, 2)), DockValueError, "1-D"),
    "taken_by_unknown_consumer": (lambda s: _set(s["taken"], "ghost", [0]), DockKeyError, "ghost"),
    "taken_row_out_of_range": (lambda s: _set(s["taken"], "y", [1, 8]), DockIndexError, "[8]"),
}


@on_paths("inline", "shm")
def test_load_state_dict_rejects_a_bad_state_and_changes_nothing(make_dock):
    dock = make_dock(["prompts", "responses"], ["x", "y"], 4, 2)
    dock.put_experience({"prompts": [prompt_row(r) for r in range(4)]}, list(range(4)))
    dock.put_experience({"responses": [response_row(r) for r in (0, 1)]}, [0, 1])
    dock.get_experience("y", ["prompts"], 2)
    good = dock.state_dict()
    good["cells"]["prompts"] = {r: prompt_row(r) for r in range(8)}  # unlike the dock's state
    good["taken"] = {"x": [4, 5], "y": []}

    def load_spoiled(spoil):
        state = pickle.loads(pickle.dumps(good))  # a fresh copy to spoil
        spoil(state)
        dock.load_state_dict(state)

    problems = refusal_problems(dock, {name: (lambda spoil=spoil: load_spoiled(spoil), error, text)
                                       for name, (spoil, error, text) in BAD_STATES.items()})
    assert not problems, "\n".join(problems)

    dock.load_state_dict(good)  # the good state still loads, cell by cell
    assert snapshot(dock)[0] == snapshot_of(good)


def snapshot_of(state: dict) -> dict:
    return {**state, "cells": {c: {r: (str(v.dtype), v.tolist()) for r, v in cs.items()}
                               for c, cs in state["cells"].items()}}


# ---------------------------------------------------------------------- memory
def store_free(ray_session) -> float:
    return ray_session.available_resources().get("object_store_memory", 0.0)


def wait_for_store_free(ray_session, at_least: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    free = store_free(ray_session)
    while free < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        free = store_free(ray_session)
    return free


def test_clear_frees_the_object_store(ray_session, make_dock):
    rows_per_step, row_len = 8, 128 * 1024  # 8 rows x 128 Ki float32 = 4 MiB per step
    dock = make_dock(["responses"], ["x"], rows_per_step)
    assert store_free(ray_session) > 0, "ray.available_resources() reports no object_store_memory"

    def one_step(step):
        dock.put_experience({"responses": torch.full((rows_per_step, row_len), float(step))},
                            list(range(rows_per_step)))
        out, rows = dock.get_experience("x", ["responses"], rows_per_step)
        assert len(rows) == rows_per_step and float(out["responses"][0][0]) == float(step)
        del out
        dock.clear()

    one_step(0)
    baseline = wait_for_store_free(ray_session, float("inf"), timeout=1.0)
    steps = 40  # 160 MiB in all: it would show if cleared steps stayed in the store
    for step in range(1, steps + 1):
        one_step(step)
    slack = 12 * 2**20
    free = wait_for_store_free(ray_session, baseline - slack)
    assert free >= baseline - slack, \
        f"object store: {(baseline - free) / 2**20:.0f} MiB more in use after {steps} cleared steps of 4 MiB"


# ---------------------------------------------------------------------- observability
@on_paths("inline", "shm", "by-ref")
def test_metrics_and_event_log_through_the_client(make_dock):
    dock = make_dock(["prompts", "responses"], ["x"], 4)
    dock.put_experience({"prompts": [prompt_row(r) for r in range(4)]}, list(range(4)), producer="rollout")
    out, rows = dock.get_experience("x", ["prompts"], 3)
    assert dock.get_experience("x", ["responses"], 1) == ({}, [])
    metrics = dock.get_metrics()
    assert metrics["puts"] == 1
    assert metrics["consumer/x/rows_taken"] == 3 and metrics["consumer/x/calls"] == 2
    assert metrics["consumer/x/empty_calls"] == 1
    assert metrics["column/prompts/rows_written"] == 4 and metrics["column/prompts/step_rows_written"] == 4
    assert metrics["consumer/x/step_rows_taken"] == 3 and metrics["step"] == 0
    assert metrics["bytes_in"] == sum(prompt_row(r).numel() * 8 for r in range(4))
    assert metrics["bytes_out"] == sum(prompt_row(r).numel() * 8 for r in rows)

    log = dock.get_event_log()
    assert [(e["op"], e["stage"], e["rows"]) for e in log] == [("put", "rollout", 4), ("get", "x", 3)]
    assert all(e["step"] == 0 and e["t_end"] >= e["t_start"] for e in log)
    dock.clear()
    dock.put_experience({"responses": [response_row(0)]}, [0])
    newer = dock.get_event_log(since=log[-1]["seq"])
    assert [(e["op"], e["step"]) for e in newer] == [("put", 1)]
    assert dock.get_metrics()["step"] == 1
