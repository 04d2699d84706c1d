"""What a client can cost the trainer through the dashboard server: idle connections take no thread
and are closed, handler threads are bounded, a request's headers must arrive by one deadline (slow
clients dribbling bytes hold no handler), and only requests addressed to 127.0.0.1/localhost with
the server's port get data (DNS rebinding)."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from mindspeed_rl.dashboard import DashboardServer
from mindspeed_rl.dashboard.server import MAX_HEADER_BYTES, MAX_WAITING, host_allowed, host_names

SNAPSHOT = {"info": {"title": "secret-run-name"}, "status": "running"}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def _closed_after(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closes `sock` (recv sees the end); fails past `timeout`."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def _get(port: int, host: str | None, path: str = "/api/state", extra_hosts: tuple[str, ...] = ()):
    """(status, body) of a GET with exactly this Host header (None: no Host header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        for h in ((host,) if host is not None else ()) + extra_hosts:
            conn.putheader("Host", h)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def server():
    srv = DashboardServer(lambda: SNAPSHOT, port=0)
    srv.start()
    yield srv
    srv.stop()


def test_500_idle_connections_take_no_thread_and_a_request_is_still_answered(server):
    base = threading.active_count()
    idle = []
    try:
        for _ in range(500):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        _wait_for(lambda: server.load()["waiting"] == MAX_WAITING, 10, "the server accepts the idle connections")
        assert threading.active_count() <= base, "an idle connection costs no thread"
        t0 = time.monotonic()
        body = urllib.request.urlopen(server.url + "api/state", timeout=10).read()
        assert json.loads(body) == SNAPSHOT and time.monotonic() - t0 < 2
        # beyond MAX_WAITING the oldest idle connections were closed, the newest are kept
        assert _closed_after(idle[0], 5) < 1, "closed at once, not at its timeout"
        assert threading.active_count() <= base + 1, "the request's thread is gone once answered (or ending)"
    finally:
        for s in idle:
            s.close()


def test_an_idle_connection_is_closed_after_the_timeout():
    srv = DashboardServer(lambda: SNAPSHOT, port=0, timeout_s=1.0)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as idle:
            took = _closed_after(idle, 10)
        assert 0.8 < took < 3.0, took
        _wait_for(lambda: srv.load()["waiting"] == 0, 2, "the closed connection is forgotten")
    finally:
        srv.stop()


def test_handler_threads_are_bounded():
    """Handlers busy with requests that take long (a snapshot that blocks, as a stuck dock read
    would): a request beyond `max_handlers` gets 503 at once, without a thread of its own."""
    release = threading.Event()

    def slow_snapshot():
        release.wait(30)
        return SNAPSHOT

    srv = DashboardServer(slow_snapshot, port=0, timeout_s=5.0, max_handlers=2)
    srv.start()
    base = threading.active_count()
    held = []
    try:
        for _ in range(2):  # complete requests; their answers wait on the snapshot
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(f"GET /api/state HTTP/1.0\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
            held.append(s)
        _wait_for(lambda: srv.load()["handling"] == 2, 5, "both requests are being handled")
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(srv.url + "api/state", timeout=10)
        assert busy.value.code == 503 and busy.value.headers["Retry-After"] == "1"
        assert threading.active_count() <= base + 2
        release.set()
        for s in held:  # the held requests are answered once the snapshot returns
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.0 200")
        _wait_for(lambda: srv.load()["handling"] == 0, 5, "the handlers are free again")
        assert json.loads(urllib.request.urlopen(srv.url + "api/state", timeout=10).read()) == SNAPSHOT
    finally:
        release.set()
        for s in held:
            s.close()
        srv.stop()


def test_a_stalled_request_gets_408_and_is_closed_at_its_deadline():
    srv = DashboardServer(lambda: SNAPSHOT, port=0, timeout_s=1.5)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /api/state HTTP/1.0\r\n")  # a request line, then nothing
            _wait_for(lambda: srv.load()["waiting"] == 1, 5, "the unfinished request waits without a handler")
            assert srv.load()["handling"] == 0
            s.settimeout(10)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 408"), answer
        _wait_for(lambda: srv.load()["waiting"] == 0, 2, "the closed connection is forgotten")
    finally:
        srv.stop()


def test_headers_beyond_the_limit_get_431():
    srv = DashboardServer(lambda: SNAPSHOT, port=0)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.0\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10))
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.0 431")
    finally:
        srv.stop()


