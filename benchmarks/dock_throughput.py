"""TransferDock throughput and latency against bare Ray, measured side by side in one run.

    python benchmarks/dock_throughput.py            # full run (~10 min on 2 cores)
    python benchmarks/dock_throughput.py --quick    # fewer repetitions (~5 min)
    python benchmarks/dock_throughput.py --json out.json
    python benchmarks/dock_throughput.py --handoff-only   # only the one-micro-batch handoff (~3 min)

Every number is timed inside worker processes, as in training, not from the driver:
- latency: a bare no-op call to a plain Ray actor; a no-op call to the dock actor and a small get
  (one 1 KB micro-batch of 8 rows) through the dock client, over the dock's local channel (the
  default on the dock's node) and as Ray actor calls (`local_channel=False`). Medians of many calls.
- handoff: the latency of one micro-batch (1 KB, 1 MB, 16 MB) alone, from a producer process to
  1 and to 4 consumer processes, each taking the whole micro-batch, their gets begun together:
  put, then the gets, until the last consumer holds the rows. Plain `ray.put`/`ray.get` (of the
  numpy array: zero-copy; with 1 consumer also of the torch tensor, which Ray pickles)
  alternated with the dock (client defaults; fast path; with 1 consumer also fast path by Ray
  object reference and fast path with Ray actor calls instead of the local channel), medians.
- transfer: a producer streams micro-batches to 1, 4 and 8 consumer processes. Systems: the dock
  with the client's defaults (puts wait for the answer, gets copy rows into private memory) and
  on the fast path the trainer's stage loops use (`wait=False` puts, `copy=False` gets, the next
  get sent before the current rows are used); plain
  `ray.put`/`ray.get` of the same bytes between the same processes; and a naive buffer (one sync
  actor, one lock; consumers start after the producer finished). With 1 consumer also the data
  paths side by side on the fast path: shared memory (the default on one node), Ray object
  references (`data_plane="ray"`, the path across nodes), everything inline through the actor,
  and shared memory with every call a Ray actor call (`local_channel=False`, the call path of a
  worker on another node).
  The dock's MB/s is with producer and consumers at once, as in training; "seq MB/s" is all puts,
  then all gets. Each dock is made once per row and cleared between runs, as in training; systems
  alternate over rounds, so noise hits them alike.
- scaling: get latency of the plain dock (in process) with 1,000 and with 1,000,000 rows.

The target ratios are printed at the end and written to JSON as `small_get_over_noop_call`,
`bw_16mb_over_plain_ray` (fast path; also `_client_defaults`, `_by_ref` and `_ray_calls`),
`handoff_16mb_over_plain_ray`, `handoff_4c_1mb_over_plain_ray`, `handoff_4c_16mb_over_plain_ray`
(plain Ray's time over the dock fast path's, > 1: the dock is faster; each also as `_paired`, the
median of per-round ratios) and `get_1m_over_1k_rows`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np
import ray
import torch

from mindspeed_rl.transfer_dock import TransferDock, create_transfer_dock

ROWS_PER_MB = 8
PAYLOADS = {"1KB": 1 << 10, "1MB": 1 << 20, "16MB": 16 << 20}
CONSUMER_COUNTS = (1, 4, 8)
WORKER_CPUS = 0.1  # workers only move bytes here; fractional CPUs let 10 of them fit on 2 cores
# What is being measured now: a failure names it (stderr's progress lines name only what finished,
# so a crash in the round trips read as one in the hand-off before them).
_phase = "start-up"


def _microbatch(payload_bytes: int) -> torch.Tensor:
    """One micro-batch: ROWS_PER_MB rows of float32 adding up to `payload_bytes`."""
    return torch.randn(ROWS_PER_MB, max(1, payload_bytes // (4 * ROWS_PER_MB)))


def _check_rows(values: list, rows: list[int]) -> None:
    """Every row of a dock get is what the producer put: a non-empty float32 torch tensor. A get
    that handed out numpy arrays or another dtype (issue 24: a torn read in local claims) must
    fail the run with what came, not be timed as if it had worked or fail later on an attribute."""
    for v, r in zip(values, rows):
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.numel() > 0):
            raise AssertionError(f"dock get: row {r} came as {type(v).__name__} {getattr(v, 'dtype', '?')} "
                                 f"of {getattr(v, 'shape', '?')}; it was put as a torch.float32 row")


@ray.remote(num_cpus=WORKER_CPUS)
class Noop:
    def noop(self) -> None:
        pass


@ray.remote(num_cpus=WORKER_CPUS)
class NaiveBuffer:
    """What one writes without a dock: a list behind one lock, holding torch tensors as given."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list = []

    def put(self, batch) -> None:
        with self._lock:
            self._items.append(batch)

    def get(self):
        with self._lock:
            return self._items.pop() if self._items else None


