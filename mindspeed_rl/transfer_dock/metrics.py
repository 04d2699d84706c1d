"""Counters and the event log of a dock.

The numbers answer "where does the step's time go?": per consumer how many rows it took, in how
many calls, how many of those found nothing, and how long it waited; per column how many rows were
written; bytes in and out. The event log (one entry per put or get) is what a dashboard draws as a
timeline of the stages, one lane per stage and worker. It is bounded, so a long run does not grow
the dock's memory. `RayMetricsExport` hands the same counters to `ray.util.metrics`, so they reach
Prometheus/Grafana through Ray's metrics agent.
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
    rows_retired: int = 0  # rows taken out of their step by retire() (dynamic sampling's dropped groups)
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

    def log(self, op: str, stage: str, step: int, rows: int, nbytes: int, t_start: float, t_end: float,
            worker: str | None = None) -> None:
        self._seq += 1
        self.events.append(
            {"seq": self._seq, "op": op, "stage": stage, "worker": worker, "step": step, "rows": rows,
             "bytes": nbytes, "t_start": t_start, "t_end": t_end}
        )

    def on_put(self, producer: str, step: int, rows_per_column: dict[str, int], nbytes: int, t: float,
               worker: str | None = None) -> None:
        self.puts += 1
        self.bytes_in += nbytes
        for column, n in rows_per_column.items():
            self.rows_written[column] += n
        self.log("put", producer, step, max(rows_per_column.values(), default=0), nbytes, t, t, worker)

    def on_get(self, consumer: str, step: int, rows: int, nbytes: int, wait_s: float, t_start: float, t_end: float,
               worker: str | None = None) -> None:
        c = self.consumers[consumer]
        c.calls += 1
        c.wait_s += wait_s
        if rows == 0:
            c.empty_calls += 1
            return
        c.rows_taken += rows
        self.bytes_out += nbytes
        self.log("get", consumer, step, rows, nbytes, t_start, t_end, worker)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "bytes_in": float(self.bytes_in),
            "bytes_out": float(self.bytes_out),
            "puts": float(self.puts),
            "rows_examined": float(self.rows_examined),
            "rows_retired": float(self.rows_retired),
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


# get_metrics() key -> (Ray metric name, kind, tag key); per-consumer and per-column keys by their last part.
RAY_METRICS = {
    "rows_taken": ("transfer_dock_rows_taken", "counter", "consumer", "rows handed to a consumer"),
    "calls": ("transfer_dock_get_calls", "counter", "consumer", "get calls of a consumer"),
    "empty_calls": ("transfer_dock_empty_gets", "counter", "consumer", "get calls that returned no rows"),
    "wait_s": ("transfer_dock_wait_seconds", "counter", "consumer", "seconds a consumer's gets waited"),
    "step_rows_taken": ("transfer_dock_step_rows_taken", "gauge", "consumer", "rows a consumer took this step"),
    "rows_written": ("transfer_dock_rows_written", "counter", "column", "rows written to a column"),
    "step_rows_written": ("transfer_dock_step_rows_written", "gauge", "column", "rows written to a column this step"),
    "bytes_in": ("transfer_dock_bytes_in", "counter", None, "bytes put into the dock"),
    "bytes_out": ("transfer_dock_bytes_out", "counter", None, "bytes handed out by the dock"),
    "puts": ("transfer_dock_puts", "counter", None, "put calls"),
    "rows_examined": ("transfer_dock_rows_examined", "counter", None, "rows the samplers looked at"),
    "rows_retired": ("transfer_dock_rows_retired", "counter", None, "rows retired (dropped groups)"),
    "step_rows_retired": ("transfer_dock_step_rows_retired", "gauge", None, "rows retired this step"),
    "step": ("transfer_dock_step", "gauge", None, "steps cleared since the dock was made"),
}


class RayMetricsExport:
    """The dock's counters as `ray.util.metrics` Counters and Gauges, tagged by consumer or column.

    `update(dock.get_metrics())` sends what changed since the last update: a counter is
    incremented by the difference, a gauge set. The actor calls it on a timer (every
    `metrics_interval_s`), never per put or get, so the dock's calls cost nothing more. Ray's metrics
    agent (installed with `ray[default]`) exports them for Prometheus as `ray_<name>` (counters with
    a `_total` suffix); under a minimal Ray install they are recorded but not exported.
    """

    def __init__(self) -> None:
        from ray.util import metrics as ray_metrics
        self._metrics = {}
        for key, (name, kind, tag, doc) in RAY_METRICS.items():
            cls = ray_metrics.Counter if kind == "counter" else ray_metrics.Gauge
            self._metrics[key] = cls(name, description=doc, tag_keys=(tag,) if tag else ())
        self.sent: dict[str, float] = {}  # get_metrics key -> value last handed to Ray
        self.updates = 0

    def update(self, values: dict[str, float]) -> int:
        """Hand the changed values to Ray; returns how many changed."""
        changed = 0
        for key, value in values.items():
            last = self.sent.get(key)
            if last == value:
                continue
            head, _, rest = key.partition("/")
            name, leaf = rest.rpartition("/")[::2] if head in ("consumer", "column") else (None, key)
            spec = RAY_METRICS.get(leaf)
            if spec is None or spec[2] != (head if name is not None else None):
                continue  # uptime_s and anything new: not exported
            metric = self._metrics[leaf]
            tags = {spec[2]: name} if name is not None else None
            if spec[1] == "counter":
                delta = value - (last or 0.0)
                if delta > 0:
                    metric.inc(delta, tags=tags)
            else:
                metric.set(value, tags=tags)
            self.sent[key] = value
            changed += 1
        self.updates += 1
        return changed
