"""What a vLLM engine leaves in /dev/shm when its processes die, and how the driver removes it.

Why this exists: vLLM's multi-process mode (tensor_parallel_size > 1 on CPU, `mp` executor) talks to
its TP worker processes through POSIX shared memory it creates itself: `psm_<random hex>` segments
(its message queues: one the engine writes, one per worker that the worker writes, and the TP
group's own broadcast buffer; up to ~251 MB apparent each) and `sem.mp-<random>` named semaphores
(multiprocessing locks of the spawn context); on the CPU the TP group's all-reduce buffers too
(`vllm_dist_<hex>-tp:0-[0-1]-cpushm_<rank>`, 4 MiB each, from its CPU communicator). A clean
`close()` unlinks them, and so does Python's multiprocessing resource tracker when the process that
created them exits. An abnormal end (SIGTERM
or SIGINT to the whole process group, kill -9 of the rollout actor or of a TP worker, a crash) kills
the resource tracker too, or leaves a dead worker's segment behind, and the names carry no pid and
no run: nothing else can tell whose they are.

So the engine keeps a *record* while it lives (`ShmRecorder`): the /dev/shm objects that its own
process and its descendants (the vLLM workers) have mapped or open, each with its inode, plus those
processes (pid and start time). The record is one small JSON file,
`/dev/shm/mindspeed_rl-shm-record-<engine pid>.json`, rewritten every second while vLLM builds (a
kill during the 24 s build still leaves a record) and once at the end of the build. `close()` sweeps
its own record. The driver, which knows its workers' pids, calls `remove_vllm_shm(pids, ...)` at
shutdown: for each record of those pids it waits (bounded) for the engine's process to be gone,
SIGKILLs the recorded vLLM workers that outlived it (same pid AND same start time: never a reused
pid), and unlinks each recorded file whose inode is still the recorded one (a name reused by another
run is another file). Nothing is ever removed by pattern: another run's `psm_*` stays.

Linux only (/proc); elsewhere every function does nothing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
RECORD_PREFIX = "mindspeed_rl-shm-record-"
# the objects vLLM's mp executor and multiprocessing create; the trainer's own files (the dock's
# msrl-*, the engine's pid-named weight files) have their own cleanup and are not recorded
RECORDED_PREFIXES = ("psm_", "sem.", "vllm_dist_")   # vllm_dist_*-cpushm_<rank>: the CPU TP group's all-reduce
WEIGHT_FILE_PREFIX = "mindspeed_rl-vllm-weights-"  # vllm_weights.SHM_PREFIX (pid-named, removed by pid)
# the processes a record lists (and a cleanup may SIGKILL): vLLM's workers name themselves so
# (`VLLM::Worker_TP0`, multiprocessing's `VllmWorker-0` before the title is set); other children of
# the engine's process (multiprocessing's resource tracker, a compile worker) are not the engine's
WORKER_NAME_PREFIXES = ("VLLM", "VllmWorker")
SCAN_INTERVAL_S = 1.0
POLL_S = 0.05


# ---------------------------------------------------------------------------------------- /proc
def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 on (after the command name, which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat): with the
    pid, what identifies one process (pids are reused, this pair is not); None when it is gone."""
    fields = _stat_fields(pid)
    if not fields or fields[0] == "Z":  # a zombie is dead: only its exit status is left
        return None
    return int(fields[19])


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def ticks_to_epoch(ticks: int) -> float:
    """A /proc start time in seconds since the epoch (to compare with time.time())."""
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")


