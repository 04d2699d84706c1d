"""One clean-up process per node of a cluster the driver joined: when the run's processes on that node are
all gone, it removes what they left in that node's /dev/shm.

Why: each machine has its own /dev/shm. The run's processes put things there that outlive a process killed
without a chance to close: the TransferDock's segments and socket (`transfer_dock/shm.py`, on the driver's
node) and what vLLM's tensor-parallel engines create (`engines/sync/shm_cleanup.py`, on the nodes of their
workers). On a cluster the driver joined (`placement.ray_address`), a killed driver is noticed by Ray,
which ends the job's actors on every node; the driver's own reaper (`reaper.py`) is not started there (that
cluster is not the driver's to end) and would see only the driver's host anyway.

How: right after the workers start, `start_node_sweepers` asks one of the run's actors on each node that hosts
a worker or the dock (no new process for Ray to start) to read each of that node's pids' start time (a pid
with its start time is one process; pids are reused) and start this file as a plain-Python process (no
torch, no Ray) detached from the actor (a session of its own, reparented by a double fork), so it outlives
the actor, the job and the driver. The sweeper polls /proc every second; once none of its processes is
alive, whatever ended them (the run's end, a crash, kill -9 of the driver), it removes vLLM's recorded
objects of those pids and the files of docks that lived in them, prints what it removed to its node's log
when anything was, and exits. After a clean end there is nothing left to remove and it exits quietly.
Linux only (/proc); elsewhere no sweeper starts.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable, Mapping

INTERVAL_S = 1.0
SHM_WAIT_S = 5.0


def start_node_sweepers(on_node: Mapping[str, tuple[Any, list[int]]], get: Callable) -> dict[str, int | None]:
    """on_node: node id -> (an actor of the run there, the run's pids there); a sweeper started by each actor;
    returns node id -> sweeper pid. `get` is the driver's bounded ray.get."""
    started = time.time()
    nodes = list(on_node)
    refs = [on_node[n][0].__ray_call__.remote(_start_in_actor, sorted(set(on_node[n][1])), started) for n in nodes]
    return dict(zip(nodes, get(refs, "starting the per-node /dev/shm sweepers")))


def _start_in_actor(_actor: Any, pids: list[int], started_after: float) -> int | None:
    return _start_here(pids, started_after)


def _start_here(pids: list[int], started_after: float) -> int | None:
    """Start this node's sweeper for `pids`; its pid, or None without /proc."""
    import subprocess
    if not os.path.isdir("/proc/self"):
        return None
    watched = []
    for pid in pids:
        ticks = _start_ticks(pid)
        if ticks is not None:
            watched.append(f"{pid}:{ticks}")
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(w), repr(started_after), *watched],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                            pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        sweeper = int(f.read() or 0)     # the detached grandchild's pid
    proc.wait()
    return sweeper or None


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return int(data[data.rfind(")") + 2:].split()[19])


def _sweep(watched: dict[int, int], started_after: float) -> list[str]:
    """Wait until none of `watched` (pid -> start ticks) is alive, then remove what they left."""
    import reaper   # this file's folder is on sys.path: the reaper's dock-file removal, without the package
    shm = reaper._load_shm_cleanup()
    while any(shm.same_process_alive(p, t) for p, t in watched.items()):
        time.sleep(INTERVAL_S)
    removed = shm.remove_vllm_shm(watched, started_after=started_after, wait_s=SHM_WAIT_S)
    return removed + reaper._remove_dock_files(set(watched))


def _main(argv: list[str]) -> int:
    w, started_after = int(argv[0]), float(argv[1])
    watched = {int(p): int(t) for p, t in (x.split(":") for x in argv[2:])}
    if os.fork():                       # the parent returns to the task at once; the child is reparented
        os.close(w)
        return 0
    os.write(w, str(os.getpid()).encode())
    os.close(w)
    with contextlib.suppress(Exception):
        removed = _sweep(watched, started_after)
        if removed:
            print(f"mindspeed_rl node sweeper: the run's processes {sorted(watched)} on this node are gone; removed "
                  f"{len(removed)} /dev/shm object(s) they left", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(_main(sys.argv[1:]))
