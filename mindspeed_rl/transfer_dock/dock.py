"""TransferDock: the step's experience as columns keyed by row, with per-consumer progress.

A row is one sample (one prompt x one response). Rows `p*n .. p*n+n-1` belong to prompt `p`.
Producers write cells (column, row); consumers take rows whose columns they need are all
written. Each consumer takes each row once per step, however many data-parallel callers it has,
so stages can run concurrently on whatever micro-batches are ready.

This class is plain Python, thread-safe, and needs no Ray: the Ray actor in `actor.py` wraps
one of these. Waiting is event-driven (a condition variable notified by `put_experience`), and
every wait is bounded.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from .consumer import ConsumerState
from .dock_checkpoint import DockCheckpoint
from .errors import (DockIndexError, DockKeyError, DockTimeoutError, DockValueError, MissingDataError,
                     preview)
from .metrics import DockMetrics
from .rows import cell_nbytes, checked_index_list, checked_rows, row_kind, unique_names
from .samplers import AnyReadySampler, OrderedSampler, ReadyRows, Sampler, SampleRequest

SMALL_TAKE = 64  # rows up to which a take updates the consumer's arrays row by row


class TransferDock(DockCheckpoint):
    """Central store of one step's experience. See `docs/transfer_dock.md` for the contract.

    Args:
        columns: names of the columns (e.g. "prompts", "responses", "old_log_prob").
        consumers: names of the stages that read (e.g. "actor_train").
        prompts_num: prompts per step; the dock holds `prompts_num * n_samples_per_prompt` rows.
        n_samples_per_prompt: responses per prompt (the GRPO group size).
        guarantee_order: hand rows out strictly in index order (deterministic runs).
        samplers: per-consumer sampler overriding the default (see `samplers.py`).
        default_timeout: seconds a blocking get waits when it is given no timeout.
        event_log_size: events kept for the timeline (older ones are dropped).
    """

    def __init__(
        self,
        columns: Sequence[str],
        consumers: Sequence[str],
        prompts_num: int,
        n_samples_per_prompt: int = 1,
        *,
        guarantee_order: bool = False,
        samplers: Mapping[str, Sampler] | None = None,
        default_timeout: float = 600.0,
        event_log_size: int = 100_000,
    ) -> None:
        self.columns = unique_names("columns", columns)
        self.consumers = unique_names("consumers", consumers)
        for name, v in (("prompts_num", prompts_num), ("n_samples_per_prompt", n_samples_per_prompt)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise DockValueError(f"TransferDock: {name}={v!r}; it must be an integer >= 1")
        if not isinstance(default_timeout, (int, float)) or not math.isfinite(default_timeout) or default_timeout <= 0:
            raise DockValueError(f"TransferDock: default_timeout={default_timeout!r}; it must be > 0 seconds "
                                 "(nothing in the dock waits forever)")
        samplers = dict(samplers or {})
        unknown = sorted(set(samplers) - set(self.consumers))
        if unknown:
            raise DockKeyError(f"TransferDock: samplers given for unknown consumers {unknown}; "
                               f"consumers are {self.consumers}")
        self.prompts_num = int(prompts_num)
        self.n_samples_per_prompt = int(n_samples_per_prompt)
        self.capacity = self.prompts_num * self.n_samples_per_prompt
        self.guarantee_order = guarantee_order
        self.default_timeout = float(default_timeout)
        self.step = 0
        self.metrics = DockMetrics(event_log_size=event_log_size)
        self.metrics.register(self.consumers, self.columns)
        # re-entrant: the actor's dock (shared_dock.SharedDock) wraps methods that take it in methods that take it
        self._cond = threading.Condition(threading.RLock())
        self._cells: dict[str, list] = {c: [None] * self.capacity for c in self.columns}
        self._written = {c: np.zeros(self.capacity, dtype=bool) for c in self.columns}
        self._written_count = {c: 0 for c in self.columns}
        self._numel = {c: np.zeros(self.capacity, dtype=np.int32) for c in self.columns}
        self._kind: dict[str, str] = {}  # column -> row type and dtype written this step
        self._retired = np.zeros(self.capacity, dtype=bool)  # rows no consumer is handed this step
        self._extent = self.capacity  # rows 0 .. extent-1 are in the step (set_extent: a growing step)
        default = OrderedSampler if guarantee_order else AnyReadySampler
        self._state = {c: ConsumerState(samplers.get(c) or default(), self.capacity, self.n_samples_per_prompt)
                       for c in self.consumers}

    # ------------------------------------------------------------------ put
    def put_experience(
        self,
        data: Mapping[str, Sequence[Any]],
        indexes: Sequence[int],
        *,
        overwrite: bool = False,
        producer: str | None = None,
        worker: str | None = None,
    ) -> None:
        """Write `data[column][i]` into row `indexes[i]`. All or nothing: a bad put changes nothing.

        Each value is a 1-D tensor or array (one row); a 2-D tensor or array stands for its rows.
        Writing a cell twice is an error unless `overwrite=True`. `producer` (the stage) and
        `worker` (which process of it) only label the put in the event log.
        """
        rows = {c: checked_rows(c, v) for c, v in self._checked_data(data).items()}
        kinds = {c: row_kind(v[0]) for c, v in rows.items() if len(v)}
        self.put_cells(rows, indexes, overwrite=overwrite, producer=producer, kinds=kinds, worker=worker)

    def put_cells(
        self,
        data: Mapping[str, Sequence[Any]],
        indexes: Sequence[int],
        *,
        overwrite: bool = False,
        producer: str | None = None,
        kinds: Mapping[str, str] | None = None,
        worker: str | None = None,
    ) -> None:
        """`put_experience` without the value-type check, for wrappers whose cells are not tensors
        (the Ray actor stores references). A cell needs `len()` (tokens) and `nbytes`. `kinds`
        names each column's row type and dtype (see `row_kind`): one column keeps one kind per step."""
        data = self._checked_data(data)
        idx = self._checked_indexes("put_experience", indexes)
        for column, values in data.items():
            if len(values) != len(idx):
                raise DockValueError(
                    f"put_experience: column '{column}' has {len(values)} values for {len(idx)} indexes; "
                    "give one value per index")
        t = time.time()
        with self._cond:
            beyond = idx[idx >= self._extent]
            if len(beyond):
                raise DockIndexError(
                    f"put_experience: rows {preview(beyond.tolist())} are beyond the step's extent: rows 0 .. "
                    f"{self._extent - 1} are in the step so far; call set_extent() to take more rows in first")
            for column, kind in (kinds or {}).items():
                if self._kind.get(column, kind) != kind:
                    raise DockValueError(
                        f"put_experience: column '{column}' holds {self._kind[column]} rows this step, got {kind}; "
                        "give one column's rows one type and dtype")
            if not overwrite:
                for column in data:
                    again = idx[self._written[column][idx]]
                    if len(again):
                        raise DockValueError(
                            f"put_experience: column '{column}' is already written at rows {preview(again.tolist())}; "
                            "each cell is written once per step (pass overwrite=True to replace it)")
            nbytes = 0
            idx_list = idx.tolist()
            for column, values in data.items():
                cells, numel = self._cells[column], self._numel[column]
                for r, v in zip(idx_list, values):
                    cells[r] = v
                    numel[r] = len(v)
                    nbytes += cell_nbytes(v)
                fresh = int(np.count_nonzero(~self._written[column][idx]))
                self._written[column][idx] = True
                self._written_count[column] += fresh
            self._kind.update(kinds or {})
            self._refresh_ready(set(data), idx)
            self.metrics.on_put(producer or "+".join(data), self.step, {c: len(idx) for c in data}, nbytes, t,
                                worker)
            self._cond.notify_all()

    # ------------------------------------------------------------------ get
    def get_experience(
        self,
        consumer: str,
        columns: Sequence[str],
        count: int,
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = False,
        blocking: bool = False,
        timeout: float | None = None,
        worker: str | None = None,
    ) -> tuple[dict[str, list], list[int]]:
        """Take up to `count` ready rows for `consumer`; see the module doc and `docs/transfer_dock.md`.

        Returns `({column: [row values]}, row_indexes)`, or `({}, [])` when nothing can be handed
        out now (or `consumer` has taken every row of this step). With `blocking=True` it waits
        for a put, at most `timeout` seconds (the dock's `default_timeout` if None), then raises
        `DockTimeoutError` describing what is ready and what is missing. `worker` only labels the
        get in the event log (which process of the consumer asked).
        """
        columns, idx = self.checked_get(consumer, columns, count, indexes, get_n_samples, timeout)
        t_start = time.time()
        deadline = t_start + (self.default_timeout if timeout is None else float(timeout))
        with self._cond:
            while True:
                got = self.try_take(consumer, columns, count, idx, get_n_samples, raise_missing=not blocking)
                if got is not None or not blocking:
                    return self.finish_get(consumer, columns, count, idx, got, t_start, worker=worker)
                left = deadline - time.time()
                if left <= 0:
                    return self.finish_get(consumer, columns, count, idx, None, t_start, timed_out=True,
                                           worker=worker)
                self._cond.wait(left)

    def checked_get(self, consumer, columns, count, indexes, get_n_samples,
                    timeout: float | None = None) -> tuple[list[str], np.ndarray | None]:
        """Validate a get's arguments (before any waiting); returns the columns and row indexes."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0):
            raise DockValueError(f"get_experience: consumer '{consumer}' gave timeout={timeout!r}; give a finite "
                                 "number of seconds >= 0, or None for the dock's default_timeout")
        columns = self._checked_request(consumer, columns, count, indexes, get_n_samples)
        return columns, (None if indexes is None else self._checked_indexes("get_experience", indexes))

    def finish_get(self, consumer, columns, count, idx, got, t_start: float, timed_out: bool = False,
                   worker: str | None = None):
        """Record a get in the metrics and event log; raise the timeout error if it timed out."""
        t_end = time.time()
        if timed_out:
            self.metrics.on_get(consumer, self.step, 0, 0, t_end - t_start, t_start, t_end, worker)
            raise DockTimeoutError(self.describe_wait(consumer, columns, count, idx, t_end - t_start))
        data, rows = got if got is not None else ({}, [])
        nbytes = sum(cell_nbytes(v) for values in data.values() for v in values)
        self.metrics.on_get(consumer, self.step, len(rows), nbytes, t_end - t_start, t_start, t_end, worker)
        return data, rows

    def try_take(
        self,
        consumer: str,
        columns: list[str],
        count: int,
        idx: np.ndarray | None,
        get_n_samples: bool,
        raise_missing: bool = True,
    ) -> tuple[dict[str, list], list[int]] | None:
        """One non-blocking attempt, arguments already checked; the caller holds the lock (or is
        the only thread, as in the async actor). None means "not now"; ({}, []) means "no more rows
        for this consumer this step"."""
        state = self._state[consumer]
        if idx is not None:
            gone = idx[self._retired[idx]]
            if len(gone):
                raise DockValueError(
                    f"get_experience: consumer '{consumer}' asked by index for rows {preview(gone.tolist())}, which "
                    "were retired this step (dropped groups: no consumer is handed them); ask for other rows")
            # Checked under the lock, and before the missing cells: waiting cannot un-take a row.
            again = idx[state.taken[idx]]
            if len(again):
                raise DockValueError(
                    f"get_experience: consumer '{consumer}' already took rows {preview(again.tolist())} this step; "
                    "each row goes to a consumer once per step. Ask by index only for rows it has not taken "
                    "(another consumer name reads them independently), or clear() to start the next step")
            missing = self._missing(columns, idx)
            if missing:
                if raise_missing:
                    detail = "; ".join(f"'{c}' at rows {preview(r)}" for c, r in missing.items())
                    raise MissingDataError(f"get_experience: consumer '{consumer}' asked by index for unwritten "
                                           f"cells: {detail}; put them first or call with blocking=True")
                return None
            rows = idx.tolist()
            if state.reserved.intersection(rows):  # a sampler's held-back rows: hand them all back
                self._release(state, list(state.reserved))
                state.sampler.reset()
        else:
            left = self.capacity - state.taken_count
            if left == 0:
                return {}, []
            growing = self._extent < self.capacity
            if growing:  # rows above the extent may still come: the tail is what is left below it
                left = self._extent - int(np.count_nonzero(state.taken[:self._extent]))
                if left == 0:
                    return None
            want = min(count, left)
            if get_n_samples:  # only groups none of whose rows were taken (by index) can go whole
                untouched = state.untouched_groups
                if growing:
                    untouched = int(np.count_nonzero(state.group_taken[:self._extent // self.n_samples_per_prompt] == 0))
                    if untouched == 0 and state.untouched_groups:
                        return None
                want = min(count, untouched * self.n_samples_per_prompt)
                if want == 0:
                    return {}, []
            req = SampleRequest(
                consumer=consumer, ready=self._view(state, columns), want=want, group=get_n_samples,
                n_samples_per_prompt=self.n_samples_per_prompt, is_blocked=lambda r: bool(state.blocked[r]),
                cursor=state.cursor, row_tokens=lambda rs: self._tokens(columns, rs),
                reserve=lambda rs: self._reserve(state, rs), release=lambda rs: self._release(state, rs),
            )
            rows = state.sampler.select(req)
            self.metrics.rows_examined += req.examined[0]
            if not rows:
                return None
            if len(rows) != want or not req.ready.rows.issuperset(rows):  # a sampler bug must not lose rows
                raise RuntimeError(f"TransferDock: sampler {type(state.sampler).__name__} of consumer '{consumer}' "
                                   f"picked rows {preview(rows)} that are not {want} ready rows")
        self._take(state, rows)
        return {c: [self._cells[c][r] for r in rows] for c in columns}, rows

    # ------------------------------------------------------------------ step control
    def all_consumed(self, consumer: str) -> bool:
        """True once every row of this step went to `consumer`."""
        self._checked_consumer(consumer)
        with self._cond:
            return self._state[consumer].taken_count == self.capacity

    def retire(self, indexes: Sequence[int]) -> None:
        """Take whole prompt groups out of this step for every consumer: no consumer is handed any of
        their rows from now on, and they count as consumed (`all_consumed`). Rows a consumer took
        before stay taken by it. Dynamic sampling retires the groups whose rewards are all equal, and
        a growing step its rows that were never drawn (`set_extent`).

        All or nothing, and bad input changes nothing: rows out of range (`DockIndexError`), part of
        a group, a row given twice or a row already retired (`DockValueError`) refuse the whole call.
        """
        idx = self._checked_indexes("retire", indexes)
        n = self.n_samples_per_prompt
        groups = np.unique(idx // n)
        if len(groups) * n != len(idx):
            counts = np.bincount(idx // n)
            part = np.flatnonzero((counts > 0) & (counts < n)).tolist()
            raise DockValueError(
                f"retire: rows {preview(sorted(idx.tolist()))} hold only part of prompt groups {preview(part)}; retire "
                f"whole groups (prompt p owns rows p*{n} .. p*{n}+{n - 1}), a group goes on or is dropped as a whole")
        with self._cond:
            again = idx[self._retired[idx]]
            if len(again):
                raise DockValueError(f"retire: rows {preview(again.tolist())} are already retired this step; "
                                     "retire each group once")
            rows = np.sort(idx)
            self._retired[rows] = True
            for state in self._state.values():
                if state.reserved.intersection(rows.tolist()):  # a sampler's held-back rows: hand them all back
                    self._release(state, list(state.reserved))
                    state.sampler.reset()
                fresh = rows[~state.taken[rows]]
                if len(fresh):
                    state.retired[fresh] = True
                    state.retired_count += len(fresh)
                    self._take(state, fresh.tolist())
            self.metrics.rows_retired += len(rows)
            self._cond.notify_all()

    def set_extent(self, rows: int) -> None:
        """A growing step (dynamic sampling): only rows `0 .. rows-1` are in the step so far.

        A get then counts its tail in those rows: it hands out fewer than `count` rows once fewer
        are left below the extent, and a consumer that has taken them all waits for the step to
        grow, as for unwritten rows. A put above the extent is refused. The step ends when every
        row is taken or retired: retire the rows above the extent that will not be drawn.
        `rows` is a whole number of prompt groups; lowering the extent is refused when a row at or
        above the new one is written or taken. `clear()` puts the extent back to every row.
        """
        n = self.n_samples_per_prompt
        if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or not 0 <= rows <= self.capacity \
                or rows % n:
            raise DockValueError(f"set_extent: rows={rows!r}; give a whole number of prompt groups, a multiple of "
                                 f"n_samples_per_prompt={n} in [0, {self.capacity}]")
        rows = int(rows)
        with self._cond:
            if rows < self._extent:
                used = [c for c in self.columns if self._written[c][rows:].any()]
                took = [c for c, s in self._state.items() if (s.taken[rows:] & ~s.retired[rows:]).any()]
                if used or took:
                    raise DockValueError(f"set_extent: rows={rows} would leave out rows already written (columns "
                                         f"{used}) or taken (consumers {took}) this step; the extent only grows "
                                         "within a step")
            self._extent = rows
            self._cond.notify_all()

    def clear(self) -> None:
        """Empty the dock for the next step; memory goes back to its baseline."""
        with self._cond:
            self._retired[:] = False
            self._extent = self.capacity
            for c in self.columns:
                self._cells[c] = [None] * self.capacity
                self._written[c][:] = False
                self._written_count[c] = 0
                self._numel[c][:] = 0
            self._kind.clear()
            for s in self._state.values():
                s.reset(self.n_samples_per_prompt)
            self.step += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ observability
    def get_consumer_status(self) -> dict[str, dict[str, Any]]:
        """Per consumer: rows taken / rows total this step."""
        with self._cond:
            return {c: {"taken": s.taken_count - s.retired_count, "retired": s.retired_count, "total": self.capacity,
                        "all_consumed": s.taken_count == self.capacity}
                    for c, s in self._state.items()}

    def get_column_status(self) -> dict[str, dict[str, int]]:
        """Per column: rows written / rows total this step. `total` leaves out the rows retired before the
        column was written there: they will never be (so `written == total` still means "complete")."""
        with self._cond:
            retired = self._retired if self._retired.any() else None
            return {c: {"written": self._written_count[c],
                        "total": self.capacity - (0 if retired is None
                                                  else int(np.count_nonzero(retired & ~self._written[c])))}
                    for c in self.columns}

    def get_metrics(self) -> dict[str, float]:
        """Counters since the dock was made (see `metrics.py`), plus this step's progress."""
        with self._cond:
            out = self.metrics.as_dict()
            out["step"] = float(self.step)
            out["step_rows_retired"] = float(np.count_nonzero(self._retired))
            for c, s in self._state.items():
                out[f"consumer/{c}/step_rows_taken"] = float(s.taken_count - s.retired_count)
            for c in self.columns:
                out[f"column/{c}/step_rows_written"] = float(self._written_count[c])
            return out

    def get_event_log(self, since: int = 0) -> list[dict]:
        """Events (put/get with times, stage, worker, step, rows, bytes) with sequence number > `since`."""
        with self._cond:
            return self.metrics.events_since(since)

    def describe_wait(self, consumer: str, columns: Sequence[str], count: int, idx: np.ndarray | None,
                      waited_s: float) -> str:
        """Why a get for `consumer` cannot be answered: what is ready, taken and missing."""
        state = self._state[consumer]
        ready = len(self._view(state, list(columns)).rows) if idx is None else 0
        per_column = ", ".join(
            f"'{c}' written {self._written_count[c]}/{self.capacity}" for c in columns)
        missing = self._missing(list(columns), np.arange(self.capacity) if idx is None else idx)
        miss = "; ".join(f"'{c}' missing at rows {preview(r)}" for c, r in missing.items()) or "none"
        asked = f"rows {preview(idx.tolist())}" if idx is not None else f"{count} rows"
        grow = (f"; the step holds rows 0 .. {self._extent - 1} so far (set_extent)" if self._extent < self.capacity
                else "")
        return (f"TransferDock step {self.step}: consumer '{consumer}' waited {waited_s:.1f} s for {asked} of "
                f"columns {list(columns)} and timed out. Ready now: {ready}; taken: {state.taken_count}/{self.capacity} "
                f"({state.retired_count} of them retired{grow}); "
                f"{per_column}; missing cells: {miss}. A producer of the missing columns is slow, stalled or crashed.")

    # ------------------------------------------------------------------ internals
    def _checked_data(self, data: Mapping[str, Sequence[Any]]) -> Mapping[str, Sequence[Any]]:
        if not isinstance(data, Mapping) or not data:
            raise DockValueError(f"put_experience: data must be a non-empty dict column -> values, got {type(data).__name__}")
        unknown = [c for c in data if c not in self._cells]
        if unknown:
            raise DockKeyError(f"put_experience: unknown columns {unknown}; the dock's columns are {self.columns}")
        return data

    def _checked_indexes(self, where: str, indexes: Sequence[int], allow_empty: bool = False) -> np.ndarray:
        rows = checked_index_list(where, indexes)
        if not rows:
            if allow_empty:
                return np.zeros(0, dtype=np.int64)
            raise DockValueError(f"{where}: indexes is empty; give at least one row index")
        try:
            idx = np.asarray(rows)
        except (TypeError, ValueError):  # ragged nesting
            raise DockValueError(f"{where}: indexes must be a flat sequence of ints, got {preview(rows)}") from None
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise DockValueError(f"{where}: indexes must be a flat sequence of ints, got dtype {idx.dtype}, "
                                 f"shape {idx.shape}")
        bad = idx[(idx < 0) | (idx >= self.capacity)]
        if len(bad):
            raise DockIndexError(f"{where}: row indexes {preview(bad.tolist())} are out of range; rows are "
                                 f"0 .. {self.capacity - 1} (prompts_num={self.prompts_num} x "
                                 f"n_samples_per_prompt={self.n_samples_per_prompt})")
        uniq, counts = np.unique(idx, return_counts=True)
        if len(uniq) != len(idx):
            raise DockValueError(f"{where}: duplicate row indexes {preview(uniq[counts > 1].tolist())}; "
                                 "give each row once")
        return idx.astype(np.int64, copy=False)

    def _checked_consumer(self, consumer: str) -> None:
        if consumer not in self._state:
            raise DockKeyError(f"TransferDock: unknown consumer '{consumer}'; the dock's consumers are {self.consumers}")

    def _checked_request(self, consumer, columns, count, indexes, get_n_samples) -> list[str]:
        self._checked_consumer(consumer)
        if isinstance(columns, str):
            columns = [columns]
        columns = list(columns)
        if not columns:
            raise DockValueError(f"get_experience: consumer '{consumer}' asked for no columns; name at least one")
        unknown = [c for c in columns if c not in self._cells]
        if unknown:
            raise DockKeyError(f"get_experience: consumer '{consumer}' asked for unknown columns {unknown}; "
                               f"the dock's columns are {self.columns}")
        if indexes is None:
            if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count <= 0:
                raise DockValueError(f"get_experience: consumer '{consumer}' asked for count={count!r}; "
                                     "it must be an integer > 0")
            if get_n_samples and count % self.n_samples_per_prompt:
                raise DockValueError(
                    f"get_experience: consumer '{consumer}' asked for count={count} with get_n_samples=True; "
                    f"count counts rows and must be a multiple of n_samples_per_prompt={self.n_samples_per_prompt}")
        return columns

    def _all_written(self, columns, idx: np.ndarray) -> np.ndarray:
        """Per row of `idx`: are all `columns` written there? (Readiness also needs "not taken".)"""
        ok = np.ones(len(idx), dtype=bool)
        for c in columns:
            ok &= self._written[c][idx]
        return ok

    def _missing(self, columns: list[str], idx: np.ndarray) -> dict[str, list[int]]:
        out = {}
        for c in columns:
            miss = idx[~self._written[c][idx]]
            if len(miss):
                out[c] = miss.tolist()
        return out

    def _view(self, state: ConsumerState, columns: list[str]) -> ReadyRows:
        key = frozenset(columns)
        view = state.views.get(key)
        if view is None:  # first get with this column set: one vectorized scan, then kept current
            view = ReadyRows(key, self.capacity, self.n_samples_per_prompt)
            ok = ~state.blocked
            for c in key:
                ok &= self._written[c]
            view.add(np.flatnonzero(ok).tolist())
            state.views[key] = view
        return view

    def _refresh_ready(self, columns: set[str], idx: np.ndarray) -> None:
        """After a put: rows whose requested columns are now all written become ready."""
        for state in self._state.values():
            for key, view in state.views.items():
                if key & columns:
                    ok = self._all_written(key, idx) & ~state.blocked[idx]
                    if ok.any():
                        view.add(idx[ok].tolist())

    def _take(self, state: ConsumerState, rows: list[int]) -> None:
        if not rows:
            return
        if len(rows) <= SMALL_TAKE:  # a micro-batch: per-row Python beats numpy's per-call cost (~40 us)
            taken, blocked, group_taken, n = state.taken, state.blocked, state.group_taken, self.n_samples_per_prompt
            fresh = [r for r in rows if not taken[r]]  # callers pass untaken rows; count only those
            for r in fresh:
                g = r // n
                if group_taken[g] == 0:
                    state.untouched_groups -= 1
                group_taken[g] += 1
            state.taken_count += len(fresh)
            for r in rows:
                taken[r] = True
                blocked[r] = True
        else:
            fresh = np.asarray(rows, dtype=np.int64)[~state.taken[rows]]
            state.taken_count += len(fresh)
            groups = fresh // self.n_samples_per_prompt
            state.untouched_groups -= int(np.count_nonzero(state.group_taken[np.unique(groups)] == 0))
            np.add.at(state.group_taken, groups, 1)
            state.taken[rows] = True
            state.blocked[rows] = True
        state.reserved.difference_update(rows)
        for view in state.views.values():
            view.discard(rows)
        self._advance_cursor(state)

    def _advance_cursor(self, state: ConsumerState) -> None:
        while state.cursor < self.capacity and state.taken[state.cursor]:
            state.cursor += 1

    def _reserve(self, state: ConsumerState, rows: list[int]) -> None:
        state.blocked[rows] = True
        state.reserved.update(rows)
        for view in state.views.values():
            view.discard(rows)

    def _release(self, state: ConsumerState, rows: list[int]) -> None:
        if not rows:
            return
        state.reserved.difference_update(rows)
        idx = np.asarray(rows, dtype=np.int64)
        idx = idx[~state.taken[idx]]
        state.blocked[idx] = False
        for key, view in state.views.items():
            view.add(idx[self._all_written(key, idx)].tolist())

    def _tokens(self, columns: list[str], rows: list[int]) -> np.ndarray:
        tokens = np.zeros(len(rows), dtype=np.int64)
        for c in columns:
            tokens += self._numel[c][rows]
        return tokens
