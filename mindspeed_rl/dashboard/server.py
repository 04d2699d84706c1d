"""The live dashboard: a small HTTP server on 127.0.0.1, in a daemon thread of the driver.

    GET /            the page (HTML with its JS and CSS inlined); it polls /api/state every second
    GET /api/state   the run's snapshot as JSON (see state.py)
    GET /report.html the same page with the snapshot of this moment embedded (works offline)

It runs inside the trainer, so it must never cost the trainer more than a few threads and file
descriptors, whatever connects to it:

- one thread accepts connections and reads their request headers itself (a `selectors` loop,
  non-blocking): a connection costs a file descriptor and the bytes it sent, not a thread, until
  its headers are complete. Each connection has ONE deadline, `timeout_s` after it was accepted:
  a request whose headers are not complete by then is answered 408 and closed, whether it sent
  nothing or dribbles a byte at a time (a per-read timeout would be reset by every byte, so 8
  clients sending a byte every 2 s used to hold all 8 handlers and every other request got 503).
  At most `MAX_WAITING` such connections are kept, their headers at most `MAX_HEADER_BYTES`
  (431 beyond); beyond `MAX_WAITING` the oldest is closed (a browser's request sends its bytes at
  once, so the oldest unfinished one is the least likely to be a real request);
- a request whose headers are complete gets a handler thread, at most `max_handlers` at once;
  beyond that it is answered 503 (Retry-After: 1) at once, by the accepting thread, without a
  thread of its own. The handler only parses the headers already read and writes the answer;
  its socket writes time out after `timeout_s` (one `sendall` of the body is bounded as a whole);
- it answers only requests whose Host header is its own address (`127.0.0.1:PORT` or
  `localhost:PORT`): after a DNS rebinding a page of another site reaches 127.0.0.1 under its
  own name, and its requests carry that name, so they get 403 and no data.

The standard library only: no dependency.
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import re
import selectors
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import Callable

from .report import render_page

HOST = "127.0.0.1"
TIMEOUT_S = 5.0     # an idle connection, or a read/write of a request that stalls, is closed after this
MAX_HANDLERS = 8    # requests answered at once (a page polls once a second: one or two are enough)
MAX_WAITING = 256   # connections kept open that have not sent anything yet
LINGER_S = 2.0      # a refused connection is read and discarded this long before it is closed (lingering close)
ACCEPT_BATCH = 64   # connections accepted per loop turn, so that the waiting ones are served too
MAX_HEADER_BYTES = 65536  # a request line and headers longer than this get 431 (browsers stay far below)
_END_OF_HEADERS = re.compile(rb"\r?\n\r?\n")  # http.server also ends headers at a bare "\n" line

_BUSY = b"the dashboard is answering too many requests at once; retry in a second\n"
_SLOW = b"the request's headers did not arrive within the dashboard's time limit\n"
_LARGE = b"the request's headers are too large for the dashboard\n"


def host_names(host: str) -> frozenset[str]:
    """The names a browser may put in the Host header for a server bound to `host`."""
    if host in ("127.0.0.1", "localhost"):
        return frozenset({"127.0.0.1", "localhost"})
    if host == "::1":
        return frozenset({"[::1]", "localhost"})
    return frozenset({f"[{host}]" if ":" in host else host})


def host_allowed(values: list[str], names: frozenset[str], port: int) -> bool:
    """True when the request carries exactly one Host header naming this server and its port.

    A missing Host header is refused too: every browser sends one, and a request without it cannot
    show that it was meant for this server. The port may be left out only where it is 80, as
    browsers do.
    """
    if len(values) != 1:
        return False
    value = values[0].strip().lower()
    allowed = {f"{n}:{port}" for n in names} | (set(names) if port == 80 else set())
    return value in allowed


def _plain_response(code: int, reason: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.0 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n{extra}\r\n"
            ).encode() + body


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), so a handler thread is free again after it."""

    server: "DashboardServer"

    def __init__(self, request, client_address, server, head: bytes = b""):
        self._head = head  # the request line and headers, read by the accepting thread
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # StreamRequestHandler applies it to the socket (writes)
        super().setup()
        self.rfile.close()
        self.rfile = io.BytesIO(self._head)  # nothing more is read from the client

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        server = self.server
        try:
            if not host_allowed(self.headers.get_all("Host") or [], server.names, server.port):
                body = (f"refused: the Host header {self.headers.get('Host')!r} is not this dashboard's "
                        f"address; open {server.url} (through ssh -L, forward the same port number: "
                        f"-L {server.port}:127.0.0.1:{server.port})\n").encode()
                self._send(403, "text/plain; charset=utf-8", body)
                return
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(None).encode())
            elif path == "/api/state":
                self._send(200, "application/json", json.dumps(server.snapshot()).encode())
            elif path == "/report.html":
                self._send(200, "text/html; charset=utf-8", render_page(server.snapshot()).encode())
            else:
                self._send(404, "text/plain", b"not found: the dashboard serves /, /api/state, /report.html")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # no access log on the trainer's console
        pass