def same_process_alive(pid: int, ticks: int | None) -> bool:
    """Whether `pid` is alive and is still the process that started at `ticks`."""
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def children_map() -> dict[int, list[int]]:
    """ppid -> child pids of every process this user can see (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields:
                out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """All processes below `pid` (children, their children, ...), parents first."""
    tree = children_map() if tree is None else tree
    out, todo = [], list(tree.get(pid, ()))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(tree.get(p, ()))
    return out


def _shm_device() -> tuple[int, int] | None:
    try:
        st = os.stat(SHM_DIR)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev)


def shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm objects `pid` maps or holds open. By inode, not name: glibc's
    `sem_open` maps a temporary `sem.XXXXXX` and renames it by a link, so the map shows the deleted
    temporary name of what is `sem.mp-*` in the directory."""
    dev = _shm_device()
    inodes: set[int] = set()
    if dev is None:
        return inodes
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                    major, _, minor = parts[3].partition(":")
                    if (int(major, 16), int(minor, 16)) == dev:
                        inodes.add(int(parts[4]))
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_DIR + "/"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (os.major(st.st_dev), os.minor(st.st_dev)) == dev:
                        inodes.add(st.st_ino)
    return inodes


def shm_objects(pids: Iterable[int], prefixes: tuple[str, ...] = RECORDED_PREFIXES) -> dict[str, int]:
    """name -> inode of the /dev/shm objects (names starting with `prefixes`) that any of `pids`
    maps or holds open."""
    inodes: set[int] = set()
    for pid in pids:
        inodes |= shm_inodes(pid)
    out = {}
    if inodes:
        with contextlib.suppress(OSError):
            for entry in os.scandir(SHM_DIR):
                if entry.name.startswith(prefixes) and entry.inode() in inodes:
                    out[entry.name] = entry.inode()
    return out


def _proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def record_path(owner_pid: int, record_dir: str = SHM_DIR) -> Path:
    return Path(record_dir) / f"{RECORD_PREFIX}{int(owner_pid)}.json"


