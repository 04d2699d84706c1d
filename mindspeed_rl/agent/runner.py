"""Running one tool call, bounded by a timeout, into the observation the model reads.

Every call runs in a thread of its own (a daemon: a tool that hangs forever keeps a thread, never
the rollout), so the agent loop goes on generating for the other rows while a tool works. What can
go wrong becomes an error result, never an exception of the rollout:

| what happened                                 | status      | the result text                          |
|-----------------------------------------------|-------------|------------------------------------------|
| the tool returned a string                    | `ok`        | that string                              |
| the call could not be read (`MalformedCall`)  | `malformed` | `error: <why>`                           |
| the tool raised                               | `raised`    | `error: <tool> raised <Type>: <message>` |
| it returned something else than a string      | `raised`    | `error: <tool> returned <type>, not text`|
| no answer within `timeout_s`                  | `timeout`   | `error: <tool> timed out after <t> s`    |
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Iterable

from .syntax import CallSyntax, MalformedCall, ToolCall
from .tools import Tool

STATUSES = ("ok", "malformed", "raised", "timeout")
MAX_ERROR_CHARS = 200


@dataclass
class PendingCall:
    """A tool call in flight: its answer comes through `future` (status, text), at the latest at `deadline`."""

    call: ToolCall | None
    deadline: float
    future: Future = field(default_factory=Future)

    def finished(self, now: float) -> bool:
        return self.future.done() or now >= self.deadline

    def outcome(self, syntax: CallSyntax, timeout_s: float) -> tuple[str, str]:
        """(status, result text as the model reads it); a call past its deadline has timed out."""
        if not self.future.done():
            return "timeout", syntax.error(f"{self.call.name} timed out after {timeout_s:g} s")
        status, text = self.future.result()
        return status, (syntax.result(text) if status == "ok" else syntax.error(text))


class ToolRunner:
    """Starts calls of `tools` written in `syntax`; each answers within `timeout_s` seconds."""

    def __init__(self, tools: dict[str, Tool], syntax: CallSyntax, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"tool timeout_s={timeout_s}; it must be > 0 seconds")
        self.tools, self.syntax, self.timeout_s = dict(tools), syntax, float(timeout_s)

    def start(self, turn_text: str) -> PendingCall:
        """Read the call at the end of `turn_text` and start it (a malformed call is answered at once)."""
        now = time.monotonic()
        try:
            call = self.syntax.parse(turn_text, list(self.tools))
        except MalformedCall as e:
            pending = PendingCall(None, now)
            pending.future.set_result(("malformed", _short(str(e))))
            return pending
        pending = PendingCall(call, now + self.timeout_s)
        threading.Thread(target=self._run, args=(call, pending.future), daemon=True,
                         name=f"tool-{call.name}").start()
        return pending

    def _run(self, call: ToolCall, future: Future) -> None:
        try:
            out = self.tools[call.name](call.arguments)
        except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's observation
            future.set_result(("raised", _short(f"{call.name} raised {type(e).__name__}: {e}")))
            return
        if not isinstance(out, str):
            future.set_result(("raised", f"{call.name} returned {type(out).__name__}, not text"))
            return
        future.set_result(("ok", out))

    @staticmethod
    def wait_any(pending: Iterable[PendingCall], block: bool) -> None:
        """Return once one of `pending` has finished (answered or past its deadline); at once if not `block`."""
        pending = list(pending)
        if not block or not pending:
            return
        now = time.monotonic()
        if any(p.finished(now) for p in pending):
            return
        wait([p.future for p in pending], timeout=max(0.0, min(p.deadline for p in pending) - now),
             return_when=FIRST_COMPLETED)


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."
