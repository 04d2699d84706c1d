"""The driver's calls to the dock: each bounded, each interruptible.

Why a thread: a dock client's call over the local channel reads its reply from a socket, and a
reply read half-way would leave the channel out of step for every later call. So the driver's main
thread never reads the dock itself: it hands each call to one `dock-calls` thread and waits for the
answer in short polls, so that a SIGINT/SIGTERM raised in the main thread (at any moment, start-up
included) never interrupts a read, and a dock that stops answering (a stopped or wedged actor) is
reported after `timeout_s` as "the dock did not answer ..." with the step and the stages that were
waiting, instead of hanging the driver. After such a timeout the thread may still be blocked in the
call: every later call then fails at once with the same message (the run is ending anyway).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

POLL_S = 0.1


class DockSilent(RuntimeError):
    """The dock did not answer in time; the message names the call, the step and who was waiting."""


class DockCalls:
    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: str | None = None
        self._thread = threading.Thread(target=self._serve, name="dock-calls", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, kwargs, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller, raised there
                future.set_exception(e)

    def call(self, what: str, fn: Callable[..., Any], *args: Any, context: str = "", timeout_s: float | None = None,
             **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the dock thread; DockSilent after `timeout_s` (default: the
        driver's) without an answer. `what` and `context` (step, stages waiting) go into the message."""
        if self._stuck is not None:
            raise DockSilent(self._stuck)
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        future: Future = Future()
        self._jobs.put((fn, args, kwargs, future))
        waited = 0.0
        while True:
            try:  # short waits: a signal handler raising in this (main) thread gets in between them
                return future.result(timeout=POLL_S)
            except TimeoutError:
                waited += POLL_S
                if waited >= limit:
                    future.cancel()
                    self._stuck = (f"{context + ': ' if context else ''}the dock did not answer {what} within "
                                   f"{limit:.0f} s (trainer.stage_timeout_s): its actor is stopped, wedged or "
                                   "overloaded")
                    raise DockSilent(self._stuck) from None

    def close(self) -> None:
        self._jobs.put(None)