class DashboardServer:
    """Serve `snapshot()` (a callable returning the state dict) until `stop()`.

    `timeout_s` and `max_handlers` bound what any client can hold (see the module's docstring);
    the defaults suit a browser or two on the same machine.
    """

    def __init__(self, snapshot: Callable[[], dict], port: int = 0, host: str = HOST,
                 timeout_s: float = TIMEOUT_S, max_handlers: int = MAX_HANDLERS, max_waiting: int = MAX_WAITING):
        if timeout_s <= 0 or max_handlers < 1 or max_waiting < 1:
            raise ValueError(f"DashboardServer: timeout_s={timeout_s}, max_handlers={max_handlers}, "
                             f"max_waiting={max_waiting}; each must be positive")
        self.snapshot = snapshot
        self.host, self.port = host, int(port)
        self.names = host_names(host)
        self.timeout_s, self.max_handlers, self.max_waiting = float(timeout_s), int(max_handlers), int(max_waiting)
        self._slots = threading.BoundedSemaphore(self.max_handlers)
        self._count_lock = threading.Lock()
        self._handling = 0
        # connection -> (deadline, address, the bytes it sent so far); ordered by deadline (accept order)
        self._waiting: collections.OrderedDict[socket.socket, tuple[float, tuple, bytearray]] = \
            collections.OrderedDict()
        # refused connections whose answer is sent: connection -> the deadline of their lingering close
        self._closing: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        self._listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def load(self) -> dict[str, int]:
        """Connections whose request headers are not complete yet, and requests being answered."""
        with self._count_lock:
            return {"waiting": len(self._waiting), "handling": self._handling}

    def start(self) -> str:
        """Bind and serve in a daemon thread; returns the URL. OSError if the port is taken."""
        listener = _listen(self.host, self.port)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name="mindspeed_rl-dashboard", daemon=True)
        self._thread.start()
        return self.url

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting and close the listening socket; requests in flight end on their own."""
        if self._thread is not None:
            self._stopping.set()
            try:
                self._wake[1].send(b"x")
            except OSError:
                pass
            self._thread.join(timeout)
            self._thread = None

    def wait(self) -> None:
        """Block until Ctrl-C, then stop (for `cli/dashboard.py`)."""
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    # ------------------------------------------------------------------ the accepting thread
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake[0], selectors.EVENT_READ, "wake")
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select(self._next_expiry()):
                    if key.data == "accept":
                        self._accept(sel)
                    elif key.data == "wake":
                        _drain(key.fileobj)
                    elif key.data == "closing":
                        self._read_closing(sel, key.fileobj)
                    else:
                        self._read(sel, key.fileobj)
                self._expire(sel)
        finally:
            for conn in list(self._waiting):
                self._unwait(sel, conn)
                _close(conn)
            for conn in list(self._closing):
                self._closed(sel, conn)
            sel.close()
            _close(self._listener)
            for s in self._wake:
                _close(s)

    def _next_expiry(self) -> float | None:
        """Seconds until the oldest waiting or lingering connection is due (each kind waits the same time,
        so the oldest of each is the first due)."""
        due = [d for d in (next(iter(self._waiting.values()))[0] if self._waiting else None,
                           next(iter(self._closing.values())) if self._closing else None) if d is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of file descriptors: make room, the connection stays in the backlog
                if self._waiting:
                    oldest = next(iter(self._waiting))
                    self._unwait(sel, oldest)
                    _close(oldest)
                return
            conn.setblocking(False)
            if len(self._waiting) >= self.max_waiting:
                oldest = next(iter(self._waiting))
                self._unwait(sel, oldest)
                _close(oldest)
            with self._count_lock:
                self._waiting[conn] = (time.monotonic() + self.timeout_s, addr, bytearray())
            sel.register(conn, selectors.EVENT_READ, addr)

    def _read(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        """Bytes arrived on a waiting connection: keep them; once the headers are complete, hand the
        request to a handler. The deadline stays the one set at accept."""
        entry = self._waiting.get(conn)
        if entry is None:
            return
        _, addr, head = entry
        data = _recv(conn)
        if data is None:
            return
        if not data:  # the client closed (or reset) before finishing its request
            self._unwait(sel, conn)
            _close(conn)
            return
        head += data
        if _END_OF_HEADERS.search(head, max(0, len(head) - len(data) - 3)):
            self._unwait(sel, conn)
            self._dispatch(sel, conn, addr, bytes(head))
        elif len(head) > MAX_HEADER_BYTES:
            self._unwait(sel, conn)
            self._refuse(sel, conn, 431, "Request Header Fields Too Large", _LARGE)

    def _unwait(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        with self._count_lock:
            self._waiting.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._waiting:
            conn, (deadline, _, head) = next(iter(self._waiting.items()))
            if deadline > now:
                return
            self._unwait(sel, conn)
            if head:  # a request begun and not finished in time (a slow or stalled client): say so
                self._refuse(sel, conn, 408, "Request Timeout", _SLOW)
            else:     # never sent anything: nothing to answer
                _close(conn)
        while self._closing:
            conn, deadline = next(iter(self._closing.items()))
            if deadline > now:
                return
            self._closed(sel, conn)

    def _refuse(self, sel: selectors.BaseSelector, conn: socket.socket, code: int, reason: str, body: bytes,
                extra: str = "") -> None:
        """Answer `code` from the accepting thread, then close the connection lingering: a client still
        sending (a dribbler) would otherwise be reset by the close, and a reset drops the answer it has not
        read yet. Its bytes are read and discarded until it closes or `LINGER_S` passes."""
        if not _refuse(conn, code, reason, body, extra):
            _close(conn)
            return
        if len(self._closing) >= self.max_waiting:
            self._closed(sel, next(iter(self._closing)))
        self._closing[conn] = time.monotonic() + LINGER_S
        try:
            sel.register(conn, selectors.EVENT_READ, "closing")
        except (KeyError, ValueError, OSError):
            self._closed(sel, conn)

    def _read_closing(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        if _recv(conn) == b"":
            self._closed(sel, conn)

    def _closed(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._closing.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        _close(conn)

    def _dispatch(self, sel: selectors.BaseSelector, conn: socket.socket, addr: tuple, head: bytes) -> None:
        """A request's headers are complete: a handler thread if one is free, else 503 at once."""
        if not self._slots.acquire(blocking=False):
            self._refuse(sel, conn, 503, "Service Unavailable", _BUSY, "Retry-After: 1\r\n")
            return
        with self._count_lock:
            self._handling += 1
        conn.setblocking(True)
        try:
            threading.Thread(target=self._handle, args=(conn, addr, head), name="mindspeed_rl-dashboard-request",
                             daemon=True).start()
        except RuntimeError:  # the process cannot start a thread now
            self._release()
            conn.setblocking(False)
            self._refuse(sel, conn, 503, "Service Unavailable", _BUSY, "Retry-After: 1\r\n")

    def _handle(self, conn: socket.socket, addr: tuple, head: bytes) -> None:
        try:
            _Handler(conn, addr, self, head)
        except OSError:
            pass  # a timeout or a reset: the client is gone or stalled, its connection is closed below
        except Exception:  # a bug in the page or the snapshot: say so, keep serving
            traceback.print_exc(file=sys.stderr)
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            _close(conn)
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self._handling -= 1
        self._slots.release()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; its OSError keeps the plain strerror ("Address already in use"), which
    the trainer's message quotes (`socket.create_server` would append the address to it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server: restart on a TIME_WAIT port
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _refuse(conn: socket.socket, code: int, reason: str, body: bytes, extra: str = "") -> bool:
    """Answer `code` without a thread and end the sending side: 503 (all handlers busy), 408 (headers too
    slow), 431 (headers too large). False when the connection is already gone."""
    try:
        conn.setblocking(False)  # the accepting thread never waits on a client
        with contextlib.suppress(BlockingIOError, InterruptedError):
            conn.recv(65536)  # bytes still unread: closing with them unread would reset, and lose the answer
        conn.send(_plain_response(code, reason, body, extra))
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True


def _recv(conn: socket.socket) -> bytes | None:
    """What a non-blocking connection has sent: b"" when it closed or reset the connection, None when nothing is there."""
    try:
        return conn.recv(65536)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(64):
            pass
    except OSError:
        pass


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
