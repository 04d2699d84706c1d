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

What stays alive grows too, unless bounded: bf16 matmuls on the CPU go through oneDNN, and both oneDNN's primitive
cache and ideep's (PyTorch's oneDNN wrapper) keep a compiled kernel per shape, 1,024 of each by default. Real data
gives new shapes every step (prompt and response lengths, the rollout's batch shrinking as rows end): measured in
one process, SmolLM2's first 6 layers training in bf16 autocast kept 11.8 MB more malloc'd memory per new sequence
length (fp32: none), and a SmolLM2 GRPO worker's resident memory after its update grew 2.66 -> 2.97 GB over steps
5-12 (malloc's live bytes +25 MB a step, its live tensors unchanged). Workers start with both caches at
`KERNEL_CACHE_ENTRIES` (`bound_kernel_caches`): that process levels off after 3 new lengths at +24 MB in 20 steps
as fast as with the defaults, and the worker stays within 2.57-2.69 GB over steps 5-12, its steps no slower (one
step's kernels, the rollout's and the update's, still fit). 8 entries were too few: the rollout's decode rebuilt
kernels and took 1.4x as long. A capacity the user set in the environment is kept.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")   # oneDNN's, ideep's


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap the kernels oneDNN and ideep keep per shape. Both read their capacity once, when the process first
    builds a kernel: call this before any computation (a worker does, first thing)."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))


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
