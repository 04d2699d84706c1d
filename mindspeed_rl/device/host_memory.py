"""Host memory of a worker process: what the allocator keeps after a stage, and the peak the kernel saw.

glibc's malloc gives each thread that contends for the heap an arena of its own (up to 8 per core). A worker
runs its stages on threads of their own, and with a real dataset its tensors change size every step (prompt
lengths vary), so memory a step freed sits in arenas in pieces the next step's requests do not fit: the
process grows although what it holds alive does not. Measured in one process on this 2-core CPU, SmolLM2-135M
generating 32 rows on one thread and training on them on another, step after step (docs/fitting.md#host-memory):
9.8 GB after 7 steps with glibc's defaults, where the live set is about 2.4 GB. The tiny model, whose shapes
never change, never showed it.

What the worker does: after every stage call it hands the free pages of every arena back to the kernel
(`malloc_trim(0)`, `release_free_memory`): resident memory then measures what is alive (2.35-2.40 GB over the
same 8 steps), and training pays about 0.3 s in an 8-s step to fault pages back in. Limiting the arenas instead
(`MALLOC_ARENA_MAX=2`) also kept it flat, but made the backward pass 2.4x slower here (5.2 s -> 12.3 s for 64 rows:
the OpenMP threads then wait on each other's arena), and 4 arenas were fast but grew to 10.5 GB. jemalloc or
tcmalloc would need a shared library preloaded into Ray's workers, which PyPI does not ship for every platform.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Give the pages the allocator holds free back to the kernel (False where it cannot be asked)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is missing): read after a stage's release of freed
    memory it is what the worker holds alive, the figure that must stay level over a run."""
    import os
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (the kernel's high-water mark, what an out-of-memory kill
    looks at): each stage reports it, so a worker whose memory keeps growing shows in the step record."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)   # bytes on macOS, KiB on Linux
