"""trainer/node_sweeper.py: a node's sweeper outlives what started it, waits for the run's processes on its node,
then removes the /dev/shm files of the docks that lived in them, and leaves every other file alone."""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid

import pytest

from mindspeed_rl.trainer.node_sweeper import _start_here

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rfind(")") + 2:].split()[1])


def test_the_sweeper_removes_a_dead_docks_files_once_its_processes_are_gone():
    dock = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    tag = f"sweeptest{uuid.uuid4().hex[:8]}"
    ours = [f"/dev/shm/msrl-{tag}-gen-{dock.pid}", f"/dev/shm/msrl-{tag}-{dock.pid}-0"]
    theirs = f"/dev/shm/msrl-{tag}x-gen-{bystander.pid}"     # another dock, alive: never removed
    for path in ours + [theirs]:
        open(path, "wb").close()
    try:
        sweeper = _start_here([dock.pid], time.time())
        assert sweeper and _ppid(sweeper) not in (None, os.getpid()), "detached: not a child of its starter"
        time.sleep(1.5)
        assert all(os.path.exists(p) for p in ours), "nothing is removed while the process lives"
        dock.kill()
        dock.wait()
        deadline = time.monotonic() + 20
        while (any(os.path.exists(p) for p in ours) or _ppid(sweeper) is not None) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(p) for p in ours), "the dead dock's files are removed"
        assert _ppid(sweeper) is None, "the sweeper exits when done"
        assert os.path.exists(theirs)
    finally:
        for proc in (dock, bystander):
            proc.kill()
            proc.wait()
        for path in ours + [theirs]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
