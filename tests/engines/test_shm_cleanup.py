"""engines/sync/shm_cleanup.py with real processes and real /dev/shm objects: an "engine" process records
a shared-memory segment and a named semaphore of its own and a segment of its "vLLM worker" (a
grandchild named VLLM::Worker_TP1), is killed with SIGKILL together with its process group (as
Ctrl-C / SIGTERM to a run's group or a crash does: no resource tracker survives to unlink), and
`remove_vllm_shm` must remove exactly those objects, end the worker that outlived it, and leave
another run's segment, a live engine's objects and a reused name alone. The vLLM engine itself is
tested the same way in test_vllm_rollout_tp.py."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from mindspeed_rl.engines.sync import shm_cleanup
from mindspeed_rl.engines.sync.shm_cleanup import ShmRecorder, record_path, remove_vllm_shm, same_process_alive, start_ticks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/dev/shm"),
                                 reason="Linux /proc and /dev/shm needed")]

WORKER = r"""
import ctypes, sys, time
from multiprocessing import resource_tracker, shared_memory
ctypes.CDLL(None).prctl(15, b"VLLM::Worker_TP1", 0, 0, 0)   # PR_SET_NAME, as vLLM names its workers
seg = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(seg._name, "shared_memory")   # vLLM's workers use their parent's tracker
print(seg.name, flush=True)
time.sleep(300)
"""

ENGINE = r"""
import json, os, subprocess, sys, time
from multiprocessing import get_context, resource_tracker, shared_memory
from mindspeed_rl.engines.sync.shm_cleanup import ShmRecorder
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
lock = get_context("spawn").Lock()                # a named semaphore, /dev/shm/sem.mp-*
# the whole group is killed below, its resource tracker with it: nothing unlinks these afterwards
resource_tracker.unregister(seg._name, "shared_memory")
resource_tracker.unregister(lock._semlock.name, "semaphore")
# the worker in its own session: it outlives the kill of this group (vLLM's workers end on their
# death pipe, a moment later or, when stuck, not at all)
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, start_new_session=True)
wseg = worker.stdout.readline().decode().strip()
record = ShmRecorder().start().stop()
print(json.dumps({"seg": seg.name, "sem": "sem." + lock._semlock.name.lstrip("/"), "wseg": wseg, "worker": worker.pid,
                  "record": record}), flush=True)
time.sleep(300)
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from pid {proc.pid} within {timeout} s"
    return proc.stdout.readline().decode()


def _wait_gone(pid: int, ticks: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while same_process_alive(pid, ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_engine_group_leaves_exactly_its_objects_and_they_are_removed(foreign_segment):
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, WORKER], stdout=subprocess.PIPE, start_new_session=True)
    worker = None
    try:
        info = json.loads(_readline(proc, 120))
        worker, worker_ticks = info["worker"], start_ticks(info["worker"])
        ours = {Path("/dev/shm") / info[k] for k in ("seg", "sem", "wseg")}
        record = info["record"]
        assert {info["seg"], info["sem"], info["wseg"]} <= set(record["files"]), record
        assert [p["pid"] for p in record["processes"]] == [worker], "the VLLM-named worker, and only it"
        assert record_path(proc.pid).is_file()

        os.killpg(proc.pid, signal.SIGKILL)  # the engine, its resource tracker: its whole group
        proc.wait(30)
        assert all(p.exists() for p in ours), "the leak this module is for: nothing unlinked them"
        assert same_process_alive(worker, worker_ticks), "the worker outlived its engine"

        # a record whose process started before the run that asks is another run's: untouched
        assert remove_vllm_shm([proc.pid], started_after=time.time() + 3600) == []
        assert all(p.exists() for p in ours) and record_path(proc.pid).is_file()

        removed = remove_vllm_shm([proc.pid, os.getpid(), 999999999], started_after=t0, wait_s=10)
        assert {Path(p) for p in removed} == ours
        assert not any(p.exists() for p in ours)
        assert _wait_gone(worker, worker_ticks, 10), "the worker that outlived its engine is ended"
        assert not record_path(proc.pid).exists()
        assert foreign_segment.exists(), "another run's segment stays"
        assert remove_vllm_shm([proc.pid]) == [], "done once: nothing is left to do"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if worker is not None and same_process_alive(worker, None):
            os.kill(worker, signal.SIGKILL)
        record_path(proc.pid).unlink(missing_ok=True)


def test_a_live_engine_and_a_reused_name_are_left_alone(tmp_path):
    seg = shared_memory.SharedMemory(create=True, size=4096)
    path = Path("/dev/shm") / seg.name
    rec = ShmRecorder(record_dir=str(tmp_path))  # this process as the engine
    try:
        assert seg.name in rec.scan()["files"]
        # the engine still runs: its objects and its record stay, after a bounded wait
        t0 = time.monotonic()
        assert remove_vllm_shm([os.getpid()], wait_s=0.3, record_dir=str(tmp_path)) == []
        assert time.monotonic() - t0 < 30 and path.exists() and rec.path.exists()
        # the recorded segment goes, another object takes its name (another run): not ours to remove
        seg.close()
        seg.unlink()
        resource_tracker.unregister(seg._name, "shared_memory")  # a plain file below, nothing to track
        path.write_bytes(b"another run's object")
        assert rec.sweep() == []
        assert path.exists() and not rec.path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_recorder_lists_only_vllm_named_children_and_shm_objects():
    """What `scan` reads from /proc: the dock's files and other children are not the engine's."""
    seg = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert shm_cleanup.shm_objects([os.getpid()]).get(seg.name) == os.stat(f"/dev/shm/{seg.name}").st_ino
        assert seg.name not in shm_cleanup.shm_objects([os.getpid()], ("msrl-",)), "by prefix"
    finally:
        seg.close()
        seg.unlink()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = ShmRecorder(record_dir="/tmp")
        _wait = time.monotonic() + 10
        while child.pid not in shm_cleanup.descendants(os.getpid()) and time.monotonic() < _wait:
            time.sleep(0.05)
        assert child.pid in shm_cleanup.descendants(os.getpid())
        assert all(p["pid"] != child.pid for p in rec.scan()["processes"]), "a plain child is not a vLLM worker"
    finally:
        child.kill()
        child.wait(10)
        ShmRecorder(record_dir="/tmp").path.unlink(missing_ok=True)
