"""Two Ray nodes on this machine as a user starts them: a head by `ray start --head` (token authentication on,
its token in a HOME of its own) and a second node by `ray start --address=...` from a working directory of its
own, inside a user and mount namespace (`unshare -rm`, no privileges needed) with a private /dev/shm and a
private mount at `private_dir`. The network (and so Ray's traffic) stays shared; what the second node writes
to /dev/shm or under `private_dir` no process outside it sees, as on a second machine."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodes:
    def __init__(self, root: Path, cpus: int = 2):
        self.root = Path(root)
        self.home = self.root / "home"
        self.private_dir = self.root / "private"     # a tmpfs of its own on the second node
        self.node2_cwd = self.root / "node2"
        for d in (self.home / ".ray", self.private_dir, self.node2_cwd):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / ".ray" / "auth_token").write_text("7" * 64)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.temp_dirs: list[str] = []

    def env(self) -> dict[str, str]:
        """What the trainer and the nodes run with: the token's HOME, token mode (a node started by
        `ray start --address` does not turn it on from the token file alone)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, "HOME": str(self.home), "RAY_AUTH_MODE": "token"}

    def _start(self, argv: list[str], log: str, cwd: Path) -> subprocess.Popen:
        temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")     # short: Ray's Unix sockets live under it
        self.temp_dirs.append(temp)
        out = open(self.root / log, "w")
        cmd = [a.replace("{temp}", temp) for a in argv]
        proc = subprocess.Popen(cmd, env={**self.env(), "RAY_TMPDIR": temp}, stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait_started(self, proc: subprocess.Popen, log: str) -> None:
        deadline = time.monotonic() + START_S
        while "Ray runtime started" not in (self.root / log).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not start ({log}): {(self.root / log).read_text()[-3000:]}")
            time.sleep(0.3)

    def __enter__(self) -> "TwoNodes":
        try:
            head = self._start(["ray", "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={self.cpus}",
                                "--include-dashboard=false", "--temp-dir={temp}"], "head.log", self.root)
            self._wait_started(head, "head.log")
            inner = (f'mount -t tmpfs -o size=1g tmpfs /dev/shm && mount -t tmpfs tmpfs "{self.private_dir}" && '
                     f'exec ray start --address={self.address} --block --num-cpus={self.cpus} '
                     '--object-store-memory=200000000 --temp-dir={temp}')
            self.node2 = self._start(["unshare", "-rm", "sh", "-c", inner], "node2.log", self.node2_cwd)
            self._wait_started(self.node2, "node2.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shm(self) -> dict[str, list[str]]:
        """What each node has in its /dev/shm (the second node's read through its `ray start`'s root)."""
        return {"head": sorted(os.listdir("/dev/shm")),
                "node2": sorted(os.listdir(f"/proc/{self.node2.pid}/root/dev/shm"))}

    def __exit__(self, *exc) -> None:
        """SIGKILL, not `ray start`'s SIGTERM (which drains the node for up to 30 s): the process groups of both
        `ray start`s, then whatever else names their temp dirs (workers in process groups of their own)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for _ in range(2):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    cmd = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if any(t in cmd for t in self.temp_dirs) and int(entry.name) != os.getpid():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(entry.name), signal.SIGKILL)
            time.sleep(0.5)
        for proc in self.procs:
            proc.wait(timeout=30)
        for temp in self.temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)
