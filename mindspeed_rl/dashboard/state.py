"""A run as one JSON snapshot: what the live page polls, what report.html embeds.

The snapshot gathers, for the step in progress, each consumer's rows taken and each column's rows
written (from the dock's status calls); the dock's event log of the last `TIMELINE_STEPS` steps
(one entry per micro-batch get or put, labelled with its stage and worker); each stage worker's
span per step (from the workers' reports, to close the last box of stages that put nothing); and
the per-step metrics the trainer logged. The trainer feeds it at step boundaries; a page asking for
it between them makes it poll the dock, at most every `REFRESH_S`, with short timeouts, so a slow
or dead dock never stalls the page or the run.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..dataflow.metrics import chart_specs

TIMELINE_STEPS = 3      # steps the Gantt chart shows (and the run directory keeps)
REFRESH_S = 0.5         # the page polls every second; the dock is asked at most this often
DOCK_TIMEOUT_S = 5.0    # a status call that takes longer is given up (the last values stay)
MAX_POINTS = 2000       # per-step metrics kept per chart (older steps are thinned beyond it)
SAMPLES_SHOWN = 16      # rows of what the model answered the page shows, per kind (all are in samples/)
SAVE_EVERY_S = 2.0      # the run directory's dashboard.json is rewritten at most this often (and at the end)
SNAPSHOT_FILE = "dashboard.json"
FORMAT = 1


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class DashboardState:
    """Thread-safe: the trainer's thread writes, the dashboard server's threads read.

    `info` describes the run: title, consumers, columns, rows_per_step, the expected
    `lanes` (``[{"stage", "worker"}]``) and the per-step `charts` (``[{"title", "keys", "stageKeys"}]``,
    the registered metrics' by default); see `mindspeed_rl.trainer.run_dashboard` for what it holds.
    """

    def __init__(self, info: dict):
        self._lock = threading.RLock()
        self.info = dict(info)
        self.info.setdefault("started", time.time())
        self.info.setdefault("charts", chart_specs())   # the per-step charts the page draws (dataflow/metrics.py)
        total = int(self.info.get("rows_per_step", 0))
        self.docks: list = []
        self.step_offset = 0  # trainer step of the dock's step 0 (a resumed run starts later)
        self.step_of = None   # (dock index, the dock's own step) -> trainer step, with several docks
        self.seqs: list[int] = []
        self.status = "starting"
        self.error: str | None = None
        self.step: int | None = None
        self.consumers = {c: {"taken": 0, "total": total} for c in self.info.get("consumers", [])}
        self.columns = {c: {"written": 0, "total": total} for c in self.info.get("columns", [])}
        self.events: list[dict] = []
        self.seq = 0
        self.steps: dict[int, dict] = {}     # step -> {"t_start", "t_end"}
        self.spans: list[dict] = []          # {"step", "stage", "worker", "t_start", "t_end"}
        self.history: list[dict] = []
        self.samples: dict[str, list[dict]] = {}   # "train" / "val" -> the latest rows (trainer/samples.py)
        self.dock_error: str | None = None
        self._refreshed = 0.0
        self._saved = 0.0

    # ------------------------------------------------------------------ fed by the trainer
    def attach(self, dock, step_offset: int = 0, step_of=None) -> None:
        """The run's dock (or docks: one per step in flight with rl_config.max_weight_staleness > 0) is
        up: from now on the snapshot reads it. With several docks, `step_of(dock index, the dock's own
        step)` says which trainer step an event belongs to, so the timeline shows the steps that overlap."""
        with self._lock:
            self.docks = list(dock) if isinstance(dock, (list, tuple)) else [dock]
            self.seqs = [0] * len(self.docks)
            self.step_offset, self.step_of, self.status = int(step_offset), step_of, "running"

    @property
    def dock(self):
        return self.docks[0] if self.docks else None

    def begin_step(self, step: int) -> None:
        with self._lock:
            self.step = int(step)
            self.steps[self.step] = {"t_start": time.time(), "t_end": None}
            self._prune()

    def end_step(self, step: int, spans: list[dict]) -> None:
        """Call before the dock is cleared: keeps the step's final consumption and its events."""
        with self._lock:
            self._pull(force=True)
            self.steps.setdefault(step, {"t_start": None})["t_end"] = time.time()
            self.spans += [{"step": int(step), **s} for s in spans]

    def add_record(self, record: dict) -> None:
        """One step's metrics as the trainer logged them (numbers only; checksums are left out)."""
        rec = {k: int(v) if k == "step" else float(v) for k, v in record.items()
               if _number(v) and not k.startswith("weight_sync/")}
        with self._lock:
            self.history.append(rec)

    def add_samples(self, kind: str, rows: list[dict]) -> None:
        """What the model answered: the latest validation's first rows, or the latest training steps' rows."""
        with self._lock:
            kept = rows[:SAMPLES_SHOWN] if kind == "val" else (self.samples.get(kind, []) + rows)[-SAMPLES_SHOWN:]
            self.samples[kind] = [dict(r) for r in kept]

    def finish(self, error: BaseException | None = None) -> None:
        """The run ended (or failed): read the dock a last time if it still answers, then let go.

        A step that ended keeps the consumption `end_step` saw (the dock is cleared since); a step
        cut short shows where it stood.
        """
        with self._lock:
            cut_short = self.step is not None and self.steps.get(self.step, {}).get("t_end") is None
            if self.docks and cut_short:
                self._pull(force=True)
            self.docks = []
            if error is None:
                self.status = "finished"
            else:
                self.status = "failed"
                self.error = f"{type(error).__name__}: {error}".strip()

    # ------------------------------------------------------------------ reading the dock
    def _pull(self, force: bool = False) -> None:
        now = time.time()
        if not self.docks or (not force and now - self._refreshed < REFRESH_S):
            return
        self._refreshed = now
        current = (self.step % len(self.docks)) if self.step is not None else 0
        for j, dock in enumerate(self.docks):
            try:
                consumers, columns, events = _read_dock(dock, self.seqs[j])
            except Exception as e:  # a dead or stuck dock: keep what we have, say why it is stale
                self.dock_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                return
            if j == current:  # the bars show the step being trained
                self.consumers = {c: {"taken": int(s["taken"]), "total": int(s["total"])} for c, s in consumers.items()}
                self.columns = {c: {"written": int(s["written"]), "total": int(s["total"])} for c, s in columns.items()}
            for e in events:
                self.seqs[j] = max(self.seqs[j], int(e["seq"]))
                own = int(e["step"])
                step = self.step_of(j, own) if self.step_of is not None else own + self.step_offset
                self.events.append({"seq": int(e["seq"]), "op": e["op"], "stage": e["stage"],
                                    "worker": e.get("worker") or "", "step": int(step), "dock": j,
                                    "rows": int(e["rows"]), "t_start": float(e["t_start"]), "t_end": float(e["t_end"])})
        self.seq = max(self.seqs, default=0)
        self.dock_error = None
        self._prune()

    def _prune(self) -> None:
        """Keep the events, spans and step times of the last TIMELINE_STEPS steps only."""
        if self.step is None:
            return
        first = self.step - TIMELINE_STEPS + 1
        self.events = [e for e in self.events if e["step"] >= first]
        self.spans = [s for s in self.spans if s["step"] >= first]
        self.steps = {s: t for s, t in self.steps.items() if s >= first}

    # ------------------------------------------------------------------ the snapshot
    def snapshot(self) -> dict:
        """Everything the page draws, as plain JSON types."""
        with self._lock:
            between_steps = self.step is not None and self.steps.get(self.step, {}).get("t_end") is not None
            if self.status == "running" and not between_steps:  # after end_step the dock is being cleared
                self._pull()
            history = self.history
            if len(history) > MAX_POINTS:  # thin old steps evenly, keep the newest
                stride = math.ceil(len(history) / MAX_POINTS)
                history = history[:-MAX_POINTS // 2:stride] + history[-MAX_POINTS // 2:]
            return {"format": FORMAT, "info": self.info, "status": self.status, "error": self.error,
                    "dock_error": self.dock_error, "step": self.step, "now": time.time(),
                    "consumers": self.consumers, "columns": self.columns,
                    "steps": {str(s): t for s, t in sorted(self.steps.items())},
                    "events": list(self.events), "spans": list(self.spans), "history": list(history),
                    "samples": {k: list(v) for k, v in self.samples.items()},
                    "timeline_steps": TIMELINE_STEPS}

    def save(self, run_dir: str | os.PathLike, every_s: float = 0.0) -> Path | None:
        """Write the snapshot to `run_dir/dashboard.json` (atomically: a reader never sees half);
        with `every_s`, only if the last save is older than that (None when skipped)."""
        now = time.time()
        if every_s and now - self._saved < every_s:
            return None
        self._saved = now
        return write_json(Path(run_dir) / SNAPSHOT_FILE, self.snapshot())


def _read_dock(dock, since: int) -> tuple[dict, dict, list]:
    """Consumer status, column status and new events: from a dock actor as three calls in flight at
    once (one round trip, at most DOCK_TIMEOUT_S), or from a plain in-process `TransferDock`."""
    actor = getattr(dock, "actor", None)
    if actor is None:
        return dock.get_consumer_status(), dock.get_column_status(), dock.get_event_log(since)
    import ray
    refs = [actor.get_consumer_status.remote(), actor.get_column_status.remote(), actor.get_event_log.remote(since)]
    return tuple(ray.get(refs, timeout=DOCK_TIMEOUT_S))


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)
    return path


# the snapshot's fields the page reads, and their JSON types (a file missing one draws nothing)
SNAPSHOT_FIELDS = {"info": dict, "consumers": dict, "columns": dict, "steps": dict,
                   "events": list, "spans": list, "history": list}
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true/false", type(None): "null"}
_FIX = ("copy it again from the run's output_dir, or open the run's report.html if it has one "
        "(the trainer writes it at the end of a run, a failed one too)")


def load_snapshot(run_dir: str | os.PathLike) -> dict:
    """The snapshot a run left in its directory.

    `FileNotFoundError` when there is none; `ValueError` when it cannot be read, is not JSON (cut
    short by a copy, say) or is not a snapshot of this version. Each error is one line naming the
    file, what is wrong and what to do, for `cli/dashboard.py` to print as it is.
    """
    path = Path(run_dir) / SNAPSHOT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} the output_dir of a run made with "
                                "trainer.report=true (or trainer.dashboard=true)?")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a snapshot (not UTF-8 text: byte {e.start} of {len(raw)}); {_FIX}") from None
    except json.JSONDecodeError as e:
        cut = "; it does not end with '}': cut short?" if not raw.rstrip().endswith(b"}") else ""
        raise ValueError(f"{path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno} of its "
                         f"{len(raw)} bytes{cut}); {_FIX}") from None
    problem = snapshot_problem(data)
    if problem:
        other_version = isinstance(data, dict) and "format" in data and data["format"] != FORMAT
        fix = "open the run's report.html, which the version that made the run wrote, or that version's " \
              "cli/dashboard.py" if other_version else _FIX
        raise ValueError(f"{path} is not a snapshot this version can show: {problem}; {fix}")
    return data


def snapshot_problem(data: Any) -> str | None:
    """What keeps `data` from being a snapshot the page can draw (None: nothing)."""
    if not isinstance(data, dict):
        return f"it holds {_JSON_TYPES.get(type(data), type(data).__name__)}, not an object"
    if data.get("format") != FORMAT:
        return f"snapshot format {data.get('format')!r}, this version reads {FORMAT}"
    for key, kind in SNAPSHOT_FIELDS.items():
        if key not in data:
            return f"field {key!r} is missing"
        if not isinstance(data[key], kind):
            return f"field {key!r} is {_JSON_TYPES.get(type(data[key]), type(data[key]).__name__)}, " \
                   f"not {_JSON_TYPES[kind]}"
    return None
