"""One CUDA graph capture at a time per process, no cache release or device-wide wait beside one, and a
failed capture that leaves nothing capturing (device/capture.py).

No CUDA here: torch.cuda's streams, `CUDAGraph`, the caching allocator's pool entry points, `synchronize` and
`empty_cache` are replaced by a stand-in, while the capture itself goes through torch's own `torch.cuda.graph`
context manager (its entry's synchronize and cache release, `capture_begin`, its exit's `capture_end` and stream
restore). The stand-in keeps what the real allocator keeps: which pools it records to (`captures_underway`),
each pool's references, the current stream per thread. Like torch 2.13's `CUDAGraph.capture_end`, its
`capture_end` on an invalidated capture ends the stream capture and raises before the allocator leaves the
pool; like torch's `empty_cache`, its `empty_cache` refuses (records an error) while a pool is recorded to.
Every capture, `empty_cache` and `synchronize` takes a while and is recorded as a span, so threads running
them at once show whether they overlapped; with the process's lock taken away the same stand-in records
them overlapping, so the checks can fail."""
from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch

from mindspeed_rl import device as D
from mindspeed_rl.device import capture as C
from mindspeed_rl.engines.base import SamplingParams
from mindspeed_rl.engines.rollout.static_decode import StaticDecoder, sampling_key

HOLD_S = 0.05   # how long a capture, a release or a wait lasts: room for another thread to cut in


class StandIn:
    """torch.cuda's capture-related state for one device (see the module's doc)."""

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self.errors: list[str] = []
        self.recording: list = []              # the pools the allocator records to (captures_underway)
        self.pool_refs: dict = {}               # pool -> references (capture_begin takes one, reset drops it)
        self.default = Stream("default")
        self.local = threading.local()
        self.graphs_stream: list = []           # the stream each torch.cuda.graph context captured on
        self.pools = 0
        self._mu = threading.Lock()

    # streams -------------------------------------------------------------------------------------
    def current(self):
        return getattr(self.local, "stream", self.default)

    def stream_ctx(self, s):
        return StreamContext(self, s)

    # the allocator ---------------------------------------------------------------------------------
    def span(self, what: str, t0: float) -> None:
        with self._mu:
            self.spans.append((what, t0, time.perf_counter()))

    def held(self, what: str) -> None:
        t0 = time.perf_counter()
        if what == "empty_cache" and self.recording:
            self.errors.append(f"empty_cache while recording to {self.recording} (captures_underway.empty())")
        time.sleep(HOLD_S)
        self.span(what, t0)

    def begin(self, pool) -> None:
        with self._mu:
            if pool in self.recording:
                self.errors.append(f"beginAllocateToPool: already recording to {pool}")
            self.recording.append(pool)
            self.pool_refs[pool] = self.pool_refs.get(pool, 0) + 1

    def end(self, device, pool) -> None:
        with self._mu:
            if pool not in self.recording:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            self.recording.remove(pool)

    def release(self, device, pool) -> None:
        with self._mu:
            self.pool_refs[pool] -= 1

    def new_pool(self):
        self.pools += 1
        return (0, self.pools)

    def overlapping(self) -> list[tuple[str, str]]:
        s = sorted(self.spans, key=lambda x: x[1])
        return [(a[0], b[0]) for a, b in zip(s, s[1:]) if b[1] < a[2]]

    def count(self, what: str) -> int:
        return sum(1 for w, _, _ in self.spans if w == what)


class StreamContext:
    """torch.cuda.StreamContext: the entry makes `s` current and keeps the stream it replaced, the exit puts that
    one back (a context whose exit never runs restores nothing)."""

    def __init__(self, sa: StandIn, s):
        self.sa, self.s = sa, s

    def __enter__(self):
        self.prev = self.sa.current()
        self.sa.local.stream = self.s

    def __exit__(self, *exc):
        self.sa.local.stream = self.prev


