"""The cost model's ideal step times, the simulated compute, and the stage loop's prefetch.

No Ray here: an in-process dock (`TransferDock`, thread-safe) stands in for the client; its
`get_experience_async` runs the get on a thread, as the Ray client's get runs in the dock actor.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mindspeed_rl.dataflow import MFCDef, algorithm_graph, topological_order
from mindspeed_rl.transfer_dock import TransferDock
from mindspeed_rl.transfer_dock.errors import DockTimeoutError
from mindspeed_rl.engines.simulate import PLACEHOLDER, ideal_pipeline, simulated_compute
from mindspeed_rl.workers.stage import StageError, run_stage_loop


class LocalDock(TransferDock):
    """The plain dock with the client's extras: `wait`/`copy` arguments, `flush`, `latency_s` added
    to every get (a round trip to the dock actor), and `get_experience_async` (here a get on a
    thread; the Ray client's answer waits in Ray instead)."""

    def __init__(self, *args, latency_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.latency_s = latency_s
        self.gets = 0
        self._pool = ThreadPoolExecutor(max_workers=2)

    def put_experience(self, data, indexes, *, wait: bool = True, **kwargs):
        return super().put_experience(data, indexes, **kwargs)

    def get_experience(self, consumer, columns, count, *args, copy: bool = True, **kwargs):
        self.gets += 1
        time.sleep(self.latency_s)
        return super().get_experience(consumer, columns, count, *args, **kwargs)

    def get_experience_async(self, *args, **kwargs):
        return self._pool.submit(self.get_experience, *args, **kwargs)  # a Future: .result() as PendingGet

    def flush(self) -> None:
        pass


def _mfc(name, inputs, outputs, kind="compute", fn="rule_reward") -> MFCDef:
    return MFCDef(name, "m", kind, inputs, outputs, fn=fn if kind == "compute" else None)


# ------------------------------------------------------------------------------------------- the ideal
def test_ideal_of_a_two_stage_chain():
    a, b = _mfc("a", ("x",), ("y",)), _mfc("b", ("y",), ("z",))
    ideal = ideal_pipeline([a, b], {"a": 1.0, "b": 1.0}, {"a": 1, "b": 1}, rows=4)
    assert ideal.blocking_s == 8.0
    assert ideal.overlapped_s == 5.0  # the slowest stage plus one micro-batch of the other
    assert ideal.finish_s == {"a": 4.0, "b": 5.0}


def test_ideal_waits_for_the_slower_upstream_and_for_whole_micro_batches():
    a, b = _mfc("a", ("x",), ("y",)), _mfc("b", ("y",), ("z",))
    # b takes 4 rows at a time: its first micro-batch waits for a's 4th row
    ideal = ideal_pipeline([a, b], {"a": 1.0, "b": 0.5}, {"a": 1, "b": 4}, rows=8)
    assert ideal.finish_s["b"] == 8.0 + 4 * 0.5
    c = _mfc("c", ("x",), ("w",))
    d = _mfc("d", ("y", "w"), ("v",))
    ideal = ideal_pipeline([a, c, d], {"a": 1.0, "c": 2.0, "d": 0.0}, {"a": 2, "c": 2, "d": 2}, rows=4)
    assert ideal.finish_s["d"] == ideal.finish_s["c"] == 8.0


def test_ideal_servers_split_a_stage():
    a = _mfc("a", ("x",), ("y",))
    ideal = ideal_pipeline([a], {"a": 1.0}, {"a": 2}, rows=8, servers={"a": 2})
    assert ideal.overlapped_s == ideal.blocking_s == 4.0 and ideal.busy_s["a"] == 4.0


def test_ideal_of_grpo_is_rollout_plus_one_micro_batch_of_the_rest():
    order = topological_order(algorithm_graph("grpo"))
    costs = {"actor_rollout": 0.006, "rule_reward": 0.00015, "ref_log_prob": 0.0003, "actor_log_prob": 0.0003,
             "compute_advantage": 0.00005, "actor_train": 0.0007}
    m = 16
    ideal = ideal_pipeline(order, costs, {s.name: m for s in order}, rows=256)
    assert ideal.blocking_s == pytest.approx(256 * sum(costs.values()))
    assert ideal.overlapped_s == pytest.approx(256 * 0.006 + m * (0.0003 + 0.0007))


# ------------------------------------------------------------------------------------ simulated compute
def test_simulated_compute_sleeps_per_row_and_pushes_placeholders():
    mfc = _mfc("a", ("x",), ("y", "z"))
    f = simulated_compute(mfc, 0.01, {"micro_batches": 1.0})
    t = time.perf_counter()
    out = f({"x": [torch.zeros(3)] * 4}, [0, 1, 2, 3])
    assert time.perf_counter() - t >= 0.04
    assert set(out.columns) == {"y", "z"} and all(len(v) == 4 and v[0] is PLACEHOLDER for v in out.columns.values())
    assert out.metrics == {"micro_batches": 1.0}


# ---------------------------------------------------------------------------------- stage loop prefetch
def _loop(dock, stage="a", inputs=("x",), outputs=("y",), count=2, cost=0.0, **kwargs):
    return run_stage_loop(dock, stage=stage, rank=0, step=0, input_keys=inputs, count=count, get_n_samples=False,
                          timeout_s=kwargs.pop("timeout_s", 5), compute=simulated_compute(_mfc(stage, inputs, outputs),
                                                                                         cost), **kwargs)


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_row_once(prefetch):
    """Producer a (x -> y) and consumer b (y -> z) as two stages in two threads."""
    dock = LocalDock(["x", "y", "z"], ["a", "b"], 10, guarantee_order=True)
    dock.put_experience({"x": [torch.tensor([float(r)]) for r in range(10)]}, list(range(10)))
    reps, errors = {}, []

    def run(name, inputs, outputs):
        try:
            reps[name] = _loop(dock, name, inputs, outputs, count=3, prefetch=prefetch)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=("a", ("x",), ("y",))),
               threading.Thread(target=run, args=("b", ("y",), ("z",)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in reps.values():
        assert r.rows == 10 and r.micro_batches == 4 and len(r.mb_get_s) == len(r.mb_put_s) == 4
    assert dock.get_column_status()["z"]["written"] == 10
    assert all(dock.all_consumed(c) for c in ("a", "b"))


def test_prefetch_stops_at_max_rows():
    dock = LocalDock(["x", "y"], ["a"], 10)
    dock.put_experience({"x": [torch.zeros(1)] * 10}, list(range(10)))
    rep = _loop(dock, count=4, max_rows=6)
    assert rep.rows == 6 and rep.micro_batches == 2 and dock.get_consumer_status()["a"]["taken"] == 6
    assert dock.gets == 2  # no get was sent beyond this rank's share
    rep = _loop(dock, count=4, max_rows=10, report=rep)  # the train step's next mini-batch goes on from there
    assert rep.rows == 10 and dock.gets == 3


def test_a_prefetched_get_that_timed_out_is_sent_again():
    class TimeoutOnce(LocalDock):
        failed = False

        def get_experience_async(self, *args, **kwargs):
            if not self.failed:  # the prefetch of the second micro-batch times out while the loop computes
                self.failed = True
                return self._pool.submit(_raise, DockTimeoutError("waited while the loop computed"))
            return super().get_experience_async(*args, **kwargs)

    dock = TimeoutOnce(["x", "y"], ["a"], 8)
    dock.put_experience({"x": [torch.zeros(1)] * 8}, list(range(8)))
    rep = _loop(dock, cost=0.01)
    assert dock.failed and rep.rows == 8 and rep.micro_batches == 4


def _raise(e: Exception):
    raise e


@pytest.mark.parametrize("prefetch", [False, True])
def test_missing_inputs_still_time_out_naming_the_stage(prefetch):
    dock = LocalDock(["x", "y"], ["a"], 4)
    dock.put_experience({"x": [torch.zeros(1)] * 2}, [0, 1])  # rows 2, 3 never come
    t = time.perf_counter()
    with pytest.raises(StageError, match=r"stage 'a' \(rank 0, step 0\) timed out .* inputs \['x'\]"):
        _loop(dock, timeout_s=0.3, prefetch=prefetch)
    assert time.perf_counter() - t < 5


def test_prefetch_hides_the_get_round_trip_behind_the_compute():
    """Sanity, not a benchmark: with a 30 ms get and 30 ms of compute per micro-batch, the loop
    waits for gets much less when the next one is fetched while it computes."""
    waited = {}
    for prefetch in (False, True):
        dock = LocalDock(["x", "y"], ["a"], 8, latency_s=0.03)
        dock.put_experience({"x": [torch.zeros(1)] * 8}, list(range(8)))
        waited[prefetch] = _loop(dock, count=1, cost=0.03, prefetch=prefetch).get_s
    assert waited[True] < 0.6 * waited[False], waited

