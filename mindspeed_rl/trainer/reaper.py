"""A watchdog process that ends what the driver's Ray session left behind when the driver dies.

Why: the driver shuts Ray down itself on every end it sees (a finished run, an error, SIGINT,
SIGTERM). kill -9 of the driver is the one it cannot see: Ray's processes (GCS, raylet, the
dashboard and runtime-env agents, the worker actors, and vLLM's TP workers below them) lose their
parent and linger (the agents about 60 s; the rest until they notice), and what vLLM put in /dev/shm
stays (engines/sync/shm_cleanup.py).

How: `start_reaper()`, called by the driver right before it starts Ray itself (never with
`placement.ray_address`: that cluster is not the driver's to end), starts this file as a separate
process (plain Python, no torch: it starts in a fraction of a second and holds a few MB), in its own
session so that a Ctrl-C or a signal to the driver's process group does not reach it. The driver
keeps the write end of a pipe to it; the reaper

- polls /proc every `interval_s`: every descendant of the driver started after `start_reaper()`
  (older ones are never its business) whose command line names a Ray session
  (`session_<date>_<micro>_<pid>`: GCS, raylet, log monitor, agents) is a root, and it and all its
  descendants (Ray's workers, vLLM's TP workers) are the session's processes, each kept as (pid,
  start time), so a reused pid is never taken for one of them;
- on end of file of the pipe (the driver died, however, or called `Reaper.stop()` after its own
  shutdown), SIGKILLs those of them still alive, with their current descendants and any process
  whose command line names the session (or, when no poll saw one because the driver was killed
  first, a session of the driver's own pid, as Ray ends the name with the pid of the process that
  called `ray.init`, named by a process started after `start_reaper()`), waits (bounded) for them
  to be gone, then removes their /dev/shm leftovers: vLLM's recorded objects
  (`shm_cleanup.remove_vllm_shm`) and the TransferDock files of docks that lived in them
  (`transfer_dock/shm.py` names them `msrl-<tag>-gen-<dock pid>` / `msrl-<tag>-sock-<dock pid>`;
  mirrored here, so the reaper need not import torch). A reaper serves one `ray.init`: the first
  session it sees.

After a clean shutdown nothing of the session is left and the reaper exits having killed nothing.
Linux only (/proc); elsewhere `start_reaper()` returns None.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 1.0
KILL_WAIT_S = 10.0
SHM_WAIT_S = 5.0
SESSION_RE = re.compile(rb"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")
DOCK_PREFIX = "msrl-"  # transfer_dock/shm.py PREFIX
DOCK_MARKERS = ("-gen-", "-sock-")


class Reaper:
    """The driver's handle: keep it for the run; `stop()` after the driver's own shutdown."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """The driver is done (Ray shut down): the reaper ends what is left, if anything, and exits.
        Waits for it up to `timeout` s; returns its exit code (None if it is still going)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def start_reaper(interval_s: float = INTERVAL_S) -> Reaper | None:
    """Start the reaper for this process (see the module docstring). Call it before `ray.init`
    (only when this process starts Ray itself); keep the handle and call `stop()` after
    `ray.shutdown()`. None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(interval_s),
                             repr(time.time()), str(_now_ticks()), str(_own_start_ticks())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return Reaper(proc)


def _now_ticks() -> int:
    """Now, in the unit and clock of /proc/<pid>/stat's start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _own_start_ticks() -> int:
    with open("/proc/self/stat", "rb") as f:
        data = f.read().decode(errors="replace")
    return int(data[data.rfind(")") + 2:].split()[19])


