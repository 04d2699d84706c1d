"""The host allocator settings every process of a run starts with.

glibc's malloc gives each thread that contends for the heap an arena of its own, up to 8 per core. A worker
runs several stages on threads of its own (generate, log-probs, train, weight sync), and with a real dataset
its tensors change size every step (prompt lengths vary), so the freed blocks of one step rarely fit the
next step's requests in the arena a thread lands on: each arena keeps its high-water mark and the process
grows. Measured on SmolLM2-135M (configs/grpo_smollm2_arith.yaml) on this 2-core CPU: the actor worker's
resident memory went from 2 GB to 14 GB in 4 steps with the default arenas; with two arenas it stays level
(docs/fitting.md#host-memory). The tiny model, whose shapes never change, never showed it.

`MALLOC_ARENA_MAX` is read by glibc when the process starts, so it is set in the actors' Ray runtime
environment (`actor_runtime_env`), not by the process itself. A value the user already exported is kept.
Other allocators (jemalloc, tcmalloc through LD_PRELOAD) would need a shared library PyPI does not ship
for every platform; the arena limit is glibc's own and costs nothing measurable here.
"""
from __future__ import annotations

import os

HOST_ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "2"}


def allocator_env() -> dict[str, str]:
    """The allocator variables for a new process: ours, or the value the user exported."""
    return {k: os.environ.get(k, v) for k, v in HOST_ALLOCATOR_ENV.items()}


def actor_runtime_env(env_vars: dict[str, str] | None = None) -> dict:
    """A Ray `runtime_env` that starts an actor's process with the allocator settings (and `env_vars`)."""
    return {"env_vars": {**allocator_env(), **(env_vars or {})}}


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (the kernel's high-water mark, what an out-of-memory kill
    looks at): each stage reports it, so a worker whose memory keeps growing shows in the step record."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)   # bytes on macOS, KiB on Linux
