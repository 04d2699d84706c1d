"""The live dashboard: a small HTTP server on 127.0.0.1, in a daemon thread of the driver.

    GET /            the page (HTML with its JS and CSS inlined); it polls /api/state every second
    GET /api/state   the run's snapshot as JSON (see state.py)
    GET /report.html the same page with the snapshot of this moment embedded (works offline)

It is the standard library's `ThreadingHTTPServer`: no dependency, and a request never blocks
the trainer (the snapshot's reads of the dock are rate-limited and time-bounded).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from .report import render_page

HOST = "127.0.0.1"


class DashboardServer:
    """Serve `snapshot()` (a callable returning the state dict) until `stop()`."""

    def __init__(self, snapshot: Callable[[], dict], port: int = 0, host: str = HOST):
        self.snapshot = snapshot
        self.host, self.port = host, int(port)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> str:
        """Bind and serve in a daemon thread; returns the URL. OSError if the port is taken."""
        snapshot = self.snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                try:
                    if path in ("/", "/index.html"):
                        self._send(200, "text/html; charset=utf-8", render_page(None).encode())
                    elif path == "/api/state":
                        self._send(200, "application/json", json.dumps(snapshot()).encode())
                    elif path == "/report.html":
                        self._send(200, "text/html; charset=utf-8", render_page(snapshot()).encode())
                    else:
                        self._send(404, "text/plain", b"not found: the dashboard serves /, /api/state, /report.html")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the browser went away

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # no access log on the trainer's console
                pass

        httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="mindspeed_rl-dashboard", daemon=True)
        self._thread.start()
        return self.url

    def stop(self, timeout: float = 5.0) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
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
