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
The server (`Server`) reads each connection on its own thread and answers there every call that
need not wait (puts, gets that find their rows, status calls), in the order received, so a
caller's puts reach the dock in the order sent. A get that must wait goes to the actor's event
loop, where it waits without holding up the calls behind it. Answers carry their `rid` and may
come back out of order; `Connection` files them until asked for.

The socket is a file beside the dock's shared-memory files (`msrl-<tag>-sock-<pid>`, mode 0600),
removed with them by `shm.remove_dock_files` and, after a crash, by `shm.remove_stale_files`.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import select
import socket
import stat
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
ACCEPT_POLL_S = 0.5  # how soon a closed server's accept thread ends
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
LATER = object()  # a direct handler's "not now" (a get that must wait): the loop's handler answers


class Server:
    """The dock's end of the channel: a thread accepts, and one thread per connection reads its
    requests with blocking `recv` and answers what it can at once, in place.

    Why threads and not the event loop: a request on the loop costs a wake-up of the loop thread,
    a `StreamReader` parse, a task and a drain (~1.2 ms more per get than Ray's own zero-copy get
    with 4 consumers asking at once, on this loaded 2-core machine; docs/benchmarks.md). A
    connection thread answers a `direct` handler's value with one `sendall`. A direct handler that
    returns `LATER` (a get that must wait), and every method with no direct handler, goes to its
    coroutine handler on the loop, so a waiting call never holds up the calls behind it; the
    connection thread reads the next request at once. A caller's calls start in the order sent
    (one thread reads them). Answers carry their `rid`; one lock per connection keeps frames whole.
    """

    def __init__(self, path: str, handlers: Mapping[str, Callable[..., Awaitable[Any]]],
                 direct: Mapping[str, Callable[..., Any]], loop: asyncio.AbstractEventLoop) -> None:
        self.path, self.handlers, self.direct, self.loop = path, handlers, direct, loop
        self._closed = False
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # a socket left by a dead process of the same pid
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(ACCEPT_POLL_S)  # so close() ends the accept thread within that time
        self._sock = sock
        threading.Thread(target=self._accept, name="dock-channel-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening; connections already open stay served."""
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:  # closed
                return
            conn.settimeout(None)  # blocking reads; sends bounded by SO_SNDTIMEO below
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
            threading.Thread(target=self._serve, args=(_Peer(conn),), name="dock-channel-conn",
                             daemon=True).start()

    def _serve(self, peer: "_Peer") -> None:
        header = bytearray(REQUEST.size)
        try:
            while True:
                if not _recv_into(peer.sock, memoryview(header)):
                    return  # the caller closed its end (its process ended)
                rid, n = REQUEST.unpack(header)
                body = bytearray(n)
                if n and not _recv_into(peer.sock, memoryview(body)):
                    return
                self._handle(peer, rid, body)
        except OSError:
            return
        finally:
            peer.sock.close()  # answers still due from the loop then fail quietly

    def _handle(self, peer: "_Peer", rid: int, body: bytes) -> None:
        try:
            method, args = pickle.loads(body)
            direct = self.direct.get(method)
            if direct is not None:
                value = direct(*args)
                if value is not LATER:
                    peer.send(rid, *_encoded(value))
                    return
            handler = self.handlers.get(method)
            if handler is None:
                raise DockError(f"TransferDock channel: no method {method!r}; it serves "
                                f"{', '.join(sorted(set(self.handlers) | set(self.direct)))}")
        except Exception as e:  # the caller raises it, as Ray would
            peer.send(rid, ERROR, _pickled_error(e))
            return
        asyncio.run_coroutine_threadsafe(_answer(rid, handler, args, peer), self.loop)


class _Peer:
    """One connection, written by its thread and by the loop: frames go whole under `lock`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.lock = sock, threading.Lock()

    def send(self, rid: int, kind: int, out: bytes) -> None:
        with self.lock:
            self._sendall(rid, kind, out)

    def _sendall(self, rid: int, kind: int, out: bytes) -> None:
        try:
            header = ANSWER.pack(rid, kind, len(out))
            if len(out) < 1 << 16:
                self.sock.sendall(header + out)  # one syscall
            else:
                self.sock.sendall(header)
                self.sock.sendall(out)
        except OSError:  # the caller is gone (or stopped reading for SEND_TIMEOUT_S): its loss
            pass

    def try_send_now(self, rid: int, kind: int, out: bytes) -> bool:
        """Send the whole frame without blocking (from the loop); False if it could not."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            frame = ANSWER.pack(rid, kind, len(out)) + out if len(out) < 1 << 16 else None
            if frame is None:
                return False
            try:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                return True  # the caller is gone
            if sent < len(frame):  # the frame has begun: finish it here, blocking at most briefly
                try:
                    self.sock.sendall(memoryview(frame)[sent:])
                except OSError:
                    pass
            return True
        finally:
            self.lock.release()


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean end of stream before the first byte."""
    first = True
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            if first:
                return False
            raise ConnectionResetError("the caller closed the connection mid-request")
        first = False
        view = view[got:]
    return True


def _encoded(value: Any) -> tuple[int, bytes]:
    return (RAW, value.body) if isinstance(value, Raw) else (OK, pickle.dumps(value, pickle.HIGHEST_PROTOCOL))


async def serve(path: str, handlers: Mapping[str, Callable[..., Awaitable[Any]]],
                direct: Mapping[str, Callable[..., Any]] | None = None) -> Server:
    """Serve on a Unix socket at `path`: `direct` (method name -> plain function, run on the
    connection's thread; it returns `LATER` to pass the call on) first, else `handlers` (method
    name -> coroutine function) on the running event loop (the dock actor's). Returns the server;
    `close()` it to stop listening."""
    return Server(path, handlers, direct or {}, asyncio.get_running_loop())


async def _answer(rid: int, handler: Callable[..., Awaitable[Any]], args: tuple, peer: _Peer) -> None:
    try:
        kind, out = _encoded(await handler(*args))
    except Exception as e:  # the caller raises it, as Ray would
        kind, out = ERROR, _pickled_error(e)
    if not peer.try_send_now(rid, kind, out):  # never block the loop on a slow reader
        await asyncio.get_running_loop().run_in_executor(None, peer.send, rid, kind, out)


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