# ---------------------------------------------------------------------------------------- record
class ShmRecorder:
    """Keeps the record of what the engine in `owner_pid` (default: this process) and its
    descendants have in /dev/shm (see the module docstring). `start()` rescans every
    `interval_s` in a daemon thread (while vLLM builds), `stop()` scans once more and stops,
    `scan()` scans now; a name once seen stays in the record (with the inode it had), so a
    segment that a worker created and then died with is still listed."""

    def __init__(self, owner_pid: int | None = None, record_dir: str = SHM_DIR, interval_s: float = SCAN_INTERVAL_S):
        self.owner = int(owner_pid if owner_pid is not None else os.getpid())
        self.path = record_path(self.owner, record_dir)
        self.interval_s = float(interval_s)
        self.files: dict[str, int] = {}
        self.processes: dict[int, dict] = {}
        self._owner_ticks = start_ticks(self.owner)
        self._ignore: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._owner_ticks is not None and os.path.isdir(SHM_DIR)

    def scan(self) -> dict:
        """Scan the owner and its descendants now, merge into the record, rewrite the file."""
        if not self.enabled:
            return {}
        with self._lock:
            changed = False
            pids = [self.owner] + descendants(self.owner)
            for pid in pids[1:]:
                if pid not in self.processes:
                    ticks, name = start_ticks(pid), _proc_name(pid)
                    if ticks is not None and name.startswith(WORKER_NAME_PREFIXES):
                        self.processes[pid] = {"pid": pid, "start": ticks, "name": name}
                        changed = True
            for name, ino in shm_objects(pids).items():
                if name not in self.files and (name, ino) not in self._ignore:
                    self.files[name] = ino
                    changed = True
            record = self._record()
            if changed or not self.path.exists():
                self._write(record)
            return record

    def _record(self) -> dict:
        return {"owner": {"pid": self.owner, "start": self._owner_ticks,
                          "start_epoch": ticks_to_epoch(self._owner_ticks)},
                "processes": sorted(self.processes.values(), key=lambda p: p["pid"]),
                "files": dict(sorted(self.files.items()))}

    def _write(self, record: dict) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)  # a reader never sees half a record
        except OSError as e:  # /dev/shm full or read-only: the engine runs on, unrecorded
            logger.warning("shm record %s not written: %s", self.path, e)

    def start(self, ignore_existing: bool = False) -> "ShmRecorder":
        """Scan now and every `interval_s` until `stop()`. `ignore_existing`: objects the process
        tree holds already are not the engine's about to be built (never recorded)."""
        if self.enabled and self._thread is None:
            if ignore_existing:
                self._ignore = set(shm_objects([self.owner] + descendants(self.owner)).items())
            self._stop.clear()
            self.scan()
            self._thread = threading.Thread(target=self._loop, name="mindspeed_rl-shm-recorder", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.scan()

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(self.interval_s + 5)
            self._thread = None
        return self.scan()

    def sweep(self) -> list[str]:
        """After the engine shut down (this process lives on): kill recorded workers that outlived
        it, unlink the recorded objects still there, drop the record. Returns what was removed."""
        if self._thread is not None:
            self.stop()
        with self._lock:
            record = self._record() if self.enabled else None
        if record is None:
            return []
        removed = _remove_record(record, wait_s=0.0, owner_may_live=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return removed


# ---------------------------------------------------------------------------------------- removal
def _kill_and_wait(procs: list[dict], wait_s: float) -> None:
    alive = [p for p in procs if same_process_alive(p["pid"], p.get("start"))]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p["pid"], signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if same_process_alive(p["pid"], p.get("start"))]
        time.sleep(POLL_S)


def _remove_record(record: dict, wait_s: float, owner_may_live: bool = False) -> list[str]:
    """Remove one record's leftovers (see `remove_vllm_shm`); [] when its owner still lives."""
    owner = record["owner"]
    if not owner_may_live:
        deadline = time.monotonic() + wait_s
        while same_process_alive(owner["pid"], owner.get("start")):
            if time.monotonic() >= deadline:
                logger.warning("shm cleanup: process %s still runs after %.0f s; its /dev/shm objects are left "
                               "to it", owner["pid"], wait_s)
                return []
            time.sleep(POLL_S)
    _kill_and_wait(list(record.get("processes", ())), wait_s=5.0)  # the maps die with the workers
    removed = []
    for name, ino in record.get("files", {}).items():
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_ino != ino:
                continue  # the name now belongs to another object (another run): not ours
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("shm cleanup: cannot remove %s: %s", path, e)
    for path in Path(SHM_DIR).glob(f"{WEIGHT_FILE_PREFIX}{int(owner['pid'])}-*"):  # a reload cut short
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(str(path))
    return removed


def remove_vllm_shm(pids: Iterable[int], *, started_after: float | None = None, wait_s: float = 10.0,
                    record_dir: str = SHM_DIR) -> list[str]:
    """Remove the /dev/shm objects that vLLM engines in processes `pids` (and their TP workers)
    created and left behind. Call it when those processes are ended or being ended (the driver: at
    shutdown, after `ray.kill` of its workers, with the pids its workers reported at start).

    For each pid that has a record (only vLLM engines with tensor_parallel_size > 1 write one):
    - skipped if the record's process started before `started_after` (seconds since the epoch;
      the driver passes its own start time): an older run's engine that had the same pid;
    - waits up to `wait_s` for that process to be gone (ray.kill returns before the process ends);
      if it still runs, its objects are left to it (never removed under a live engine);
    - SIGKILLs its recorded vLLM workers still alive (same pid and start time), then unlinks each
      recorded object whose inode is the recorded one, and the engine's pid-named weight files;
    - removes the record.
    Returns the paths removed. Never raises for a missing or unreadable record.
    """
    removed: list[str] = []
    for pid in dict.fromkeys(int(p) for p in pids):
        path = record_path(pid, record_dir)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            logger.warning("shm cleanup: unreadable record %s: %s", path, e)
            continue
        owner = record.get("owner", {})
        if started_after is not None and owner.get("start_epoch", 0.0) < started_after - 1.0:
            continue  # 1 s: /proc start times have clock-tick resolution, boot time whole seconds
        done = _remove_record(record, wait_s)
        if done or not same_process_alive(pid, owner.get("start")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed += done
    return removed
