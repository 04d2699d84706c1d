"""The shared memory an IPC sync stages buckets in, and its clean-up.

A `Segment` is a /dev/shm file mapped into the sender (CPU) or a CUDA allocation with its IPC
handle; a `Registered` one is a CUDA storage the sender already holds (an adopted module's),
shared where it lies.

Cleanup. Segment files are named `msrl-ipc-<sender pid>-<sender counter>-s<slot>g<generation>`.
They are unlinked by `IPCSender.close()`, by a finalizer at interpreter exit, and, when the sender
is killed (SIGKILL runs no Python), by a small reaper process the sender starts with its first
segment: it blocks reading a pipe only the sender writes to, sees EOF when the sender dies, and
unlinks every file with the sender's prefix. `cleanup_stale()` (run by every new sender) also
removes files of any pid that no longer exists. A reader's mapping keeps the pages alive after an
unlink until it detaches (`IPCAttachments.close()`), as with any shared memory.
"""
from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import tempfile

import torch

from ...transfer_dock.shm import pid_alive


PREFIX = "msrl-ipc-"
_NAME_RE = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-")


def shm_dir() -> str:
    """Where CPU segments live: /dev/shm (tmpfs, RAM) where it exists, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Segment:
    """One staging buffer: a /dev/shm file mapped into this process (CPU) or a CUDA allocation
    with its IPC handle. `buf` is a 1-D uint8 tensor over all of it."""

    def __init__(self, name: str, capacity: int, device: torch.device):
        self.name, self.capacity, self.device = name, capacity, device
        self.cuda = None
        self._mm = None
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor   # lazy: CUDA only
            self.buf = torch.empty(capacity, dtype=torch.uint8, device=device)
            self.cuda = reduce_tensor(self.buf)
        elif device.type == "cpu":
            path = os.path.join(shm_dir(), name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, capacity)
                self._mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        else:
            raise ValueError(f"ipc sync: device {device} has no shared-memory transport (cpu or cuda)")

    def close(self) -> None:
        """Unlink the name and drop our references. The mapping is never closed by hand: tensors
        from `torch.frombuffer` hold the mmap object, which unmaps when the last of them dies
        (an adopted module's parameters keep working; closing it under them would crash)."""
        self.buf = None
        self.cuda = None
        if self._mm is not None:
            self._mm = None
            unlink(os.path.join(shm_dir(), self.name))


class Registered:
    """CUDA: a long-lived storage of the sender's (an adopted module's parameters) with its IPC
    handle, made once; holds the storage so its address cannot be reused while registered."""

    def __init__(self, name: str, storage):
        from torch.multiprocessing.reductions import reduce_tensor   # lazy: CUDA only
        self.name, self.capacity = name, storage.nbytes()
        self.buf = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
        self.cuda = reduce_tensor(self.buf)

    def close(self) -> None:
        self.buf = None
        self.cuda = None


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_REAPER = r"""
import glob, os, sys
d, p = sys.argv[1], sys.argv[2]
try:
    while sys.stdin.buffer.read(1 << 16):
        pass
except BaseException:
    pass
for f in glob.glob(os.path.join(glob.escape(d), glob.escape(p) + "*")):
    try:
        os.unlink(f)
    except OSError:
        pass
"""


def start_reaper(prefix: str) -> subprocess.Popen:
    """A process that unlinks `prefix`* when this one dies, however (it reads EOF on a pipe only
    this process holds open). Its own session, so a kill of our process group spares it; and not
    our child: `sh` starts it in the background (stdin through fd 3, as a background job's own
    stdin is /dev/null) and exits, so it is re-parented. A Ray actor's exit, ray.kill included,
    kills the actor's child processes (RAY_kill_child_processes_on_worker_exit, on by default),
    which took a direct-child reaper with it and left the segments behind in a trainer run.
    The returned Popen is that `sh` (already gone); closing its stdin lets the reaper go."""
    proc = subprocess.Popen(["sh", "-c", 'exec 3<&0; "$0" -S -c "$1" "$2" "$3" <&3 3<&- &',
                             sys.executable, _REAPER, shm_dir(), prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)
    proc.wait(timeout=30)   # the reaper runs on, holding the pipe's read end
    return proc


def finalize_segments(segments: dict, reaper: list, adopted: dict | None = None) -> None:
    """Close every segment (unlinking its file) and let the reaper go; safe to run twice. An
    adopted segment stays mapped while the module's parameters use it; only its name goes."""
    for seg in list(segments.values()) + list((adopted or {}).values()):
        seg.close()
    segments.clear()
    if adopted:
        adopted.clear()
    if reaper:
        proc = reaper.pop()
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except Exception:   # noqa: BLE001 - best effort at exit; the reaper still unlinks on EOF
            pass


def cleanup_stale(directory: str | None = None) -> list[str]:
    """Unlink segment files whose sender pid no longer exists (a sender killed before its reaper
    ran, or whose reaper was killed too). Returns the paths removed."""
    directory = directory or shm_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        unlink(path)
        removed.append(path)
    return removed


def segment_files(prefix: str = PREFIX, directory: str | None = None) -> list[str]:
    """The segment files in shm_dir() whose name starts with `prefix` (a sender's `prefix`)."""
    directory = directory or shm_dir()
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix))
