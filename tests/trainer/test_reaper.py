"""trainer/reaper.py for real: a driver process starts the reaper, then Ray (or a stand-in process
tree naming a Ray session), and is killed with SIGKILL; the reaper must end the session's processes
and remove the /dev/shm objects recorded in them, and leave alone what is not the session's (a
process the driver had started before, a process elsewhere, another run's segment)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from mindspeed_rl.engines.sync.shm_cleanup import record_path, same_process_alive, start_ticks
from mindspeed_rl.trainer.reaper import SESSION_RE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/dev/shm"),
                                 reason="Linux /proc and /dev/shm needed")]

# a grandchild that records a segment of its own as a vLLM engine does, and whose tracker is gone
OWNER = r"""
import json, sys, time
from multiprocessing import resource_tracker, shared_memory
from mindspeed_rl.engines.sync.shm_cleanup import ShmRecorder
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(seg._name, "shared_memory")   # as when the tracker was killed too
ShmRecorder().scan()
print(seg.name, flush=True)
time.sleep(300)
"""

# stand-in Ray: a "raylet" whose command line names a session, with a child that does not (a worker)
FAKE_DRIVER = r"""
import json, os, subprocess, sys, time
from mindspeed_rl.trainer.reaper import start_reaper
before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])   # not the session's
reaper = start_reaper(interval_s=0.2)
session = f"session_2026-01-01_00-00-00_000000_{os.getpid()}"
raylet = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "w = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE); "
                           "print(w.pid, w.stdout.readline().decode().strip(), flush=True); time.sleep(300)",
                           sys.argv[1], "--session-name=" + session], stdout=subprocess.PIPE)
worker, seg = raylet.stdout.readline().decode().split()
time.sleep(1.0)   # a few polls of the reaper
print(json.dumps({"reaper": reaper.pid, "before": before.pid, "raylet": raylet.pid, "worker": int(worker),
                  "seg": seg, "mode": sys.argv[2]}), flush=True)
if sys.argv[2] == "clean":   # a driver that ends its session itself, then stops the reaper
    raylet.kill(); raylet.wait(); os.kill(int(worker), 9)
    print(json.dumps({"reaper_exit": reaper.stop(60)}), flush=True)
time.sleep(300)
"""

RAY_DRIVER = r"""
import json, os, sys, time
from mindspeed_rl.trainer.reaper import start_reaper
reaper = start_reaper(interval_s=0.5)
import ray
try:
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
except Exception as e:   # Ray's own start-up limits (30 s for the raylet) on an overloaded machine
    print(json.dumps({"ray_init_failed": f"{type(e).__name__}: {e}"}), flush=True)
    raise

@ray.remote
class Engine:
    def start(self, owner_code):
        import subprocess
        self.owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE)
        return os.getpid(), self.owner.pid, self.owner.stdout.readline().decode().strip()

e = Engine.remote()
actor, owner, seg = ray.get(e.start.remote(sys.argv[1]), timeout=240)
print(json.dumps({"reaper": reaper.pid, "actor": actor, "owner": owner, "seg": seg}), flush=True)
time.sleep(600)
"""


class _Child:
    """A process started for the test with its JSON lines on a queue (bounded reads)."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in iter(self.proc.stdout.readline, b"")],
                         daemon=True).start()

    def json(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"pid {self.proc.pid} said nothing within {timeout} s "
                                     f"(exit code {self.proc.poll()})") from None
            if text.startswith(b"{"):
                return json.loads(text)


def _wait_gone(pids: dict[int, int | None], timeout: float) -> list[int]:
    """Wait until none of `pids` (pid -> start ticks) lives; returns those still alive at the end."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if same_process_alive(p, pids[p])]
        time.sleep(0.1)
    return alive


def _session_processes(session: bytes) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if session in f.read():
                        out.append(int(entry.name))
            except OSError:
                pass
    return out


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_kill_9_of_the_driver_ends_its_session_and_removes_its_shared_memory(foreign_segment):
    child = _Child([FAKE_DRIVER, OWNER, "kill"])
    info = {}
    try:
        info = child.json(120)
        ticks = {p: start_ticks(p) for p in (info["reaper"], info["before"], info["raylet"], info["worker"])}
        seg = Path("/dev/shm") / info["seg"]
        assert seg.exists() and record_path(info["worker"]).exists()
        child.proc.kill()  # SIGKILL of the driver alone
        child.proc.wait(30)
        assert _wait_gone({p: ticks[p] for p in (info["raylet"], info["worker"], info["reaper"])}, 60) == [], \
            "the session's processes are ended, and the reaper exits"
        assert not seg.exists() and not record_path(info["worker"]).exists()
        assert same_process_alive(info["before"], ticks[info["before"]]), "started before the reaper: not ours"
        assert foreign_segment.exists()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
        _kill(info.get(k) for k in ("before", "raylet", "worker") if info.get(k))
        if info.get("seg"):
            Path("/dev/shm", info["seg"]).unlink(missing_ok=True)
            record_path(info["worker"]).unlink(missing_ok=True)


def test_after_a_clean_shutdown_the_reaper_exits_and_kills_nothing():
    child = _Child([FAKE_DRIVER, OWNER, "clean"])
    info = {}
    try:
        info = child.json(120)
        assert child.json(90) == {"reaper_exit": 0}
        assert same_process_alive(info["before"], None)
        assert child.proc.poll() is None, "the driver lives on"
    finally:
        child.proc.kill()
        child.proc.wait(30)
        _kill(info.get(k) for k in ("before", "raylet", "worker") if info.get(k))
        if info.get("seg"):
            Path("/dev/shm", info["seg"]).unlink(missing_ok=True)
            record_path(info["worker"]).unlink(missing_ok=True)


def test_kill_9_of_a_real_ray_driver_ends_rays_processes():
    """A real `ray.init` (GCS, raylet, log monitor, the dashboard and runtime-env agents, an actor and
    a process below it with a recorded segment): after SIGKILL of the driver, no process naming its
    session is left, nor the actor and its child, nor the segment (without the reaper, the agents
    linger about a minute and the rest until they notice)."""
    pytest.importorskip("ray")
    child = _Child([RAY_DRIVER, OWNER])
    info, session = {}, None
    try:
        info = child.json(300)
        assert "ray_init_failed" not in info, f"Ray did not start, nothing to test: {info}"
        for entry in os.scandir("/proc"):  # the session's name, from a Ray process's command line
            if entry.name.isdigit():
                try:
                    m = SESSION_RE.search(Path(f"/proc/{entry.name}/cmdline").read_bytes())
                except OSError:
                    continue
                if m and m.group().endswith(b"_%d" % child.proc.pid):
                    session = m.group()
                    break
        assert session is not None, "ray.init names its session after the driver's pid"
        ray_procs = _session_processes(session)
        assert len(ray_procs) >= 3, ray_procs  # gcs_server, raylet, log monitor, ...
        watched = {p: start_ticks(p) for p in ray_procs + [info["actor"], info["owner"], info["reaper"]]}
        child.proc.kill()
        child.proc.wait(30)
        assert _wait_gone(watched, 60) == [], "Ray's processes, the actor, its child and the reaper are gone"
        assert _session_processes(session) == []
        assert not Path("/dev/shm", info["seg"]).exists() and not record_path(info["owner"]).exists()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
        if session is not None:
            _kill(_session_processes(session))
        if info.get("seg"):
            _kill([info["owner"]])
            Path("/dev/shm", info["seg"]).unlink(missing_ok=True)
            record_path(info["owner"]).unlink(missing_ok=True)
