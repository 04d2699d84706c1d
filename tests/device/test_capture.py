"""One CUDA graph capture at a time per process, and no cache release beside one (device/capture.py).

No CUDA here: torch.cuda's stream, graph and allocator entry points are replaced by a stand-in that records
when each capture and each `empty_cache` begins and ends (each takes a while, as a real one does), and three
threads (two decoders capturing, a worker releasing its cache) run at once. With the process's lock their
intervals never overlap; with the lock taken away the same stand-in records them overlapping, so the check
can fail."""
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
from mindspeed_rl.engines.rollout.static_decode import sampling_key


class Recorder:
    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self._mu = threading.Lock()

    @contextlib.contextmanager
    def span(self, what: str):
        t0 = time.perf_counter()
        time.sleep(0.05)   # a capture or a release takes time: room for another thread to cut in
        yield
        with self._mu:
            self.spans.append((what, t0, time.perf_counter()))

    def overlapping(self) -> list[tuple[str, str]]:
        s = sorted(self.spans, key=lambda x: x[1])
        return [(a[0], b[0]) for a, b in zip(s, s[1:]) if b[1] < a[2]]


@pytest.fixture
def stand_in(monkeypatch):
    rec = Recorder()

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool, capture_error_mode: rec.span("capture"))

    def empty_cache():   # a release that takes a while, recorded as one span
        with rec.span("empty_cache"):
            pass
    cuda = types.SimpleNamespace(is_initialized=lambda: True, empty_cache=empty_cache)
    monkeypatch.setattr(D, "_accelerator_module", lambda device: cuda)
    return rec


def _race(rec: Recorder) -> None:
    start = threading.Barrier(3)

    def capture():
        start.wait()
        for _ in range(3):
            C.capture_graph(lambda: time.sleep(0.01))

    def release():
        start.wait()
        for _ in range(3):
            D.empty_cache("cuda:0")

    threads = [threading.Thread(target=f) for f in (capture, capture, release)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(rec.spans) == 9


def test_captures_and_cache_releases_never_overlap(stand_in):
    _race(stand_in)
    assert stand_in.overlapping() == []


def test_without_the_lock_the_stand_in_sees_them_overlap(stand_in, monkeypatch):
    monkeypatch.setattr(C, "_LOCK", contextlib.nullcontext())
    monkeypatch.setattr(C, "capture_lock", lambda: contextlib.nullcontext())
    _race(stand_in)
    assert stand_in.overlapping()


def test_a_captured_decoders_key_names_its_stop_ids():
    """The stop ids are a tensor a graph captured: decoders for other stop ids are other decoders."""
    a, b = SamplingParams(max_new_tokens=8, stop_token_ids=(1,)), SamplingParams(max_new_tokens=8, stop_token_ids=(2,))
    assert sampling_key(a) != sampling_key(b)
    assert sampling_key(SamplingParams(max_new_tokens=8, stop_token_ids=(5, 2))) == \
        sampling_key(SamplingParams(max_new_tokens=8, stop_token_ids=(2, 5)))