@ray.remote(num_cpus=WORKER_CPUS)
class Worker:
    """A producer or consumer process; each method times its own loop."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def ready(self) -> bool:
        return True

    # --- latency
    def time_noop(self, actor, calls: int) -> list[float]:
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            ray.get(actor.noop.remote())
            out.append(time.perf_counter() - t)
        return out

    def time_dock_noop(self, client, calls: int) -> list[float]:
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            client.noop()
            out.append(time.perf_counter() - t)
        return out

    def time_small_gets(self, client, consumer: str, calls: int) -> list[float]:
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            data, rows = client.get_experience(consumer, ["x"], ROWS_PER_MB)
            out.append(time.perf_counter() - t)
            assert len(rows) == ROWS_PER_MB
            _check_rows(data["x"], rows)
        return out

    # --- dock
    def dock_put(self, client, payload_bytes: int, first_mb: int, n_mb: int, wait: bool = True) -> float:
        batch = self._batch(payload_bytes)
        t = time.perf_counter()
        for k in range(first_mb, first_mb + n_mb):
            client.put_experience({"x": batch}, range(k * ROWS_PER_MB, (k + 1) * ROWS_PER_MB), producer="producer",
                                  wait=wait)
        client.flush()
        return time.perf_counter() - t

    def dock_drain(self, client, consumer: str, copy: bool = True, prefetch: bool = False) -> tuple[int, float]:
        """Take micro-batches until the step is consumed. `prefetch`: send the next get before
        using the current rows, as the trainer's stage loop does (`run_stage_loop`)."""
        rows_seen = 0
        t = time.perf_counter()

        def send():
            return client.get_experience_async(consumer, ["x"], ROWS_PER_MB, blocking=True, timeout=120, copy=copy)
        pending = send() if prefetch else None
        while True:
            if prefetch:
                data, rows = pending.result()
                pending = send() if rows else None
            else:
                data, rows = client.get_experience(consumer, ["x"], ROWS_PER_MB, blocking=True, timeout=120,
                                                   copy=copy)
            if not rows:
                return rows_seen, time.perf_counter() - t
            rows_seen += len(rows)
            _check_rows(data["x"], rows)

    def warm_object_store(self, total_bytes: int) -> None:
        """Touch the store's pages once: first-touch page faults cost more than the copies we
        measure, and whichever system ran first would pay them all."""
        arr = np.ones(16 << 20, dtype=np.uint8)
        refs = [ray.put(arr) for _ in range(max(1, total_bytes // arr.nbytes))]
        del refs

    # --- one micro-batch at a time, timed here (see measure_handoff)
    def one_plain_put(self, payload_bytes: int, as_torch: bool = False) -> tuple[float, list]:
        arr = self._batch(payload_bytes) if as_torch else self._batch(payload_bytes).numpy()
        t = time.perf_counter()
        ref = ray.put(arr)
        return time.perf_counter() - t, [ref]

    def one_plain_get(self, refs: list, start_at: float) -> tuple[float, float]:
        """Zero-copy `ray.get` of the numpy array (or the pickled tensor), begun at `start_at`."""
        t = _sleep_until(start_at)
        arr = ray.get(refs[0])
        assert arr.shape[0] > 0
        return t, time.perf_counter()

    def held(self, client):
        """The client this worker was first given for `client`'s dock. A training worker is given
        its client once (`WorkerSpec.dock`) and keeps it, with its connection to the dock's local
        channel and its unchecked puts; a client sent with every call would open a new connection
        in every timed get and let `flush()` see none of the puts sent before."""
        clients = self.__dict__.setdefault("_clients", {})
        return clients.setdefault(client.actor._ray_actor_id.hex(), client)

    def one_dock_put(self, client, payload_bytes: int, k: int, wait: bool) -> float:
        client = self.held(client)
        batch = self._batch(payload_bytes)
        t = time.perf_counter()
        client.put_experience({"x": batch}, range(k * ROWS_PER_MB, (k + 1) * ROWS_PER_MB), wait=wait)
        return time.perf_counter() - t

    def one_dock_get(self, client, consumer: str, copy: bool, start_at: float) -> tuple[float, float]:
        """The whole micro-batch for `consumer`, begun at `start_at`: (start, end) on the machine's
        monotonic clock, which every process on the node shares."""
        client = self.held(client)
        t = _sleep_until(start_at)
        data, rows = client.get_experience(consumer, ["x"], ROWS_PER_MB, blocking=True, timeout=60, copy=copy)
        end = time.perf_counter()
        assert len(rows) == ROWS_PER_MB
        _check_rows(data["x"], rows)
        return t, end

    def flush(self, client) -> None:
        self.held(client).flush()

    def _batch(self, payload_bytes: int) -> torch.Tensor:
        if getattr(self, "_batch_cache", (None,))[0] != payload_bytes:
            self._batch_cache = (payload_bytes, _microbatch(payload_bytes))
        return self._batch_cache[1]

    # --- plain Ray
    def plain_put(self, payload_bytes: int, n_mb: int) -> tuple[float, list]:
        arr = _microbatch(payload_bytes).numpy()
        t = time.perf_counter()
        refs = [ray.put(arr) for _ in range(n_mb)]
        return time.perf_counter() - t, refs

    def plain_get(self, refs: list) -> float:
        t = time.perf_counter()
        for ref in refs:
            arr = ray.get(ref)
            assert arr.size > 0
        return time.perf_counter() - t

    # --- naive buffer
    def naive_put(self, buffer, payload_bytes: int, n_mb: int) -> float:
        batch = _microbatch(payload_bytes)
        t = time.perf_counter()
        for _ in range(n_mb):
            ray.get(buffer.put.remote({"x": batch}))
        return time.perf_counter() - t

    def naive_drain(self, buffer) -> tuple[int, float]:
        rows_seen = 0
        t = time.perf_counter()
        while (batch := ray.get(buffer.get.remote())) is not None:
            rows_seen += batch["x"].shape[0]
        return rows_seen, time.perf_counter() - t


def _sleep_until(start_at: float) -> float:
    """Sleep until `start_at` (time.perf_counter, CLOCK_MONOTONIC: one clock for all processes of
    the node), so that consumers called one after another by the driver start their gets together."""
    left = start_at - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return time.perf_counter()


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _n_microbatches(payload: int, quick: bool) -> int:
    """Enough micro-batches per run to time well, bounded in bytes so the object store copes."""
    if payload <= 1 << 10:
        return 80 if quick else 240
    if payload <= 1 << 20:
        return 32 if quick else 64
    return 8 if quick else 16


def measure_latency(workers, calls: int) -> dict[str, float]:
    """No-op calls and small gets, over the local channel and as Ray calls, alternated in rounds."""
    noop = Noop.remote()
    clients = {path: create_transfer_dock(["x"], ["c"], prompts_num=calls * ROWS_PER_MB + ROWS_PER_MB,
                                          local_channel=(path == "channel")) for path in ("channel", "ray")}
    w = workers[1]
    for client in clients.values():
        ray.get(workers[0].dock_put.remote(client, PAYLOADS["1KB"], 0, calls + 1))
        ray.get(w.time_small_gets.remote(client, "c", 1))  # warm-up: connections, first-call costs
    ray.get(w.time_noop.remote(noop, 20))
    times: dict[str, list[float]] = {k: [] for k in ("noop", "dock_noop_channel", "dock_noop_ray",
                                                     "get_channel", "get_ray")}
    rounds = 5
    for _ in range(rounds):
        times["noop"] += ray.get(w.time_noop.remote(noop, calls // rounds))
        for path, client in clients.items():
            times[f"dock_noop_{path}"] += ray.get(w.time_dock_noop.remote(client, calls // rounds))
            times[f"get_{path}"] += ray.get(w.time_small_gets.remote(client, "c", calls // rounds))
    ray.kill(noop)
    for client in clients.values():
        drop_dock(client)
    return {"noop_call_ms": _median_ms(times["noop"]), "dock_noop_call_ms": _median_ms(times["dock_noop_channel"]),
            "small_get_ms": _median_ms(times["get_channel"]),
            "dock_noop_ray_call_ms": _median_ms(times["dock_noop_ray"]),
            "small_get_ray_call_ms": _median_ms(times["get_ray"])}


# The dock as each transfer row uses it: (create_transfer_dock kwargs, put wait, get copy).
# name -> (dock kwargs, puts wait for the answer, gets copy, gets prefetched)
DOCK_SYSTEMS = {
    "dock": ({}, True, True, False),  # the client's defaults, one call at a time
    "dock fast path": ({}, False, False, True),  # what the trainer's stage loops do
}
DOCK_DATA_PATHS = {  # with 1 consumer: the data paths side by side, all on the fast path
    "dock by-ref": ({"data_plane": "ray"}, False, False, True),
    "dock all-inline": ({"inline_bytes": 1 << 62}, False, False, True),
    "dock Ray calls": ({"local_channel": False}, False, False, True),
}


def make_dock(n_rows: int, kwargs: dict):
    return create_transfer_dock(["x"], ["c"], prompts_num=n_rows, **kwargs)


def drop_dock(client) -> None:
    client.close()
    ray.kill(client.actor)


def measure_dock(workers, client, payload: int, consumers: int, n_mb: int, wait: bool, copy: bool,
                 prefetch: bool = False) -> dict:
    """Producer and consumers at once (overlapped), then all puts followed by all gets (sequential).

    The dock is made once per row and cleared between runs, as the trainer does step after step:
    so its shared-memory segments are warm, as the object store is for plain Ray."""
    producer, cons = workers[0], workers[1:1 + consumers]
    # overlapped
    t = time.perf_counter()
    drains = [w.dock_drain.remote(client, "c", copy, prefetch) for w in cons]
    ray.get(producer.dock_put.remote(client, payload, 0, n_mb, wait))
    rows = sum(r for r, _ in ray.get(drains))
    overlapped_s = time.perf_counter() - t
    assert rows == n_mb * ROWS_PER_MB, (rows, n_mb)
    client.clear()
    # sequential: all puts, then all gets
    put_s = ray.get(producer.dock_put.remote(client, payload, 0, n_mb, wait))
    t = time.perf_counter()
    rows = sum(r for r, _ in ray.get([w.dock_drain.remote(client, "c", copy, prefetch) for w in cons]))
    get_s = time.perf_counter() - t
    assert rows == n_mb * ROWS_PER_MB
    client.clear()
    return {"overlapped_s": overlapped_s, "put_s": put_s, "get_s": get_s}


def measure_plain(workers, payload: int, consumers: int, n_mb: int) -> dict:
    producer, cons = workers[0], workers[1:1 + consumers]
    put_s, refs = ray.get(producer.plain_put.remote(payload, n_mb))
    t = time.perf_counter()
    ray.get([w.plain_get.remote(refs[i::consumers]) for i, w in enumerate(cons)])
    get_s = time.perf_counter() - t
    del refs
    return {"put_s": put_s, "get_s": get_s}


def measure_naive(workers, payload: int, consumers: int, n_mb: int) -> dict:
    buffer = NaiveBuffer.remote()
    producer, cons = workers[0], workers[1:1 + consumers]
    put_s = ray.get(producer.naive_put.remote(buffer, payload, n_mb))
    t = time.perf_counter()
    rows = sum(r for r, _ in ray.get([w.naive_drain.remote(buffer) for w in cons]))
    get_s = time.perf_counter() - t
    assert rows == n_mb * ROWS_PER_MB
    ray.kill(buffer)
    return {"put_s": put_s, "get_s": get_s}


# One micro-batch, alone: name -> (create_transfer_dock kwargs, put wait, get copy).
HANDOFF_DOCKS = {"dock": ({}, True, True), "dock fast path": ({}, False, False),
                 "dock by-ref": ({"data_plane": "ray"}, False, False),
                 "dock Ray calls": ({"local_channel": False}, False, False)}
# With several consumers, the systems the issue compares (the client's defaults and the fast path).
HANDOFF_FANOUT_DOCKS = ("dock", "dock fast path")
GET_START_DELAY_S = 0.02  # the driver's calls to every consumer arrive well within this


def measure_handoff(workers, payload: int, reps: int, consumers: int = 1) -> dict[str, float]:
    """Median time to hand one micro-batch from a producer process to `consumers` consumer
    processes, each of which takes the whole micro-batch (as the stages that read one column do).

    One round: the producer puts (timed in the producer); then every consumer starts its get at
    one instant (a shared monotonic clock), in parallel; the hand-off ends when the last consumer
    holds the rows. Time = put + (last get's end - first get's start). Plain Ray is `ray.put` of
    the numpy array, its ref passed to the consumers, which `ray.get` it zero-copy (and, with one
    consumer, of the torch tensor, which Ray pickles). The systems alternate micro-batch by
    micro-batch, so machine noise and page-fault warmth hit them alike. `dock` uses the client's
    defaults (each put waits for its answer; rows are copied into private memory). `dock fast path`
    is what a stage that collates its micro-batch at once uses (the trainer's stage loops do):
    puts with `wait=False` (the consumers' blocking gets still wait until the rows are in) and
    gets with `copy=False`. `dock by-ref` is the fast path with large columns as Ray object
    references instead of shared memory. Each dock is cleared after every micro-batch (not
    timed), as a step ends. Also returns each system's per-round ratio to plain Ray, paired.
    """
    producer, cons = workers[0], workers[1:1 + consumers]
    names = [f"c{i}" for i in range(consumers)]
    docks = HANDOFF_DOCKS if consumers == 1 else {d: HANDOFF_DOCKS[d] for d in HANDOFF_FANOUT_DOCKS}
    clients = {name: create_transfer_dock(["x"], names, prompts_num=ROWS_PER_MB, **kw)
               for name, (kw, _, _) in docks.items()}
    plain = ["plain-ray", "plain-ray torch"] if consumers == 1 else ["plain-ray"]
    times: dict[str, list[float]] = {**{p: [] for p in plain}, **{name: [] for name in docks}}
    for r in range(reps + 1):
        for system in times:
            if system.startswith("plain-ray"):
                put_s, refs = ray.get(producer.one_plain_put.remote(payload, system == "plain-ray torch"))
                start_at = time.perf_counter() + GET_START_DELAY_S
                spans = ray.get([c.one_plain_get.remote(refs, start_at) for c in cons])
                del refs
            else:
                client, (_, wait, copy) = clients[system], docks[system]
                put_s = ray.get(producer.one_dock_put.remote(client, payload, 0, wait))
                start_at = time.perf_counter() + GET_START_DELAY_S
                spans = ray.get([c.one_dock_get.remote(client, n, copy, start_at) for c, n in zip(cons, names)])
                ray.get(producer.flush.remote(client))
                client.clear()
            if r > 0:  # the first round warms connections and caches
                times[system].append(put_s + max(end for _, end in spans) - min(start for start, _ in spans))
    for client in clients.values():
        drop_dock(client)
    out: dict[str, float | list] = {f"{system}_ms": _median_ms(ts) for system, ts in times.items()}
    out["consumers"] = consumers
    out["paired_over_plain_ray"] = {  # per round: plain Ray's time / this system's (> 1: faster)
        system: statistics.median(p / d for p, d in zip(times["plain-ray"], ts))
        for system, ts in times.items() if system.startswith("dock")}
    return out


def measure_scaling(gets: int) -> dict[str, float]:
    """Median get latency of the plain dock, in process, at 1,000 and 1,000,000 rows."""
    out = {}
    row = np.zeros(4, dtype=np.float32)
    for capacity in (1_000, 1_000_000):
        dock = TransferDock(["x"], ["c"], prompts_num=capacity, event_log_size=1000)
        chunk = 100_000
        for start in range(0, capacity, chunk):
            stop = min(capacity, start + chunk)
            dock.put_experience({"x": [row] * (stop - start)}, range(start, stop))
        dock.get_experience("c", ["x"], ROWS_PER_MB)  # first get builds the consumer's ready set
        lat = []
        while len(lat) < gets:
            t = time.perf_counter()
            _, rows = dock.get_experience("c", ["x"], ROWS_PER_MB)
            lat.append(time.perf_counter() - t)
            if len(rows) < ROWS_PER_MB:  # the small dock runs dry: refill (not timed)
                dock.clear()
                dock.put_experience({"x": [row] * capacity}, range(capacity))
                dock.get_experience("c", ["x"], ROWS_PER_MB)
        out[f"get_ms_{capacity}_rows"] = _median_ms(lat)
        del dock
    return out


HANDOFF_CONSUMERS = (1, 4)


def handoff_key(consumers: int) -> str:
    """The results key of the handoff to `consumers` consumers ("handoff" for one, as before)."""
    return "handoff" if consumers == 1 else f"handoff_{consumers}c"


def handoff_ratios(results: dict) -> dict[str, float]:
    """Plain Ray's handoff time over the dock fast path's (> 1: the dock is faster), from the
    medians; `_paired` is the median of the per-round ratios instead."""
    out = {}
    for consumers in HANDOFF_CONSUMERS:
        infix = "" if consumers == 1 else f"_{consumers}c"
        for name, h in results[handoff_key(consumers)].items():
            if consumers == 1 and name != "16MB" or name == "1KB":
                continue
            key = f"handoff{infix}_{name.lower()}_over_plain_ray"
            out[key] = h["plain-ray_ms"] / h["dock fast path_ms"]
            out[f"{key}_paired"] = h["paired_over_plain_ray"]["dock fast path"]
    return out


def run(quick: bool, only_handoff: bool = False, handoff_reps: int | None = None) -> dict:
    global _phase
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=2 * 1024 ** 3)
    workers = [Worker.remote() for _ in range(1 + max(CONSUMER_COUNTS))]
    ray.get([w.ready.remote() for w in workers])
    results: dict = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__, "ray": ray.__version__,
                                 "cpus": os.cpu_count(), "platform": platform.platform()},
                     "quick": quick, "rows_per_microbatch": ROWS_PER_MB}
    if not only_handoff:
        _phase = "latency"
        results["latency"] = measure_latency(workers, 200 if quick else 1000)
    rounds = 3 if quick else 5
    ray.get(workers[0].warm_object_store.remote(2 * 16 * max(PAYLOADS.values())))
    reps = handoff_reps or (20 if quick else 60)
    for consumers in HANDOFF_CONSUMERS:
        results[handoff_key(consumers)] = {}
        for name, payload in PAYLOADS.items():
            _phase = f"the handoff of {name} to {consumers} consumer(s)"
            results[handoff_key(consumers)][name] = measure_handoff(workers, payload, reps, consumers)
        print(f"  measured the handoff to {consumers} consumer(s)", file=sys.stderr, flush=True)
    if only_handoff:
        ray.shutdown()
        results["ratios"] = handoff_ratios(results)
        return results
    rows = []
    for name, payload in PAYLOADS.items():
        n_mb = _n_microbatches(payload, quick)
        mb_bytes = _microbatch(payload).numel() * 4
        total_bytes, total_rows = n_mb * mb_bytes, n_mb * ROWS_PER_MB
        for consumers in CONSUMER_COUNTS:
            _phase = f"the transfer of {name} micro-batches to {consumers} consumer(s)"
            dock_systems = dict(DOCK_SYSTEMS, **(DOCK_DATA_PATHS if consumers == 1 else {}))
            clients = {d: make_dock(n_mb * ROWS_PER_MB, kw) for d, (kw, *_) in dock_systems.items()}

            def dock_run(d, consumers=consumers, n_mb=n_mb, payload=payload, clients=clients,
                         dock_systems=dock_systems):
                _, wait, copy, prefetch = dock_systems[d]
                return measure_dock(workers, clients[d], payload, consumers, n_mb, wait, copy, prefetch)

            systems = {d: (lambda d=d: dock_run(d)) for d in dock_systems}
            systems["plain-ray"] = lambda: measure_plain(workers, payload, consumers, n_mb)
            systems["naive-buffer"] = lambda: measure_naive(workers, payload, consumers, n_mb)
            for d in dock_systems:  # one unmeasured run each: segments mapped, connections made
                systems[d]()
            runs: dict[str, list[dict]] = {k: [] for k in systems}
            order = list(systems)
            for r in range(rounds):  # alternate the systems so drift and noise hit them alike
                for system in order[r % len(order):] + order[:r % len(order)]:
                    runs[system].append(systems[system]())
            for client in clients.values():
                drop_dock(client)
            for system, ms in runs.items():
                seq_s = statistics.median(m["put_s"] + m["get_s"] for m in ms)
                wall_s = statistics.median(m.get("overlapped_s", m["put_s"] + m["get_s"]) for m in ms)
                rows.append({
                    "payload": name, "consumers": consumers, "system": system, "microbatches": n_mb,
                    "rounds": rounds, "rows_per_s": total_rows / wall_s, "mb_per_s": total_bytes / wall_s / 1e6,
                    "seq_mb_per_s": total_bytes / seq_s / 1e6, "runs": ms,
                })
            print(f"  measured {name} x {consumers} consumers", file=sys.stderr, flush=True)
    results["transfer"] = rows
    _phase = "scaling"
    results["scaling"] = measure_scaling(2_000 if quick else 20_000)
    ray.shutdown()

    lat, sc = results["latency"], results["scaling"]
    runs16 = {r["system"]: r["runs"] for r in rows if r["payload"] == "16MB" and r["consumers"] == 1}

    def paired(system: str) -> float:
        """Median over rounds of (dock MB/s / plain Ray MB/s in the same round): each round runs
        every system back to back, so pairing within it cancels the machine's drift."""
        return statistics.median(
            (p["put_s"] + p["get_s"]) / d["overlapped_s"] for d, p in zip(runs16[system], runs16["plain-ray"]))

    # Bandwidth: MB/s of a stream of 16 MB micro-batches, producer and consumer at once for the
    # dock (as the stages run), all puts then all gets for plain Ray (a stream would only hide its
    # ~0.2 ms get). Handoff: the latency of one micro-batch alone, put then get.
    results["ratios"] = {
        "small_get_over_noop_call": lat["small_get_ms"] / lat["noop_call_ms"],
        "small_get_over_noop_call_ray_calls": lat["small_get_ray_call_ms"] / lat["noop_call_ms"],
        "bw_16mb_over_plain_ray": paired("dock fast path"),
        "bw_16mb_over_plain_ray_client_defaults": paired("dock"),
        "bw_16mb_over_plain_ray_by_ref": paired("dock by-ref"),
        "bw_16mb_over_plain_ray_ray_calls": paired("dock Ray calls"),
        "bw_16mb_over_plain_ray_each_round": [
            (p["put_s"] + p["get_s"]) / d["overlapped_s"]
            for d, p in zip(runs16["dock fast path"], runs16["plain-ray"])],
        **handoff_ratios(results),
        "get_1m_over_1k_rows": sc["get_ms_1000000_rows"] / sc["get_ms_1000_rows"],
    }
    return results


def print_table(results: dict) -> None:
    lat, sc, ratios = results["latency"], results["scaling"], results["ratios"]
    print(f"\nTransferDock benchmark ({'quick' if results['quick'] else 'full'}; {results['machine']['cpus']} CPUs, "
          f"ray {results['machine']['ray']}, torch {results['machine']['torch']}; {ROWS_PER_MB} rows per micro-batch)\n")
    print("latency (median, from a worker process)")
    print(f"  no-op call, plain Ray actor   {lat['noop_call_ms']:8.3f} ms")
    print(f"  no-op call, dock (channel)    {lat['dock_noop_call_ms']:8.3f} ms")
    print(f"  no-op call, dock (Ray call)   {lat['dock_noop_ray_call_ms']:8.3f} ms")
    print(f"  small get (1 KB), channel     {lat['small_get_ms']:8.3f} ms")
    print(f"  small get (1 KB), Ray call    {lat['small_get_ray_call_ms']:8.3f} ms")
    print(f"  plain dock get, 1,000 rows    {sc['get_ms_1000_rows']:8.4f} ms")
    print(f"  plain dock get, 1,000,000 rows{sc['get_ms_1000000_rows']:8.4f} ms\n")
    print("transfer (rows/s and MB/s: producer and consumers at once for the dock; sequential MB/s: all puts, then all gets)")
    print(f"  {'payload':>7} {'cons':>4}  {'system':<16} {'rows/s':>10} {'MB/s':>9} {'seq MB/s':>9}")
    for r in results["transfer"]:
        print(f"  {r['payload']:>7} {r['consumers']:>4}  {r['system']:<16} {r['rows_per_s']:>10.0f} "
              f"{r['mb_per_s']:>9.1f} {r['seq_mb_per_s']:>9.1f}")
    print_handoff(results)
    print("\ntargets")
    print(f"  small_get_over_noop_call          {ratios['small_get_over_noop_call']:6.2f}  (target <= 2; "
          "over the local channel)")
    print(f"    ... as a Ray actor call         {ratios['small_get_over_noop_call_ray_calls']:6.2f}  "
          "(local_channel=False: the call path from another node)")
    print(f"  bw_16mb_over_plain_ray            {ratios['bw_16mb_over_plain_ray']:6.2f}  (target >= 0.7; "
          "the stages' fast path: wait=False puts, copy=False gets, shared memory)")
    print(f"    ... client defaults             {ratios['bw_16mb_over_plain_ray_client_defaults']:6.2f}  "
          "(puts wait for the dock's answer, gets copy into private memory)")
    print(f"    ... by Ray object reference     {ratios['bw_16mb_over_plain_ray_by_ref']:6.2f}  "
          "(fast path, data_plane='ray')")
    print(f"    ... with Ray actor calls        {ratios['bw_16mb_over_plain_ray_ray_calls']:6.2f}  "
          "(fast path, shared memory, local_channel=False)")
    print_handoff_ratios(ratios)
    print(f"  get_1m_over_1k_rows               {ratios['get_1m_over_1k_rows']:6.2f}  (target <= 2)")


def print_handoff(results: dict) -> None:
    for consumers in HANDOFF_CONSUMERS:
        table = results[handoff_key(consumers)]
        systems = [k[:-3] for k in next(iter(table.values())) if k.endswith("_ms")]
        print(f"\none micro-batch from a producer to {consumers} consumer(s), each taking all of it "
              "(median ms, systems alternated; see measure_handoff)")
        print(f"  {'payload':>7}  " + " ".join(f"{s:>15}" for s in systems))
        for name, h in table.items():
            print(f"  {name:>7}  " + " ".join(f"{h[s + '_ms']:>15.2f}" for s in systems))


def print_handoff_ratios(ratios: dict) -> None:
    for key, value in ratios.items():
        if key.startswith("handoff") and not key.endswith("_paired"):
            target = "target >= 1.0; " if "_4c_" in key else ""
            print(f"  {key:<34}{value:6.2f}  ({target}median of rounds paired: {ratios[key + '_paired']:.2f}; "
                  "latency of one micro-batch alone, fast path)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (~5 min)")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    p.add_argument("--handoff-only", action="store_true",
                   help="only the one-micro-batch handoff to 1 and 4 consumers (~3 min)")
    p.add_argument("--handoff-reps", type=int, metavar="N",
                   help="micro-batches per system and payload in the handoff (default 60, 20 with --quick)")
    args = p.parse_args()
    if args.handoff_reps is not None and args.handoff_reps < 1:
        p.error(f"--handoff-reps={args.handoff_reps}: give at least 1 micro-batch")
    t0 = time.monotonic()
    try:
        results = run(args.quick, only_handoff=args.handoff_only, handoff_reps=args.handoff_reps)
    except BaseException:
        print(f"dock_throughput: failed while measuring {_phase}, after {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
        raise
    print(f"  done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.handoff_only:
        print_handoff(results)
        print()
        print_handoff_ratios(results["ratios"])
    else:
        print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
