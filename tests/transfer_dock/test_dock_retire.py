"""Retiring rows and growing steps (`retire`, `set_extent`): dynamic sampling's dock.

Dynamic sampling (DAPO) drops the prompt groups whose rewards are all equal and draws more prompts
in their place. The dock's side: `retire(rows)` takes whole groups out of the step for every
consumer (never handed out, counted as consumed), and `set_extent(rows)` lets a step grow (a get's
tail is counted below the extent, a consumer that took every row below it waits for more). The
contract still holds: exactly once per consumer, bad input changes nothing, no hang.

`dynamic_step` plays a whole step as the trainer does: a reward stage scores rows, one filter (the
driver) keeps or drops each group, writes the gate column for kept groups, retires dropped ones
and draws replacements into new rows, and gated downstream consumers with several callers each
take what is kept. It runs on the plain dock here, on the shared-memory claims path
(`test_claims.py`'s `LocalDock`) and through the Ray actor (`test_dock_ray.py` runs it on every
data path).
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from mindspeed_rl.transfer_dock import (DockIndexError, DockTimeoutError, DockValueError, LengthBalancedSampler,
                                        TransferDock)

from .test_dock_contract import fingerprint


def row(r: int) -> np.ndarray:
    return np.full(1 + r % 3, r, dtype=np.int64)


def dock_of(prompts_num=4, n=2, consumers=("c1", "c2"), columns=("a", "b"), **kwargs) -> TransferDock:
    return TransferDock(list(columns), list(consumers), prompts_num, n, **kwargs)


def put(dock, rows, columns=("a",)):
    rows = list(rows)
    dock.put_experience({c: [row(r) for r in rows] for c in columns}, rows)


# ------------------------------------------------------------------------------ retire
def test_retired_groups_are_never_handed_out_and_count_as_consumed():
    d = dock_of(prompts_num=4, n=2)
    put(d, range(8))
    d.retire([2, 3, 6, 7])
    got = []
    while True:
        data, rows = d.get_experience("c1", ["a"], 3)
        if not rows:
            break
        assert [v.tolist() for v in data["a"]] == [row(r).tolist() for r in rows]
        got += rows
    assert sorted(got) == [0, 1, 4, 5] and d.all_consumed("c1")
    assert d.get_experience("c2", ["a"], 4, get_n_samples=True)[1] in ([0, 1, 4, 5], [4, 5, 0, 1])
    assert d.all_consumed("c2")
    s = d.get_consumer_status()
    assert s["c1"] == {"taken": 4, "retired": 4, "total": 8, "all_consumed": True}
    assert d.get_column_status() == {"a": {"written": 8, "total": 8}, "b": {"written": 0, "total": 4}}, \
        "a column's total leaves out the rows retired before it was written there"
    m = d.get_metrics()
    assert m["rows_retired"] == 4 and m["step_rows_retired"] == 4 and m["consumer/c1/step_rows_taken"] == 4


def test_rows_taken_before_the_retire_stay_taken_by_that_consumer():
    d = dock_of(prompts_num=2, n=2)
    put(d, range(4))
    _, early = d.get_experience("c1", ["a"], 4)  # the reward stage saw the group before it was dropped
    d.retire([0, 1])
    assert sorted(early) == [0, 1, 2, 3] and d.all_consumed("c1")
    assert d.get_consumer_status()["c1"] == {"taken": 4, "retired": 0, "total": 4, "all_consumed": True}
    assert d.get_experience("c2", ["a"], 4)[1] in ([2, 3], [3, 2])
    assert d.all_consumed("c2") and d.state_dict()["taken"] == {"c1": [0, 1, 2, 3], "c2": [2, 3]}


@pytest.mark.parametrize("bad, error, words", [
    ([9], DockIndexError, "out of range"),
    ([2], DockValueError, "part of prompt groups [1]"),
    ([0, 1, 2], DockValueError, "part of prompt groups [1]"),
    ([0, 0, 1], DockValueError, "duplicate"),
    ([4, 5], DockValueError, "already retired"),
    ({0, 1}, DockValueError, "a set has no order"),
    ([], DockValueError, "indexes is empty"),
    ("01", DockValueError, "pass a list of row ints"),
])
def test_bad_retires_are_refused_and_change_nothing(bad, error, words):
    d = dock_of(prompts_num=4, n=2)
    put(d, range(6))
    d.get_experience("c1", ["a"], 2)
    d.retire([4, 5])
    before = fingerprint(d)
    with pytest.raises(error) as e:
        d.retire(bad)
    assert words in str(e.value), str(e.value)
    assert fingerprint(d) == before


def test_by_index_gets_of_retired_rows_are_refused():
    d = dock_of(prompts_num=2, n=2)
    put(d, range(4))
    d.retire([2, 3])
    before = fingerprint(d)
    with pytest.raises(DockValueError, match=r"rows \[2\].*were retired"):
        d.get_experience("c1", ["a"], 0, indexes=[0, 2])
    assert fingerprint(d) == before
    assert d.get_experience("c1", ["a"], 0, indexes=[1, 0])[1] == [1, 0]


def test_a_blocked_get_wakes_when_the_rows_it_waits_for_are_retired():
    d = dock_of(prompts_num=3, n=2)
    put(d, range(4))
    d.get_experience("c1", ["a"], 2)
    out = {}
    t = threading.Thread(target=lambda: out.update(got=d.get_experience("c1", ["a"], 4, blocking=True, timeout=10)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive(), "2 rows ready, 4 asked, 2 unwritten: it waits"
    d.retire([4, 5])  # the unwritten group will never come: the two ready rows are the step's tail
    t.join(5)
    assert sorted(out["got"][1]) == [2, 3] and d.all_consumed("c1")


def test_held_back_rows_of_a_length_balanced_sampler_are_released_not_handed_out():
    d = dock_of(prompts_num=4, n=2, samplers={"c1": LengthBalancedSampler(dp_size=3)})
    put(d, range(8))
    _, first = d.get_experience("c1", ["a"], 2)  # cuts 6 rows, holds 4 back
    held = d._state["c1"].sampler.reserved_rows()
    assert len(held) == 4
    g = next(r // 2 for r in held if r // 2 not in {x // 2 for x in first})
    group = [2 * g, 2 * g + 1]
    d.retire(group)
    got = list(first)
    while True:
        _, rows = d.get_experience("c1", ["a"], 2)
        if not rows:
            break
        got += rows
    assert not set(got) & (set(group) - set(first)), "a retired row went out of the sampler's held rows"
    assert sorted(set(got) | set(group)) == list(range(8)) and len(got) == len(set(got)) and d.all_consumed("c1")


def test_ordered_gets_skip_retired_groups_and_keep_index_order():
    d = dock_of(prompts_num=4, n=2, guarantee_order=True)
    d.retire([2, 3])
    put(d, [0, 1, 4, 5, 6, 7])
    assert d.get_experience("c1", ["a"], 3)[1] == [0, 1, 4]
    assert d.get_experience("c1", ["a"], 3)[1] == [5, 6, 7]
    assert d.get_experience("c2", ["a"], 4, get_n_samples=True)[1] == [0, 1, 4, 5]


def test_clear_forgets_retired_rows_and_the_extent():
    d = dock_of(prompts_num=2, n=2)
    d.set_extent(2)
    put(d, range(2))
    d.retire([2, 3])
    d.clear()
    put(d, range(4))  # every row is in the step again
    assert sorted(d.get_experience("c1", ["a"], 4)[1]) == [0, 1, 2, 3]
    assert d.get_consumer_status()["c1"]["retired"] == 0


# ------------------------------------------------------------------------------ set_extent
def test_a_growing_step_hands_out_its_tail_below_the_extent_and_waits_above():
    d = dock_of(prompts_num=4, n=2)
    d.set_extent(4)
    put(d, range(4))
    assert len(d.get_experience("c1", ["a"], 3)[1]) == 3
    assert len(d.get_experience("c1", ["a"], 3)[1]) == 1, "1 row left below the extent: the tail"
    assert d.get_experience("c1", ["a"], 3) == ({}, []) and not d.all_consumed("c1"), "more may come: not done"
    with pytest.raises(DockTimeoutError, match="rows 0 .. 3 so far"):
        d.get_experience("c1", ["a"], 3, blocking=True, timeout=0.05)
    d.set_extent(6)
    put(d, [4, 5])
    assert sorted(d.get_experience("c1", ["a"], 3)[1]) == [4, 5]
    assert d.get_experience("c2", ["a"], 6, get_n_samples=True)[1] and not d.all_consumed("c2")
    d.retire([6, 7])  # the rows never drawn: the step ends
    assert d.all_consumed("c1") and d.get_experience("c1", ["a"], 3) == ({}, [])


def test_group_gets_wait_for_the_step_to_grow():
    d = dock_of(prompts_num=3, n=2)
    d.set_extent(2)
    put(d, range(2))
    assert d.get_experience("c2", ["a"], 4, get_n_samples=True)[1] == [0, 1]
    out = {}
    t = threading.Thread(target=lambda: out.update(got=d.get_experience("c2", ["a"], 4, get_n_samples=True,
                                                                          blocking=True, timeout=10)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive()
    d.set_extent(4)
    put(d, [2, 3])
    t.join(5)
    assert out["got"][1] == [2, 3]
    d.retire([4, 5])
    assert d.all_consumed("c2")


@pytest.mark.parametrize("rows, words", [(3, "multiple of"), (10, "in [0, 8]"), (-2, "in [0, 8]"),
                                         (True, "whole number"), (2, "already written")])
def test_bad_extents_are_refused_and_change_nothing(rows, words):
    d = dock_of(prompts_num=4, n=2)
    d.set_extent(6)
    put(d, range(4))
    before = fingerprint(d)
    with pytest.raises(DockValueError) as e:
        d.set_extent(rows)
    assert words in str(e.value), str(e.value)
    assert fingerprint(d) == before
    with pytest.raises(DockIndexError, match="beyond the step's extent"):
        put(d, [6, 7])
    assert fingerprint(d) == before


def test_state_dict_keeps_retired_rows_and_the_extent():
    d = dock_of(prompts_num=4, n=2)
    d.set_extent(6)
    put(d, range(6))
    d.get_experience("c1", ["a"], 0, indexes=[0, 2])
    d.retire([2, 3])
    state = d.state_dict()
    assert state["retired"] == [2, 3] and state["extent"] == 6 and state["taken"]["c1"] == [0, 2]
    e = dock_of(prompts_num=4, n=2)
    e.load_state_dict(state)
    assert fingerprint(e) == fingerprint(d)
    assert sorted(e.get_experience("c1", ["a"], 8)[1]) == [1, 4, 5]
    assert not e.all_consumed("c1") and e.get_experience("c1", ["a"], 8) == ({}, [])
    for key, value, words in (("retired", [2], "part of a prompt group"), ("retired", [9], "out of range"),
                              ("extent", 3, "multiple of")):
        f = dock_of(prompts_num=4, n=2)
        before = fingerprint(f)
        with pytest.raises((DockValueError, DockIndexError), match=words):
            f.load_state_dict({**state, key: value})
        assert fingerprint(f) == before


# ------------------------------------------------------------------------------ a whole dynamic step
COLUMNS = ["prompts", "score", "kept"]
DOWNSTREAM = {"ref": (2, 3, False), "adv": (1, 4, True), "train": (2, 4, False)}  # consumer: callers, count, groups
CONSUMERS = ["reward", "filter", *DOWNSTREAM]


def dropped(group: int, seed: int) -> bool:
    """Which groups the filter drops (all-equal rewards), a fixed function of the group."""
    return random.Random(group * 7919 + seed).random() < 0.4


def dynamic_step(dock, *, needed: int, max_groups: int, n: int, seed: int, timeout: float = 30.0,
                 jitter: float = 0.002) -> dict:
    """One dynamic-sampling step on `dock` (columns COLUMNS, consumers CONSUMERS, max_groups groups of
    n): returns every consumer's rows per caller, the groups kept, dropped and drawn."""
    rng = random.Random(seed)
    got: dict[str, list[list[int]]] = {c: [] for c in CONSUMERS}
    errors: list[BaseException] = []
    state = {"drawn": needed, "kept": [], "dropped": []}

    def nap():
        if jitter:
            time.sleep(rng.random() * jitter)

    def consume(consumer, columns, count, groups, work):
        mine: list[int] = []
        got[consumer].append(mine)
        try:
            while True:
                data, rows = dock.get_experience(consumer, columns, count, get_n_samples=groups, blocking=True,
                                                 timeout=timeout)
                if not rows:
                    return
                mine += rows
                nap()
                work(data, rows)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def score(data, rows):
        dock.put_experience({"score": [np.array([float(dropped(r // n, seed))]) for r in rows]}, rows)

    def decide(data, rows):
        for g in sorted({r // n for r in rows}):
            group = list(range(g * n, g * n + n))
            if dropped(g, seed):
                dock.retire(group)
                state["dropped"].append(g)
                if state["drawn"] < max_groups:  # draw a prompt in its place, into the next group
                    new = state["drawn"]
                    state["drawn"] += 1
                    dock.set_extent(state["drawn"] * n)
                    dock.put_experience({"prompts": [row(r) for r in range(new * n, new * n + n)]},
                                        list(range(new * n, new * n + n)))
            else:
                state["kept"].append(g)
                dock.put_experience({"kept": [np.ones(1)] * n}, group)
        if len(state["kept"]) + len(state["dropped"]) == state["drawn"] and state["drawn"] < max_groups:
            if len(state["kept"]) >= needed:  # enough: the rows never drawn leave the step
                dock.retire(list(range(state["drawn"] * n, max_groups * n)))

    dock.set_extent(needed * n)
    dock.put_experience({"prompts": [row(r) for r in range(needed * n)]}, list(range(needed * n)))
    threads = [threading.Thread(target=consume, args=("reward", ["prompts"], 3, False, score)),
               threading.Thread(target=consume, args=("filter", ["score"], n, True, decide))]
    for consumer, (callers, count, groups) in DOWNSTREAM.items():
        threads += [threading.Thread(target=consume, args=(consumer, ["prompts", "kept"], count * (n if groups else 1),
                                                           groups, lambda d, r: None)) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    return {"got": got, **state}


def check_dynamic_step(dock, out: dict, *, needed: int, max_groups: int, n: int) -> None:
    kept_rows = sorted(r for g in out["kept"] for r in range(g * n, g * n + n))
    dropped_rows = {r for g in out["dropped"] for r in range(g * n, g * n + n)}
    assert len(out["kept"]) == needed or out["drawn"] == max_groups, out
    assert len(out["kept"]) <= needed
    for consumer in DOWNSTREAM:
        rows = [r for caller in out["got"][consumer] for r in caller]
        assert sorted(rows) == kept_rows, f"{consumer}: every kept row exactly once"
        assert not set(rows) & dropped_rows, f"{consumer} took a dropped row"
    drawn_rows = list(range(out["drawn"] * n))
    for consumer in ("reward", "filter"):  # upstream of the filter: every drawn row once, the rest never
        assert sorted(r for caller in out["got"][consumer] for r in caller) == drawn_rows, consumer
    assert all(dock.all_consumed(c) for c in CONSUMERS)
    assert dock.get_metrics()["step_rows_retired"] == max_groups * n - len(kept_rows), "every other row is retired"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("order", [False, True], ids=["any-ready", "ordered"])
def test_dynamic_step_every_kept_row_once_to_every_consumer_and_no_dropped_row(seed, order):
    needed, max_groups, n = 6, 12, 2
    dock = TransferDock(COLUMNS, CONSUMERS, max_groups, n, guarantee_order=order, default_timeout=30.0)
    for step in range(2):  # and again after clear(): nothing of the first step's retirements remains
        out = dynamic_step(dock, needed=needed, max_groups=max_groups, n=n, seed=seed * 10 + step)
        check_dynamic_step(dock, out, needed=needed, max_groups=max_groups, n=n)
        dock.clear()


def test_dynamic_step_that_hits_the_cap_trains_on_what_it_has():
    n, needed, max_groups = 2, 6, 8
    seed = next(s for s in range(1000) if sum(dropped(g, s) for g in range(8)) >= 3)  # more drops than the cap allows
    dock = TransferDock(COLUMNS, CONSUMERS, max_groups, n, default_timeout=30.0)
    out = dynamic_step(dock, needed=needed, max_groups=max_groups, n=n, seed=seed)
    assert out["drawn"] == max_groups and len(out["kept"]) < needed
    check_dynamic_step(dock, out, needed=needed, max_groups=max_groups, n=n)


def test_dynamic_steps_with_order_hand_out_the_same_micro_batches_every_run():
    runs = []
    for jitter in (0.0, 0.003):
        dock = TransferDock(COLUMNS, ["reward", "filter", "ref", "adv", "train"], 12, 2, guarantee_order=True,
                            default_timeout=30.0)
        out = dynamic_step(dock, needed=6, max_groups=12, n=2, seed=3, jitter=jitter)
        runs.append((out["kept"], out["drawn"], out["got"]["adv"]))
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------ the other paths
def test_dynamic_step_with_local_claims_in_shared_memory():
    """The actor's `SharedDock` with its `ClaimBoard`: downstream gets are claimed in shared memory
    (no call to the dock) while the filter retires groups under every consumer's lock."""
    from mindspeed_rl.transfer_dock import shm
    if not shm.available():
        pytest.skip("needs a writable /dev/shm")
    from .test_claims import LocalDock
    d = LocalDock(COLUMNS, CONSUMERS, 12, 2, default_timeout=30.0)
    try:
        claimed = 0
        for step in range(3):
            out = dynamic_step(d, needed=6, max_groups=12, n=2, seed=100 + step)
            check_dynamic_step(d, out, needed=6, max_groups=12, n=2)
            claimed = d.claimer.claims_made
            d.clear()
        assert claimed > 0, "no get was claimed locally: the claims path was not exercised"
    finally:
        d.close()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("path", ["inline", "shm", "shm-ray-calls"])
def test_dynamic_step_through_the_ray_actor(ray_session, path):
    from mindspeed_rl.transfer_dock import create_transfer_dock
    from .test_dock_ray import PATHS
    dock = create_transfer_dock(COLUMNS, CONSUMERS, 12, 2, default_timeout=30.0, **PATHS[path])
    try:
        for step in range(2):
            out = dynamic_step(dock, needed=6, max_groups=12, n=2, seed=200 + step)
            check_dynamic_step(dock, out, needed=6, max_groups=12, n=2)
            dock.clear()
        before = dock.get_consumer_status()
        with pytest.raises(DockValueError, match="part of prompt groups"):
            dock.retire([1])
        with pytest.raises(DockIndexError, match="out of range"):
            dock.retire([24, 25])
        with pytest.raises(DockValueError, match="a set has no order"):
            dock.retire({0, 1})
        with pytest.raises(DockValueError, match="multiple of"):
            dock.set_extent(3)
        assert dock.get_consumer_status() == before
    finally:
        dock.close()
        ray_session.kill(dock.actor, no_restart=True)