class Stream:
    def __init__(self, name: str = "side", device=None):
        self.name = name
        self.capturing = False

    def wait_stream(self, other):
        pass


def graph_class(sa: StandIn):
    class Graph:
        """`torch.cuda.CUDAGraph` as far as a capture's bookkeeping goes (torch 2.13's order of steps)."""

        def __init__(self):
            self.pool_id, self.stream, self.ended, self.invalid, self.was_reset = None, None, False, False, False

        def capture_begin(self, pool=None, capture_error_mode="global", check_input_liveness=False):
            self.t0 = time.perf_counter()
            self.pool_id, self.stream = pool, sa.current()
            sa.begin(pool)
            self.stream.capturing = True
            sa.capturing_graph = self

        def capture_end(self):
            if sa.current() is not self.stream:
                raise RuntimeError("Capture must end on the same stream it began on.")
            time.sleep(HOLD_S)
            self.stream.capturing = False          # cudaStreamEndCapture ends the capture, valid or not
            sa.span("capture", self.t0)
            if self.invalid:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            sa.end(None, self.pool_id)
            self.ended = True

        def reset(self):
            self.was_reset = True
            if self.ended:
                sa.release(None, self.pool_id)
                self.ended = False

    return Graph


@pytest.fixture
def stand_in(monkeypatch):
    sa = StandIn()
    sa.capturing_graph = None
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", sa.current)
    monkeypatch.setattr(torch.cuda, "stream", sa.stream_ctx)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class(sa))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", sa.new_pool)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: sa.held("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: sa.held("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", sa.end)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", sa.release)
    # torch.cuda.graph itself is torch's; only its shared default stream is watched (it must stay unused)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    cuda = types.SimpleNamespace(is_initialized=lambda: True, empty_cache=lambda: sa.held("empty_cache"),
                                 synchronize=lambda: sa.held("synchronize"))
    monkeypatch.setattr(D, "_accelerator_module", lambda device: cuda)
    return sa


