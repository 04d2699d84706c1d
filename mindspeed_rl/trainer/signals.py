"""SIGINT/SIGTERM during a run: raised at once in the main thread, turned into `Interrupted` by the Trainer.

That is safe because the main thread never reads from the dock itself (`dock_calls.py`: a reply read
half-way would desync the channel the final report still reads). The exception is a BaseException, so
no library's `except Exception` retry loop (ray.init retrying an address, a wait for workers) swallows
it. During clean-up (`stopping`) a further signal changes nothing.
"""
from __future__ import annotations

import signal
import threading
from typing import Any


class Signalled(BaseException):
    """Raised by the signal handler in the main thread; `Trainer.run` turns it into `Interrupted`."""


class SignalTrap:
    def __init__(self):
        self.received: int | None = None   # the signal received; the Trainer raises Interrupted at its next poll
        self.stopping = False               # cleaning up: a further signal changes nothing
        self._saved: dict[int, Any] = {}

    def trap(self) -> None:
        """Install the handlers (again after ray.init, which installs a SIGTERM handler of its own)."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the defaults stay
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, self._on_signal)
            self._saved.setdefault(sig, previous)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is None and not self.stopping:
            self.received = signum
            raise Signalled(signum)

    def pending(self) -> bool:
        return self.received is not None and not self.stopping

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._saved = {}
