"""Counters and the event log of a dock.

The numbers answer "where does the step's time go?": per consumer how many rows it took, in how
many calls, how many of those found nothing, and how long it waited; per column how many rows were
written; bytes in and out. The event log (one entry per put or get) is what a dashboard draws as a
timeline of the stages. It is bounded, so a long run does not grow the dock's memory.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field


@dataclass
class ConsumerCounters:
    rows_taken: int = 0
    calls: int = 0
    empty_calls: int = 0
    wait_s: float = 0.0


@dataclass
class DockMetrics:
    event_log_size: int = 100_000
    consumers: dict[str, ConsumerCounters] = field(default_factory=lambda: defaultdict(ConsumerCounters))
    rows_written: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_in: int = 0
    bytes_out: int = 0
    rows_examined: int = 0  # rows samplers looked at: stays ~ rows handed out (contract 12)
    puts: int = 0
    events: deque = field(init=False)
    _seq: int = 0
    t0: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.event_log_size)

    def register(self, consumers, columns) -> None:
        """Every consumer and column appears in the metrics from the start, at zero."""
        for c in consumers:
            self.consumers[c]
        for c in columns:
            self.rows_written[c] += 0

    def log(self, op: str, stage: str, step: int, rows: int, nbytes: int, t_start: float, t_end: float) -> None:
        self._seq += 1
        self.events.append(
            {"seq": self._seq, "op": op, "stage": stage, "step": step, "rows": rows, "bytes": nbytes,
             "t_start": t_start, "t_end": t_end}
        )

    def on_put(self, producer: str, step: int, rows_per_column: dict[str, int], nbytes: int, t: float) -> None:
        self.puts += 1
        self.bytes_in += nbytes
        for column, n in rows_per_column.items():
            self.rows_written[column] += n
        self.log("put", producer, step, max(rows_per_column.values(), default=0), nbytes, t, t)

    def on_get(self, consumer: str, step: int, rows: int, nbytes: int, wait_s: float, t_start: float, t_end: float) -> None:
        c = self.consumers[consumer]
        c.calls += 1
        c.wait_s += wait_s
        if rows == 0:
            c.empty_calls += 1
            return
        c.rows_taken += rows
        self.bytes_out += nbytes
        self.log("get", consumer, step, rows, nbytes, t_start, t_end)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "bytes_in": float(self.bytes_in),
            "bytes_out": float(self.bytes_out),
            "puts": float(self.puts),
            "rows_examined": float(self.rows_examined),
            "uptime_s": time.time() - self.t0,
        }
        for name, c in sorted(self.consumers.items()):
            out[f"consumer/{name}/rows_taken"] = float(c.rows_taken)
            out[f"consumer/{name}/calls"] = float(c.calls)
            out[f"consumer/{name}/empty_calls"] = float(c.empty_calls)
            out[f"consumer/{name}/wait_s"] = c.wait_s
        for name, n in sorted(self.rows_written.items()):
            out[f"column/{name}/rows_written"] = float(n)  # overwrites count again
        return out

    def events_since(self, seq: int = 0) -> list[dict]:
        return [e for e in self.events if e["seq"] > seq]