def _race(sa: StandIn) -> None:
    """Two threads capturing, one releasing the cache and one waiting on the device, three times each."""
    start = threading.Barrier(4)

    def capture():
        start.wait()
        for _ in range(3):
            C.capture_graph(lambda: time.sleep(0.01))

    def release():
        start.wait()
        for _ in range(3):
            D.empty_cache("cuda:0")

    def wait():
        start.wait()
        for _ in range(3):
            D.synchronize("cuda:0")

    threads = [threading.Thread(target=f) for f in (capture, capture, release, wait)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    # each capture's own entry also synchronizes and releases the cache (torch.cuda.graph.__enter__)
    assert (sa.count("capture"), sa.count("empty_cache"), sa.count("synchronize")) == (6, 9, 9)


def test_captures_cache_releases_and_device_waits_never_overlap(stand_in):
    _race(stand_in)
    assert stand_in.overlapping() == []
    assert stand_in.errors == [] and stand_in.recording == []


def test_without_the_lock_the_stand_in_sees_them_overlap(stand_in, monkeypatch):
    monkeypatch.setattr(C, "_LOCK", contextlib.nullcontext())
    monkeypatch.setattr(C, "capture_lock", lambda: contextlib.nullcontext())
    _race(stand_in)
    assert stand_in.overlapping()


def test_synchronize_waits_for_a_capture_underway(stand_in):
    """A device wait from another thread starts only after the capture ended."""
    capturing, done = threading.Event(), []

    def step():
        if stand_in.current().capturing:
            capturing.set()
            time.sleep(0.2)

    t = threading.Thread(target=lambda: done.append(C.capture_graph(step)))
    t.start()
    assert capturing.wait(10)
    D.synchronize("cuda:0")
    t.join(10)
    [(_, _, capture_end)] = [s for s in stand_in.spans if s[0] == "capture"]
    [wait_start] = [t0 for w, t0, _ in stand_in.spans if w == "synchronize"][-1:]
    assert done and wait_start >= capture_end


def test_the_capture_runs_on_the_callers_stream_not_torchs_shared_one(stand_in):
    own = torch.cuda.Stream()
    graph, pool = C.capture_graph(lambda: None, stream=own)
    assert graph.stream is own and torch.cuda.graph.default_capture_stream is None
    assert stand_in.current() is stand_in.default


def test_a_decoder_captures_on_a_stream_of_its_own(stand_in):
    """Every graph of one decoder on one stream (they share a pool); two decoders on two streams."""
    def decoder():
        return types.SimpleNamespace(stream=None, pool=None, device=torch.device("cuda", 0),
                                     _step=lambda b, w: None)

    a, b = decoder(), decoder()
    ga1, ga2, gb = (StaticDecoder._capture(a, 4, 8), StaticDecoder._capture(a, 2, 8),
                    StaticDecoder._capture(b, 4, 8))
    assert ga1.stream is ga2.stream is a.stream and gb.stream is b.stream and a.stream is not b.stream
    assert ga1.pool_id == ga2.pool_id != gb.pool_id
    assert torch.cuda.graph.default_capture_stream is None


def _invalidating_step(sa: StandIn):
    """A step that, while captured, does what a capture refuses (a host read) and raises."""
    def step():
        if sa.current().capturing:
            sa.capturing_graph.invalid = True
            raise RuntimeError("operation not permitted when stream is capturing")
    return step


def _lock_is_free() -> bool:
    got = []

    def probe():
        ok = C.capture_lock().acquire(blocking=False)
        got.append(ok)
        if ok:
            C.capture_lock().release()

    t = threading.Thread(target=probe)
    t.start()
    t.join(5)
    return got == [True]


def test_a_capture_that_raises_leaves_nothing_capturing(stand_in):
    sa = stand_in
    with pytest.raises(RuntimeError):
        C.capture_graph(_invalidating_step(sa))
    graph = sa.capturing_graph
    assert sa.recording == [] and not graph.stream.capturing            # nothing records or captures
    assert sa.pool_refs[graph.pool_id] == 0 and graph.was_reset          # the pool's reference dropped
    assert sa.current() is sa.default                                    # the caller's stream back
    assert _lock_is_free()
    D.empty_cache("cuda:0")
    C.capture_graph(lambda: None)                                        # and the next capture works
    assert sa.errors == [] and sa.recording == []


def test_a_capture_whose_step_raises_without_invalidating_it_is_reset(stand_in):
    """A Python error inside a still-valid capture: capture_end succeeds, the graph's reset releases the pool."""
    sa = stand_in

    def step():
        if sa.current().capturing:
            raise ValueError("a shape check in the step")

    with pytest.raises(ValueError):
        C.capture_graph(step)
    graph = sa.capturing_graph
    assert sa.recording == [] and sa.pool_refs[graph.pool_id] == 0 and graph.was_reset
    assert _lock_is_free()
    D.empty_cache("cuda:0")
    assert sa.errors == []


def test_without_the_cleanup_the_stand_in_stays_recording(stand_in, monkeypatch):
    """What torch's own exit leaves after an invalidated capture: the allocator still records to the pool, and
    the next empty_cache fails (so the check above can fail)."""
    monkeypatch.setattr(C, "_abandon", lambda graph, pool: graph.reset())
    with pytest.raises(RuntimeError):
        C.capture_graph(_invalidating_step(stand_in))
    assert stand_in.recording
    D.empty_cache("cuda:0")
    assert stand_in.errors


def test_a_captured_decoders_key_names_its_stop_ids():
    """The stop ids are a tensor a graph captured: decoders for other stop ids are other decoders."""
    a, b = SamplingParams(max_new_tokens=8, stop_token_ids=(1,)), SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
    assert sampling_key(a) != sampling_key(b)
    assert sampling_key(SamplingParams(max_new_tokens=8, stop_token_ids=(5, 2))) == \
        sampling_key(SamplingParams(max_new_tokens=8, stop_token_ids=(2, 5)))
