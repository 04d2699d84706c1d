"""One CUDA graph capture at a time in a process, and no cache release beside one.

A capture puts the caching allocator of its device into a capturing mode for the capture's stream: a
second capture started meanwhile from another thread (ReMax's greedy baseline beside the sampled rollout,
a validation, a rollout a weight version ahead) and an `empty_cache` from another thread (a worker after
its training stage, an offload) both fail inside torch (`captures_underway.empty()`) or invalidate the
capture, and a capture that fails in its middle can leave the allocator capturing, so every later
`empty_cache` of the process fails too. Every capture (its warm-up step included) and every
`device.empty_cache` therefore hold one process-wide lock. Decode steps that only replay graphs do not
take it: replaying touches no allocator state.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

_LOCK = threading.RLock()


def capture_lock() -> threading.RLock:
    """The process's lock around captures and cache releases (reentrant: a capture may release)."""
    return _LOCK


def capture_graph(step: Callable[[], None], pool: Any = None) -> tuple[Any, Any]:
    """Runs `step` once eagerly on a side stream (the warm-up a graph needs: cuBLAS workspaces, the
    allocator's pools; it is a real step), then records it as a CUDA graph in `pool` (a new pool when
    None), holding the process's capture lock throughout. Returns (the graph, its pool)."""
    import torch
    with _LOCK:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        # thread_local: other threads may launch work meanwhile (generates replaying their graphs)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            step()
    return graph, pool