@pytest.mark.slow
def test_slow_clients_dribbling_bytes_do_not_keep_others_from_being_answered():
    """10 clients (more than the 8 handlers) each send their request a byte every 0.5 s, which
    resets any per-read timeout; meanwhile ordinary requests are answered 200 (no 503), no handler
    is taken by a dribbler, and every dribbler is closed with 408 by its deadline (timeout_s after
    it connected), although it keeps sending."""
    timeout_s = 4.0
    srv = DashboardServer(lambda: SNAPSHOT, port=0, timeout_s=timeout_s)
    srv.start()
    request = f"GET /api/state HTTP/1.0\r\nHost: 127.0.0.1:{srv.port}\r\nX-Pad: {'x' * 64}\r\n\r\n".encode()
    stop = threading.Event()
    answers: dict[int, bytes] = {}
    sent = [0] * 10

    def dribble(i: int) -> None:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.settimeout(0.5)
            got = b""
            for byte in request[:-1]:  # never the last byte: the request is never complete
                if stop.is_set():
                    break
                try:
                    s.sendall(bytes([byte]))
                except OSError:  # closed by the server (reset, since we keep sending)
                    break
                sent[i] += 1
                try:
                    chunk = s.recv(4096)
                except socket.timeout:
                    continue  # the 0.5 s between bytes
                except OSError:
                    break
                got += chunk
                if not chunk:
                    break
            answers[i] = got

    threads = [threading.Thread(target=dribble, args=(i,), daemon=True) for i in range(10)]
    try:
        for t in threads:
            t.start()
        _wait_for(lambda: min(sent) >= 2, 10, "every dribbler has begun its request")
        for _ in range(3):
            time.sleep(0.5)  # dribbling goes on (a byte each every 0.5 s)
            status, body = _get(srv.port, f"127.0.0.1:{srv.port}")
            assert status == 200 and json.loads(body) == SNAPSHOT
            assert srv.load()["handling"] <= 1, "a dribbler holds no handler"
        for t in threads:
            t.join(timeout_s + 15)
        assert not any(t.is_alive() for t in threads), "every dribbler was closed by its deadline"
        assert len(answers) == 10
        # the server closes a refused connection lingering (it reads and discards what a dribbler still sends),
        # so no close resets a connection before its 408 is read
        assert all(a.startswith(b"HTTP/1.0 408") for a in answers.values()), answers
        _wait_for(lambda: srv.load()["waiting"] == 0, 5, "no connection is kept")
    finally:
        stop.set()
        srv.stop()


@pytest.mark.parametrize("path", ["/", "/api/state", "/report.html"])
def test_only_its_own_host_and_port_get_an_answer(server, path):
    port = server.port
    for good in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}"):
        status, body = _get(port, good, path)
        assert status == 200, good
    refused = [f"evil.example:{port}", f"127.0.0.1:{port + 1}", f"localhost:{port + 1}", "127.0.0.1", "localhost",
               f"127.0.0.1.evil.example:{port}", f"localhost.:{port}", f"[::1]:{port}", "", None]
    for bad in refused:
        status, body = _get(port, bad, path)
        assert status == 403, bad
        assert b"secret-run-name" not in body and b"<html" not in body.lower(), bad
        assert server.url.encode() in body, "the refusal says where the dashboard is"
    status, body = _get(port, f"127.0.0.1:{port}", path, extra_hosts=(f"evil.example:{port}",))
    assert status == 403, "two Host headers"


def test_host_rules():
    assert host_names("127.0.0.1") == {"127.0.0.1", "localhost"}
    assert host_names("::1") == {"[::1]", "localhost"}
    assert host_allowed(["[::1]:8266"], host_names("::1"), 8266)
    assert not host_allowed(["[::1]:8266"], host_names("127.0.0.1"), 8266)
    assert host_allowed(["localhost"], host_names("127.0.0.1"), 80), "browsers leave out port 80"
    assert not host_allowed([], host_names("127.0.0.1"), 80)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_handlers=0"):
        DashboardServer(lambda: SNAPSHOT, max_handlers=0)