# ------------------------------------------------------------------------------------ the reaper process
def _load_shm_cleanup():
    """engines/sync/shm_cleanup.py by path: importing the package would import torch (seconds, 300 MB)."""
    path = Path(__file__).resolve().parents[1] / "engines" / "sync" / "shm_cleanup.py"
    spec = importlib.util.spec_from_file_location("_mindspeed_rl_shm_cleanup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class _Watch:
    """The state of the reaper process: what it has seen of the driver's Ray session."""

    def __init__(self, driver: int, started: float, launch_ticks: int, driver_ticks: int, shm):
        self.shm = shm
        self.driver = driver
        self.driver_ticks = driver_ticks
        self.started = started            # time.time() at start_reaper(): for the shm records
        self.launch_ticks = launch_ticks  # processes started before start_reaper() are not the session's
        self.me = os.getpid()
        self.members: dict[int, int] = {}   # pid -> start ticks: the session's processes
        self.sessions: set[bytes] = set()

    def poll(self) -> None:
        shm = self.shm
        tree = shm.children_map()
        for p in shm.descendants(self.driver, tree):
            ticks = shm.start_ticks(p)
            if ticks is None or p == self.me or ticks < self.launch_ticks:
                continue
            if p in self.members and self.members[p] == ticks:
                continue
            m = SESSION_RE.search(_cmdline(p))
            if m and (not self.sessions or m.group() in self.sessions):  # one reaper, one ray.init
                self.sessions.add(m.group())
                self.members[p] = ticks
        self._add_descendants(tree)

    def _add_descendants(self, tree) -> None:
        shm = self.shm
        for root in list(self.members):
            if not shm.same_process_alive(root, self.members[root]):
                continue
            for d in shm.descendants(root, tree):
                ticks = shm.start_ticks(d)
                if ticks is not None and d != self.me:
                    self.members.setdefault(d, ticks)

    def _session_processes(self) -> None:
        """Processes naming the session, that the tree walk missed (reparented before a poll saw
        them); when no poll saw the session (the driver died first): processes started after
        `start_reaper()` naming a session of the driver's pid."""
        own = b"_%d" % self.driver
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self.members or int(entry.name) == self.me:
                continue
            cmd = _cmdline(int(entry.name))
            m = SESSION_RE.search(cmd)
            if m is None:
                continue
            ticks = self.shm.start_ticks(int(entry.name))
            if ticks is None:
                continue
            if (m.group() in self.sessions if self.sessions
                    else m.group().endswith(own) and ticks >= self.launch_ticks):
                self.members[int(entry.name)] = ticks

    def reap(self) -> dict:
        shm = self.shm
        with contextlib.suppress(Exception):
            self._session_processes()
        with contextlib.suppress(Exception):
            self._add_descendants(shm.children_map())
        alive = {p: t for p, t in self.members.items() if shm.same_process_alive(p, t)}
        for p in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while alive and time.monotonic() < deadline:
            alive = {p: t for p, t in alive.items() if shm.same_process_alive(p, t)}
            time.sleep(0.05)
        removed = shm.remove_vllm_shm(self.members, started_after=self.started, wait_s=SHM_WAIT_S)
        removed += _remove_dock_files(set(self.members))
        return {"killed": len(self.members) - len(alive), "left": sorted(alive), "removed": removed}


def _remove_dock_files(pids: set[int]) -> list[str]:
    """The files of the TransferDocks that lived in `pids` (transfer_dock/shm.py's naming)."""
    shm_dir = "/dev/shm"
    removed = []
    for marker in DOCK_MARKERS:
        for path in glob.glob(os.path.join(shm_dir, f"{DOCK_PREFIX}*{marker}*")):
            tag, _, pid = os.path.basename(path)[len(DOCK_PREFIX):].rpartition(marker)
            if pid.isdigit() and int(pid) in pids:
                for f in glob.glob(os.path.join(shm_dir, f"{DOCK_PREFIX}{tag}-*")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f)
                        removed.append(f)
    return removed


def _main(argv: list[str]) -> int:
    driver, interval, started, launch_ticks, driver_ticks = (int(argv[0]), float(argv[1]), float(argv[2]),
                                                             int(argv[3]), int(argv[4]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver
    shm = _load_shm_cleanup()
    watch = _Watch(driver, started, launch_ticks, driver_ticks, shm)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], interval)
        if ready and not os.read(stdin.fileno(), 4096):
            break  # end of file: the driver closed the pipe or died
        with contextlib.suppress(Exception):  # a process vanishing mid-scan is routine
            watch.poll()
        if not shm.same_process_alive(driver, driver_ticks):  # belt and braces, should the pipe be inherited
            break
    stopped_by_driver = shm.same_process_alive(driver, driver_ticks)  # Reaper.stop() after its own shutdown
    result = watch.reap()
    if not stopped_by_driver and (result["killed"] or result["removed"] or result["left"]):
        print(f"mindspeed_rl reaper: the driver (pid {driver}) is gone; ended {result['killed']} process(es) of its "
              f"Ray session, removed {len(result['removed'])} /dev/shm object(s)"
              + (f"; still alive: {result['left']}" if result["left"] else ""), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
