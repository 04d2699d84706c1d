"""One CUDA graph capture at a time in a process, and no cache release or device-wide wait beside one.

A capture puts the caching allocator of its device into a capturing mode for the capture's stream: a
second capture started meanwhile from another thread (ReMax's greedy baseline beside the sampled rollout,
a validation, a rollout a weight version ahead), an `empty_cache` from another thread (a worker after
its training stage, an offload) and a device-wide `synchronize` from another thread (it would wait on the
capturing stream, which a capture does not allow) fail inside torch (`captures_underway.empty()`) or
invalidate the capture. Every capture (its warm-up step included), every `device.empty_cache` and every
`device.synchronize` therefore hold one process-wide lock. Decode steps that only replay graphs do not
take it: replaying touches no allocator state.

Each capture runs on a stream its caller owns (`capture_graph(stream=...)`), never on the class-wide
default capture stream `torch.cuda.graph` creates once and shares with every other capture in the process.

A capture that fails in its middle must leave nothing capturing. `torch.cuda.graph`'s exit always calls
`CUDAGraph.capture_end`, which ends the CUDA stream capture; but where the capture was invalidated (an
operation CUDA refuses while capturing, e.g. a host read), torch 2.13's `capture_end` raises at
`cudaStreamEndCapture` before it takes the caching allocator out of the capture's pool, and the context's
exit then skips restoring the caller's stream. `capture_graph` restores the stream with a stream context of
its own around the capture, ends the allocator's recording to the pool where it is still on (the same
`torch._C` entry points `torch.cuda.use_mem_pool` uses: torch has no public call for it), drops that
capture's reference to the pool, and resets the graph; then it re-raises. Later `empty_cache` calls work.
Where torch also routes the pinned host allocator to the pool during a capture, that routing has no Python
call to end it and is left as torch leaves it.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

_LOCK = threading.RLock()
log = logging.getLogger(__name__)


def capture_lock() -> threading.RLock:
    """The process's lock around captures, cache releases and device waits (reentrant: a thread that holds
    it may call `device.empty_cache` or `device.synchronize`, e.g. from a capture's warm-up step)."""
    return _LOCK


def capture_graph(step: Callable[[], None], pool: Any = None, stream: Any = None) -> tuple[Any, Any]:
    """Runs `step` once eagerly on `stream` (the warm-up a graph needs: cuBLAS workspaces, the allocator's
    pools; it is a real step), then records it as a CUDA graph in `pool` (a new pool when None) on the same
    stream, holding the process's capture lock throughout. `stream` is the caller's own capture stream (a
    new one when None); graphs sharing a pool should share it too (torch.cuda.graph's note on pools).
    Returns (the graph, its pool). A capture that raises leaves no capture underway (the module's doc)."""
    import torch
    with _LOCK:
        if stream is None:
            stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        # this outer context gives the caller its stream back even where torch.cuda.graph's exit raises
        # in capture_end and skips its own stream restore
        with torch.cuda.stream(stream):
            try:
                # thread_local: other threads may launch work meanwhile (generates replaying their graphs)
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    step()
            except BaseException:
                _abandon(graph, pool)
                raise
    return graph, pool


def _abandon(graph: Any, pool: Any) -> None:
    """After a failed capture: the allocator out of `pool` where it still records to it, this capture's
    reference to the pool dropped, the graph reset. Never raises (the capture's own error is the one to
    report); what fails here is logged."""
    import torch
    try:
        device = torch.cuda.current_device()
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is not None:
            try:
                end(device, pool)
            except RuntimeError:
                pass   # capture_end got past its own endAllocateToPool: the graph's reset releases the pool
            else:
                # the capture's begin took a reference to the pool that the graph's reset does not drop for a
                # capture that never ended
                if release is not None:
                    release(device, pool)
    except Exception:  # noqa: BLE001 - the capture's error propagates; this one is only reported
        log.exception("cleaning up after a failed CUDA graph capture")
    try:
        graph.reset()
    except Exception:  # noqa: BLE001
        log.exception("resetting a CUDA graph whose capture failed")
