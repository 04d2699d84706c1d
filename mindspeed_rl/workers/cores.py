"""A worker's threads shared among the stages computing in it at once.

Ray runs an actor's calls on threads of its pool, so a worker hosting several MFCs (rollout and training in
one process, colocated placement) runs their stages at the same time when the step overlaps them
(`rl_config.blocking: false`). torch's intra-op thread count belongs to the calling thread: two stages that
each set the worker's `torch_threads` keep twice as many busy threads as the worker has cores, and OpenMP
threads spinning on shared cores slow both. A stage computing a micro-batch takes an equal share of the
worker's threads among the stages computing at that moment (one waiting on the dock for its inputs counts
for none), set when its micro-batch starts.
"""
from __future__ import annotations

import os
import threading

import torch


def thread_share(threads: int, computing: int) -> int:
    """One stage's intra-op threads when `computing` stages share a worker's `threads` (at least one each)."""
    return max(1, threads // max(1, computing))


class CoreShare:
    def __init__(self, threads: int):
        self.threads = threads
        self._computing: set[int] = set()   # the stage threads computing a micro-batch
        self._lock = threading.Lock()

    @classmethod
    def of_calling_thread(cls) -> "CoreShare":
        """A share of the calling thread's torch threads, for a stage that runs alone."""
        return cls(torch.get_num_threads())

    def computing(self) -> None:
        """The calling stage starts a micro-batch: count it, and set its share of the threads."""
        with self._lock:
            self._computing.add(threading.get_ident())
            n = len(self._computing)
        torch.set_num_threads(thread_share(self.threads, n))

    def waiting(self) -> None:
        """The calling stage waits (for the dock's next micro-batch, or its stage is over): it counts for none."""
        with self._lock:
            self._computing.discard(threading.get_ident())


def bind_process(cores: list[int]) -> None:
    """Every thread of this process to `cores` (placement.groups.<g>.cpu_affinity), so that two groups on
    disjoint cores never share one. sched_setaffinity binds one thread: Ray's and gRPC's threads, started before
    the actor's constructor runs, are bound one by one; threads and processes started later inherit the mask."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
