"""The dock's local channel: same-node callers reach the dock actor over a Unix socket.

Why: a Ray actor call costs ~1 ms here (1.1-1.3 ms to an async actor, the dock's kind), and a
dock call is only ~0.1 ms of the dock's own work, so Ray's call path was most of every put and
get. A request and its answer over a Unix socket that the actor serves on its own event loop
cost ~0.03-0.08 ms (measured on this 2-core machine; docs/transfer_dock.md). The actor stays a
Ray actor: Ray starts, places, names and kills it, and callers on other nodes, or with data that
must travel as Ray object references, still call it through Ray.

Frames, both ways, are a fixed header plus a body:
- request: `rid` (u64, the caller's number for it), body length (u64); body: pickled `(method, args)`;
- answer: `rid`, kind (u8: OK pickled value, RAW bytes as they are, ERROR pickled exception),
  body length; body.
The server runs each request as its own task, in the order received, so a blocking get waits
without holding up the calls behind it; a caller's puts still reach the dock in the order sent
(each put's work runs before its task first yields). Answers carry their `rid` and may come back
out of order; `Connection` files them until asked for.

The socket is a file beside the dock's shared-memory files (`msrl-<tag>-sock-<pid>`, mode 0600),
removed with them by `shm.remove_dock_files` and, after a crash, by `shm.remove_stale_files`.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import select
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from .errors import DockError

REQUEST = struct.Struct("!QQ")  # rid, body length
ANSWER = struct.Struct("!QBQ")  # rid, kind, body length
OK, RAW, ERROR = 0, 1, 2
CONNECT_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 60.0  # a send only blocks when the dock stops reading: it is stuck
DIED = "the dock closed the connection: its actor died or was killed"


class ChannelError(DockError, ConnectionError):
    """The channel to the dock broke: the dock actor died, was killed, or sent a bad frame."""


@dataclass
class Raw:
    """An answer already in bytes (the dock's pickled get reply): sent as is, not pickled again."""

    body: bytes


def socket_path(directory: str, tag: str, pid: int) -> str:
    return os.path.join(directory, f"msrl-{tag}-sock-{pid}")


# ---------------------------------------------------------------------------- the dock's side
async def serve(path: str, handlers: Mapping[str, Callable[..., Awaitable[Any]]]) -> asyncio.AbstractServer:
    """Serve `handlers` (method name -> coroutine function) on a Unix socket at `path`, on the
    running event loop (the dock actor's). Returns the server; `close()` it to stop listening."""
    running: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                rid, n = REQUEST.unpack(await reader.readexactly(REQUEST.size))
                body = await reader.readexactly(n)
                task = asyncio.ensure_future(_answer(rid, body, writer, handlers))
                running.add(task)
                task.add_done_callback(running.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller closed its end (its process ended)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(on_connect, path=path)
    os.chmod(path, 0o600)
    return server


async def _answer(rid: int, body: bytes, writer: asyncio.StreamWriter,
                  handlers: Mapping[str, Callable[..., Awaitable[Any]]]) -> None:
    try:
        method, args = pickle.loads(body)
        handler = handlers.get(method)
        if handler is None:
            raise DockError(f"TransferDock channel: no method {method!r}; it serves {', '.join(sorted(handlers))}")
        value = await handler(*args)
        kind, out = (RAW, value.body) if isinstance(value, Raw) else (OK, pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    except Exception as e:  # the caller raises it, as Ray would
        kind, out = ERROR, _pickled_error(e)
    if writer.is_closing():
        return
    writer.write(ANSWER.pack(rid, kind, len(out)))  # no await in between: frames never interleave
    writer.write(out)
    try:
        await writer.drain()
    except ConnectionError:
        pass


def _pickled_error(e: Exception) -> bytes:
    """The dock's own errors travel as themselves; anything else (a bug) as a RuntimeError that
    carries the actor's traceback, which the caller would otherwise never see."""
    if not isinstance(e, DockError):
        e = RuntimeError(f"the dock actor raised {type(e).__name__}: {e}\n"
                         + "".join(traceback.format_exception(e)))
    try:
        return pickle.dumps(e, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"), pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------------------- the caller's side
class Connection:
    """One caller thread's connection to the dock (blocking sockets, no helper thread).

    `send` returns a request number at once; `result(rid)` reads answers until that one came,
    filing the others (a pipelined put's answer, a prefetched get's) for later. The lock only
    matters if two threads share a connection; the client gives each thread its own.
    """

    def __init__(self, path: str, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._next_rid = 1
        self._answers: dict[int, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._header = bytearray(ANSWER.size)

    def send(self, method: str, args: tuple) -> int:
        body = pickle.dumps((method, args), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._raise_if_broken()
            rid, self._next_rid = self._next_rid, self._next_rid + 1
            header = REQUEST.pack(rid, len(body))
            try:
                self._sock.settimeout(SEND_TIMEOUT_S)
                if len(body) < 1 << 16:
                    self._sock.sendall(header + body)  # one syscall
                else:
                    self._sock.sendall(header)
                    self._sock.sendall(body)
            except (BrokenPipeError, ConnectionResetError):
                self._break(f"{DIED} (sending {method!r})")
            except OSError as e:
                self._break(f"sending {method!r} failed ({type(e).__name__}: {e})")
        return rid

    def done(self, rid: int) -> bool:
        """Whether the answer to `rid` has come, without waiting for it."""
        with self._lock:
            while rid not in self._answers:
                self._raise_if_broken()
                readable, _, _ = select.select([self._sock], [], [], 0)
                if not readable:
                    return False
                self._read_answer(SEND_TIMEOUT_S)
            return True

    def result(self, rid: int, timeout: float, what: str = "call") -> Any:
        """The answer to `rid`: its value, or the dock's exception raised here. Waits at most
        `timeout` seconds, then raises `TimeoutError` naming `what` (the answer may still come;
        it is then filed and dropped with the connection)."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(0.0, timeout)):
            raise TimeoutError(f"TransferDock channel: {what} got no answer in {timeout:.0f} s")
        try:
            while rid not in self._answers:
                self._raise_if_broken()
                left = deadline - time.monotonic()
                if left <= 0 or not self._read_answer(left):
                    raise TimeoutError(f"TransferDock channel: {what} got no answer from the dock in "
                                       f"{timeout:.0f} s; the dock actor is stuck or overloaded")
            kind, body = self._answers.pop(rid)
        finally:
            self._lock.release()
        if kind == RAW:
            return body  # a bytearray: pickle.loads takes it as is
        value = pickle.loads(body)
        if kind == ERROR:
            raise value
        return value

    def close(self) -> None:
        self._broken = self._broken or "closed by this process"
        self._sock.close()

    def __del__(self) -> None:  # a worker thread's connection ends with the thread
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    # -- internals (the lock is held)
    def _read_answer(self, timeout: float) -> bool:
        """Read one answer frame into `_answers`; False if none began within `timeout`."""
        self._sock.settimeout(timeout)
        try:
            got = self._sock.recv_into(self._header, ANSWER.size)
        except (socket.timeout, BlockingIOError):
            return False
        except ConnectionResetError:
            self._break(DIED)
        except OSError as e:
            self._break(f"reading failed ({type(e).__name__}: {e})")
        if got == 0:
            self._break(DIED)
        if got < ANSWER.size:  # a frame has begun: the rest follows at once
            self._recv_exact(memoryview(self._header)[got:])
        rid, kind, n = ANSWER.unpack(self._header)
        body = bytearray(n)
        self._recv_exact(memoryview(body))
        self._answers[rid] = (kind, body)
        return True

    def _recv_exact(self, view: memoryview) -> None:
        self._sock.settimeout(SEND_TIMEOUT_S)
        while len(view):
            try:
                got = self._sock.recv_into(view)
            except ConnectionResetError:
                self._break(DIED)
            except OSError as e:  # a timeout mid-frame too: the stream cannot be resynchronised
                self._break(f"reading an answer failed ({type(e).__name__}: {e})")
            if got == 0:
                self._break("the dock closed the connection mid-answer: its actor died or was killed")
            view = view[got:]

    def _break(self, why: str) -> None:
        self._broken = why
        try:
            self._sock.close()
        finally:
            raise ChannelError(f"TransferDock channel {self.path}: {why}")

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise ChannelError(f"TransferDock channel {self.path}: {self._broken}")
