"""Local claims: a consumer on the dock's node takes its rows in shared memory, with no round
trip to the dock actor.

Why: with several consumers asking at once, a get that is a request to the one dock actor process
waits on a loaded machine for that process to be scheduled (0.4-1.5 ms between requests on 2 shared
cores, for ~0.13 ms of work each; docs/benchmarks.md, "One micro-batch to 4 consumers"). Plain Ray's
gets go to its object store instead, in parallel. Here the consumer claims its rows itself, so gets
of different consumers queue nowhere.

What lives in shared memory (files beside the dock's segments, removed with them):
- `msrl-<tag>-claims-<pid>` (the *table*): per column and row, where the cell lies (segment
  number, byte offset, items) and its *kind* (a number naming its numpy dtype and torch dtype
  or none), -1 when it is not in shared memory (inline, a Ray object, or unwritten); the kinds
  by number; the segment paths by number.
- `msrl-<tag>-claims<i>-<pid>`, one per consumer: its taken bits, the rows claimed locally since
  the actor last looked (the *claim log*), one record per local get for the metrics and the event
  log, and up to `MAX_VIEWS` ready lists, one per column set the consumer reads: every row that
  became ready for that set this step, in order, with a cursor before which all are taken.
  This file is also the consumer's lock (`fcntl.flock`).

Who writes what, and why each row still goes to each consumer exactly once:
- Every change to a consumer's taken bits is made under its lock: a local claim (a client),
  or a take by the actor (`SharedDock._take`, always after the actor has read the claim log,
  under the same lock). A claim takes only rows whose bit is clear and sets them before it
  lets go, so no two callers get the same row, whichever path each takes.
- The actor stays the owner of everything else. Puts are checked by the actor; it
  writes the cells' places into the table, then appends the rows that became ready to each
  ready list under that consumer's lock. A row is in a ready list only once its cells can be
  read. Clear, load_state_dict, state_dict, status calls, metrics and the event log first read
  every claim log (`SharedDock._sync`), so they count the rows taken locally.
- Nothing a claim may read is written in place while it can be read. Each record is written
  whole, then named: a kind or a segment path is written once, under a new number, before any
  cell names it, and never changed after (numbers are not reused while the dock lives); a cell's
  place and kind are written before its row enters a ready list (the flock around that append,
  and around the claim that reads the list, orders the writes before the reads); a cell that a
  claim may already read (overwrite=True) is rewritten only under every consumer's lock. Why: a
  kind kept as one record per column, zeroed and rewritten by every put of that column while other
  processes' claims read it for rows put earlier, lets a claim between the zeroing and the write
  read dtype '' (a TypeError) or no torch dtype (torch rows handed out as numpy arrays: silently
  wrong data for the trainer).
- A client claims only what the actor would hand out to the same call: `count` rows (fewer only
  at the step's tail) of a consumer whose sampler is `AnyReadySampler`, without `indexes` or
  `get_n_samples`, for a column set the actor has made a ready list for (its first get does),
  every cell in shared memory. Anything else, and a get that finds too few rows, is sent to the
  actor, which waits for puts, raises for bad input, times out, and answers the tail.
- A client that dies holding the lock releases it (the kernel drops a dead process's flocks),
  so no crash can wedge the dock; rows it had claimed are lost to it, as rows the actor had
  sent to a process that then died.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np

from .dock import TransferDock
from .errors import DockTimeoutError
from .samplers import AnyReadySampler
from .shm import PREFIX, SHM_DIR, ShmBlock, reader

MAX_VIEWS = 8  # column sets per consumer with a ready list; gets for more sets go to the actor
MAX_SEGMENTS = 4096  # segments the table can name; cells in others go through the actor
PATH_BYTES = 256
KIND_BYTES = 32
MAX_KINDS = 64  # (dtype, torch dtype) pairs the table can name over the dock's life; cells of others go through the actor
RING = 1024  # local gets recorded before the actor must read them (a claim falls back when full)
WORKER_BYTES = 64
LOCK_TIMEOUT_S = 30.0  # a lock held this long: its holder is stopped (a crash releases it)

# table header
T_ENABLED, T_STEP = 0, 1
# consumer header
C_ENABLED, C_TAKEN, C_CLAIMS, C_HEAD, C_TAIL, C_EXAMINED = range(6)
# ready list state
V_ACTIVE, V_LEN, V_POS = range(3)


def _layout(fields: list[tuple[str, Any, tuple]]) -> tuple[list[tuple[str, np.dtype, tuple, int]], int]:
    out, size = [], 0
    for name, dtype, shape in fields:
        dtype = np.dtype(dtype)
        size = -(-size // 64) * 64
        out.append((name, dtype, shape, size))
        size += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return out, max(size, 64)


def _table_layout(n_columns: int, capacity: int):
    return _layout([("hdr", np.int64, (8,)), ("kinds", np.uint8, (MAX_KINDS, 2, KIND_BYTES)),
                    ("seg", np.int32, (n_columns, capacity)), ("off", np.int64, (n_columns, capacity)),
                    ("numel", np.int64, (n_columns, capacity)), ("kind", np.int8, (n_columns, capacity)),
                    ("paths", np.uint8, (MAX_SEGMENTS, PATH_BYTES))])


def _consumer_layout(n_columns: int, capacity: int):
    return _layout([("hdr", np.int64, (8,)), ("taken", np.uint8, (capacity,)), ("claims", np.int32, (capacity,)),
                    ("vcols", np.uint8, (MAX_VIEWS, n_columns)), ("vstate", np.int64, (MAX_VIEWS, 4)),
                    ("vlog", np.int32, (MAX_VIEWS, capacity)), ("rt", np.float64, (RING, 2)),
                    ("ri", np.int64, (RING, 4)), ("rw", np.uint8, (RING, WORKER_BYTES))])


class _Mapped:
    """A shared file's named arrays. Not populated up front: tmpfs gives pages only where written
    (the ready lists of unused column sets cost nothing)."""

    def __init__(self, path: str, layout, create: bool) -> None:
        fields, size = layout
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.path = fd, path
        self.flat: dict[str, memoryview] = {}  # the same fields, flat, for item-by-item access
        for name, dtype, shape, offset in fields:
            setattr(self, name, np.ndarray(shape, dtype, buffer=self.map, offset=offset))
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            self.flat[name] = memoryview(self.map)[offset:offset + n].cast(dtype.char)


def _lock_file(fd: int, what: str) -> None:
    """flock with a bound: a holder stopped mid-claim makes this raise instead of hang."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    deadline, delay = time.monotonic() + LOCK_TIMEOUT_S, 20e-6
    while True:
        time.sleep(delay)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DockTimeoutError(f"TransferDock: the claim lock of {what} was held for {LOCK_TIMEOUT_S:.0f} s; "
                                       "a process of that consumer is stopped mid-get") from None
            delay = min(2 * delay, 1e-3)


def _text(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode()


def _put_text(raw: np.ndarray, text: str) -> None:
    data = text.encode()[:len(raw)]
    raw[:] = 0
    raw[:len(data)] = np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------------------- the actor's side
class ClaimBoard:
    """The dock actor's end: creates the files and keeps them in step with its `SharedDock`.

    Every method runs under the dock's lock (`SharedDock._cond`), so the actor's threads never
    race here; `lock(i)` adds consumer i's file lock, which local claims take too.
    """

    def __init__(self, tag: str, columns: Sequence[str], consumers: Sequence[str], capacity: int,
                 node_id: str) -> None:
        if capacity >= 2 ** 31:
            raise ValueError("local claims: a dock of 2**31 rows or more is not supported")
        pid = os.getpid()
        self.tag, self.columns, self.consumers, self.capacity, self.node_id = \
            tag, list(columns), list(consumers), capacity, node_id
        self.table = _Mapped(os.path.join(SHM_DIR, f"{PREFIX}{tag}-claims-{pid}"),
                             _table_layout(len(self.columns), capacity), create=True)
        self.table.seg[:] = -1
        self.cons = [_Mapped(os.path.join(SHM_DIR, f"{PREFIX}{tag}-claims{i}-{pid}"),
                             _consumer_layout(len(self.columns), capacity), create=True)
                     for i in range(len(self.consumers))]
        self._col = {c: i for i, c in enumerate(self.columns)}
        self._depth = [0] * len(self.consumers)
        self._synced = [0] * len(self.consumers)
        self._slots: list[dict[frozenset, int]] = [{} for _ in self.consumers]
        self._seg_ids: dict[str, int] = {}
        self._kind_ids: dict[tuple[str, str | None], int] = {}
        self.table.hdr[T_ENABLED] = 1
        # held for the actor's life: a client whose try for it succeeds knows the dock is dead
        fcntl.flock(self.table.fd, fcntl.LOCK_SH)

    def info(self) -> dict:
        return {"table": self.table.path, "consumer_files": [c.path for c in self.cons], "columns": self.columns,
                "consumers": self.consumers, "capacity": self.capacity, "node_id": self.node_id, "tag": self.tag}

    # -- locks
    @contextlib.contextmanager
    def lock(self, i: int) -> Iterator[None]:
        """Consumer i's file lock (re-entrant within the actor, whose threads the dock's lock serialises)."""
        if self._depth[i] == 0:
            _lock_file(self.cons[i].fd, f"consumer '{self.consumers[i]}'")
        self._depth[i] += 1
        try:
            yield
        finally:
            self._depth[i] -= 1
            if self._depth[i] == 0:
                fcntl.flock(self.cons[i].fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def lock_all(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for i in range(len(self.consumers)):
                stack.enter_context(self.lock(i))
            yield

    def held(self, i: int) -> bool:
        return self._depth[i] > 0

    # -- switches
    def set_enabled(self, i: int, on: bool) -> None:
        with self.lock(i):
            self.cons[i].hdr[C_ENABLED] = int(on)

    def disable(self) -> None:
        """No local claim from now on (the dock is closing): clients go through the actor."""
        with self.lock_all():
            self.table.hdr[T_ENABLED] = 0

    # -- cells
    def publish_cells(self, column: str, idx: np.ndarray, cells: list) -> None:
        """Where each of `column`'s cells at rows `idx` lies, and its kind; -1 for cells not in
        shared memory. Writes nothing a claim may be reading: the rows `idx` are in no ready list
        yet (or, with overwrite=True, the caller holds every consumer's lock), and a kind or
        segment path is only ever added under a new number (see the module doc)."""
        k = self._col[column]
        seg = np.full(len(idx), -1, dtype=np.int32)
        off = np.zeros(len(idx), dtype=np.int64)
        numel = np.zeros(len(idx), dtype=np.int64)
        kind = np.full(len(idx), -1, dtype=np.int8)
        starts: dict[int, tuple[int, np.ndarray, int]] = {}
        for j, cell in enumerate(cells):
            src = getattr(cell, "source", None)
            if not isinstance(src, ShmBlock):
                continue
            got = starts.get(id(src))
            if got is None:
                sid, kid = self._segment_id(src.segment), self._kind_id(src.dtype, src.torch_dtype)
                first = np.zeros(len(src.numel) + 1, dtype=np.int64)
                np.cumsum(src.numel, out=first[1:])
                got = starts[id(src)] = (sid if kid >= 0 else -1, src.offset + first * src.itemsize, kid)
            if got[0] < 0:
                continue
            seg[j], off[j], numel[j], kind[j] = got[0], got[1][cell.pos], cell.numel, got[2]
        self.table.off[k, idx] = off
        self.table.numel[k, idx] = numel
        self.table.kind[k, idx] = kind
        self.table.seg[k, idx] = seg

    def _kind_id(self, dtype: str, torch_dtype: str | None) -> int:
        """The number of a (numpy dtype, torch dtype or None) pair; a new pair's record is written
        whole before its number is returned, and never changed after, so a claim that finds the
        number in a cell always reads the whole record. -1 when the table cannot name it."""
        key = (dtype, torch_dtype)
        kid = self._kind_ids.get(key)
        if kid is None:
            if (len(self._kind_ids) >= MAX_KINDS or len(dtype.encode()) > KIND_BYTES
                    or len((torch_dtype or "").encode()) > KIND_BYTES):
                return -1
            kid = len(self._kind_ids)
            _put_text(self.table.kinds[kid, 0], dtype)
            _put_text(self.table.kinds[kid, 1], torch_dtype or "")
            self._kind_ids[key] = kid
        return kid

    def _segment_id(self, path: str) -> int:
        sid = self._seg_ids.get(path)
        if sid is None:
            raw = path.encode()
            if len(self._seg_ids) >= MAX_SEGMENTS or len(raw) >= PATH_BYTES:
                return -1
            sid = len(self._seg_ids)
            _put_text(self.table.paths[sid], path)
            self._seg_ids[path] = sid
        return sid

    # -- ready lists (consumer i's lock held)
    def has_list(self, i: int, key: frozenset) -> bool:
        return key in self._slots[i]

    def publish_list(self, i: int, key: frozenset, rows: list[int]) -> None:
        """A new ready list for consumer i and column set `key` (the actor made its ready set)."""
        assert self.held(i)
        slot = self._slots[i].get(key)
        if slot is None:
            if len(self._slots[i]) >= MAX_VIEWS:
                return  # gets for this column set go to the actor
            slot = self._slots[i][key] = len(self._slots[i])
            mask = np.zeros(len(self.columns), dtype=np.uint8)
            mask[[self._col[c] for c in key]] = 1
            self.cons[i].vcols[slot] = mask
        c = self.cons[i]
        c.vstate[slot, V_ACTIVE] = 0
        c.vlog[slot, :len(rows)] = rows
        c.vstate[slot, V_LEN] = len(rows)
        c.vstate[slot, V_POS] = 0
        c.vstate[slot, V_ACTIVE] = 1

    def append_list(self, i: int, key: frozenset, rows: list[int]) -> None:
        assert self.held(i)
        slot = self._slots[i].get(key)
        if slot is None:
            return
        c = self.cons[i]
        n = int(c.vstate[slot, V_LEN])
        if n + len(rows) > self.capacity:  # cannot happen (a row is listed once a step): refuse to guess
            c.hdr[C_ENABLED] = 0
            return
        c.vlog[slot, n:n + len(rows)] = rows
        c.vstate[slot, V_LEN] = n + len(rows)

    # -- taken rows (consumer i's lock held)
    def mark_taken(self, i: int, rows: list[int], taken_count: int) -> None:
        assert self.held(i)
        c = self.cons[i]
        c.taken[rows] = 1
        c.hdr[C_TAKEN] = taken_count

    def pending(self, i: int) -> bool:
        """Whether consumer i has local gets the actor has not read (a racy look: a reader that
        needs the answer exactly holds the lock)."""
        h = self.cons[i].hdr
        return int(h[C_CLAIMS]) != self._synced[i] or int(h[C_HEAD]) != int(h[C_TAIL]) or int(h[C_EXAMINED]) != 0

    def drain(self, i: int) -> tuple[list[int], list[tuple], int]:
        """Consumer i's local gets since the last drain: (rows claimed, records, rows examined)."""
        assert self.held(i)
        c = self.cons[i]
        h = c.hdr
        n, s = int(h[C_CLAIMS]), self._synced[i]
        rows = c.claims[s:n].tolist() if n > s else []
        self._synced[i] = n
        head, tail = int(h[C_HEAD]), int(h[C_TAIL])
        records = []
        for k in range(tail, head):
            j = k % RING
            t0, t1 = c.rt[j].tolist()
            nrows, nbytes, step, wlen = c.ri[j].tolist()
            worker = None if wlen == 0 else bytes(c.rw[j, :wlen - 1]).decode(errors="replace")
            records.append((t0, t1, nrows, nbytes, step, worker))
        h[C_TAIL] = head
        examined = int(h[C_EXAMINED])
        h[C_EXAMINED] = 0
        return rows, records, examined

    def reset(self, step: int) -> None:
        """A new step (clear) or a restored one: no cell in shared memory, nothing taken, ready
        lists empty. Every lock held, every claim log drained."""
        self.table.seg[:] = -1
        self.table.hdr[T_STEP] = step
        for i, c in enumerate(self.cons):
            assert self.held(i)
            c.taken[:] = 0
            c.hdr[C_TAKEN] = c.hdr[C_CLAIMS] = c.hdr[C_HEAD] = c.hdr[C_TAIL] = c.hdr[C_EXAMINED] = 0
            c.vstate[:, V_LEN] = 0
            c.vstate[:, V_POS] = 0
            self._synced[i] = 0

    def set_step(self, step: int) -> None:
        self.table.hdr[T_STEP] = step


class SharedDock(TransferDock):
    """The actor's `TransferDock`, kept in step with a `ClaimBoard` (see the module doc).

    Each override runs under the dock's lock (re-entrant), and under a consumer's file lock
    wherever that consumer's taken rows are read or changed: the claim log is read first
    (`_sync`), so the plain dock's logic then sees every row taken locally.
    """

    board: ClaimBoard | None = None

    def attach(self, board: ClaimBoard) -> None:
        with self._cond:
            self._ci = {name: i for i, name in enumerate(self.consumers)}
            self._index = {id(self._state[name]): i for name, i in self._ci.items()}
            self._rewrite = False
            self.board = board
            for name, i in self._ci.items():
                board.set_enabled(i, type(self._state[name].sampler) is AnyReadySampler)

    def detach(self) -> None:
        """Stop local claims (the dock is closing): the actor answers every get from now on."""
        with self._cond:
            board = self.board
            if board is None:
                return
            with board.lock_all():
                board.disable()
                for i in range(len(self.consumers)):
                    self._sync(i)
            self.board = None

    # -- reading the claim logs
    def _sync(self, i: int) -> None:
        rows, records, examined = self.board.drain(i)
        name = self.consumers[i]
        if rows:
            self._take(self._state[name], rows)
        for t0, t1, nrows, nbytes, step, worker in records:
            self.metrics.on_get(name, step, nrows, nbytes, t1 - t0, t0, t1, worker)
        self.metrics.rows_examined += examined

    def _sync_all(self) -> None:
        board = self.board
        if board is None:
            return
        for i in range(len(self.consumers)):
            if board.pending(i):
                with board.lock(i):
                    self._sync(i)

    # -- taking
    def try_take(self, consumer, columns, count, idx, get_n_samples, raise_missing=True):
        board = self.board
        if board is None:
            return super().try_take(consumer, columns, count, idx, get_n_samples, raise_missing)
        i = self._ci[consumer]
        with self._cond, board.lock(i):
            self._sync(i)
            return super().try_take(consumer, columns, count, idx, get_n_samples, raise_missing)

    def _take(self, state, rows: list[int]) -> None:
        super()._take(state, rows)
        if self.board is not None and rows:
            self.board.mark_taken(self._index[id(state)], rows, state.taken_count)

    def _reserve(self, state, rows: list[int]) -> None:
        self._no_local(state)
        super()._reserve(state, rows)

    def _release(self, state, rows: list[int]) -> None:
        self._no_local(state)
        super()._release(state, rows)

    def _no_local(self, state) -> None:
        """A sampler that holds rows back: its rows are not mirrored, so this consumer's gets all
        go to the actor from now on (only `AnyReadySampler` consumers claim, and it never does)."""
        board = self.board
        if board is not None and board.cons[self._index[id(state)]].hdr[C_ENABLED]:
            board.set_enabled(self._index[id(state)], False)

    # -- ready rows
    def _view(self, state, columns):
        key = frozenset(columns)
        fresh = key not in state.views
        view = super()._view(state, columns)
        board = self.board
        if fresh and board is not None:
            i = self._index[id(state)]
            if board.cons[i].hdr[C_ENABLED]:  # a consumer that never claims needs no list
                with board.lock(i):
                    board.publish_list(i, key, sorted(view.rows))
        return view

    def put_cells(self, data, indexes, *, overwrite=False, **kwargs):
        with self._cond:
            self._rewrite = overwrite
            try:
                return super().put_cells(data, indexes, overwrite=overwrite, **kwargs)
            finally:
                self._rewrite = False

    def _refresh_ready(self, columns: set[str], idx: np.ndarray) -> None:
        board = self.board
        if board is None:
            return super()._refresh_ready(columns, idx)
        # The cells' places first: a row enters a ready list only once it can be read. A cell
        # written again (overwrite=True) may be in the middle of a claim: swap it under every lock.
        with board.lock_all() if self._rewrite else contextlib.nullcontext():
            rows = idx.tolist()
            for c in columns:
                cells = self._cells[c]
                board.publish_cells(c, idx, [cells[r] for r in rows])
        for i, state in enumerate(self._state.values()):
            for key, view in state.views.items():
                if key & columns:
                    ok = self._all_written(key, idx) & ~state.blocked[idx]
                    if ok.any():
                        added = view.add(idx[ok].tolist())
                        if added and board.has_list(i, key):
                            with board.lock(i):
                                board.append_list(i, key, added)

    # -- step control and observability: every claim counted first
    def clear(self) -> None:
        board = self.board
        if board is None:
            return super().clear()
        with self._cond, board.lock_all():
            for i in range(len(self.consumers)):
                self._sync(i)
            super().clear()
            board.reset(self.step)

    def retire(self, indexes) -> None:
        board = self.board
        if board is None:
            return super().retire(indexes)
        # every claim log read first, so rows claimed locally stay taken by their consumer; retired
        # rows' taken bits are set under each consumer's lock (`_take`), so no claim picks them after
        with self._cond, board.lock_all():
            for i in range(len(self.consumers)):
                self._sync(i)
            super().retire(indexes)

    def restore_state(self, state, kinds) -> None:
        board = self.board
        if board is None:
            return super().restore_state(state, kinds)
        with self._cond, board.lock_all():
            for i in range(len(self.consumers)):
                self._sync(i)
            board.reset(self.step)  # restored cells are held by the actor, not in shared memory
            super().restore_state(state, kinds)  # its takes set the restored taken rows
            board.set_step(self.step)

    def describe_wait(self, consumer, columns, count, idx, waited_s):
        board = self.board
        if board is None:
            return super().describe_wait(consumer, columns, count, idx, waited_s)
        i = self._ci[consumer]
        with self._cond, board.lock(i):
            self._sync(i)
            return super().describe_wait(consumer, columns, count, idx, waited_s)

    def all_consumed(self, consumer):
        with self._cond:
            self._sync_all()
            return super().all_consumed(consumer)

    def get_consumer_status(self):
        with self._cond:
            self._sync_all()
            return super().get_consumer_status()

    def get_metrics(self):
        with self._cond:
            self._sync_all()
            return super().get_metrics()

    def get_event_log(self, since: int = 0):
        with self._cond:
            self._sync_all()
            return super().get_event_log(since)

    def state_dict(self):
        with self._cond:
            self._sync_all()
            return super().state_dict()


# ---------------------------------------------------------------------------- the consumer's side
class ClaimClient:
    """One process's end for one dock: its maps of the files and its file descriptors (one per
    consumer: flock excludes other open files, so each process has its own, and its threads take
    a thread lock first)."""

    def __init__(self, info: dict) -> None:
        self.info = info
        self.pid = os.getpid()
        self.capacity = int(info["capacity"])
        self.node_id = info["node_id"]
        self._col = {c: i for i, c in enumerate(info["columns"])}
        self._cons_index = {c: i for i, c in enumerate(info["consumers"])}
        self.table = _Mapped(info["table"], _table_layout(len(self._col), self.capacity), create=False)
        self._cons: list[_Mapped | None] = [None] * len(self._cons_index)
        self._locks = [threading.Lock() for _ in self._cons_index]
        self._slots: dict[tuple[int, tuple[int, ...]], int] = {}
        self._kinds: dict[int, tuple] = {}  # kind number -> kind: a number's record never changes
        self._paths: dict[int, str] = {}
        self.claims_made = 0  # gets this process answered itself (for tests and curiosity)

    def _consumer(self, i: int) -> _Mapped:
        c = self._cons[i]
        if c is None:
            with self._locks[i]:  # one map and one descriptor per consumer and process
                c = self._cons[i]
                if c is None:
                    c = self._cons[i] = _Mapped(self.info["consumer_files"][i],
                                                _consumer_layout(len(self._col), self.capacity), create=False)
        return c

    def _slot(self, i: int, c: _Mapped, cols: tuple[int, ...]) -> int | None:
        slot = self._slots.get((i, cols))
        if slot is None:  # a list's column set never changes once made: look it up once
            mask = np.zeros(len(self._col), dtype=np.uint8)
            mask[list(cols)] = 1
            for s in range(MAX_VIEWS):
                if c.vstate[s, V_ACTIVE] and np.array_equal(c.vcols[s], mask):
                    slot = self._slots[(i, cols)] = s
                    break
        return slot

    def claim(self, consumer: str, columns: list[str], count: int, worker: str | None,
              copy: bool) -> tuple[dict, list[int]] | None:
        """Take `count` ready rows of `consumer` here, or None: the caller then asks the actor
        (too few rows ready, the step's tail, a cell not in shared memory, ...).

        Item by item through memoryviews, not numpy: a micro-batch is a few rows, and each numpy
        call costs more than the Python for all of them. With several consumers on few cores,
        every microsecond here delays the next consumer's get."""
        i = self._cons_index.get(consumer)
        cols = tuple(self._col.get(c, -1) for c in columns)
        if i is None or not cols or -1 in cols or len(set(cols)) != len(cols):
            return None
        t_start = time.time()
        if not (self.table.flat["hdr"][T_ENABLED] and self._alive()):
            return None  # closed, or dead: the actor's own call then answers, or raises that it died
        try:
            c = self._consumer(i)
        except OSError:  # its file is gone: the dock was closed
            return None
        cap = self.capacity
        table, f = self.table.flat, c.flat
        with self._locks[i]:
            _lock_file(c.fd, f"consumer '{consumer}'")
            try:
                hdr, vstate = f["hdr"], f["vstate"]
                if not (table["hdr"][T_ENABLED] and hdr[C_ENABLED]):
                    return None
                slot = self._slot(i, c, tuple(sorted(cols)))
                if slot is None or not vstate[4 * slot + V_ACTIVE]:
                    return None
                taken_count = hdr[C_TAKEN]
                want = min(count, cap - taken_count)
                if want <= 0 or hdr[C_HEAD] - hdr[C_TAIL] >= RING:
                    return None
                n, pos = vstate[4 * slot + V_LEN], vstate[4 * slot + V_POS]
                if n - pos < want:
                    return None
                taken, log = f["taken"], f["vlog"]
                picked: list[int] = []
                j, at = pos, slot * cap
                while j < n:  # the rows before `pos` are all taken
                    r = log[at + j]
                    j += 1
                    if not taken[r]:
                        picked.append(r)
                        if len(picked) == want:
                            break
                if len(picked) < want:
                    return None
                places = []
                seg, off, numel, kinds = table["seg"], table["off"], table["numel"], table["kind"]
                for k in cols:
                    at = k * cap
                    segs = [seg[at + r] for r in picked]
                    if min(segs) < 0:
                        return None  # a cell held by the actor (inline or a Ray object)
                    kid = kinds[at + picked[0]]
                    for r in picked:
                        if kinds[at + r] != kid:  # one kind per column and step: refuse to guess
                            return None
                    places.append((segs, [off[at + r] for r in picked], [numel[at + r] for r in picked],
                                   self._kind(kid)))
                # the claim: every row's bit was clear, and is set before the lock goes
                for r in picked:
                    taken[r] = 1
                hdr[C_TAKEN] = taken_count + want
                m = hdr[C_CLAIMS]
                log = f["claims"]
                for q, r in enumerate(picked):
                    log[m + q] = r
                hdr[C_CLAIMS] = m + want
                vstate[4 * slot + V_POS] = j
                hdr[C_EXAMINED] += j - pos
                nbytes = sum(sum(p[2]) * p[3][2] for p in places)
                head = hdr[C_HEAD]
                r = head % RING
                rt, ri = f["rt"], f["ri"]
                rt[2 * r], rt[2 * r + 1] = t_start, time.time()
                label = b"" if worker is None else str(worker).encode()[:WORKER_BYTES]
                f["rw"][WORKER_BYTES * r:WORKER_BYTES * r + len(label)] = label
                ri[4 * r], ri[4 * r + 1], ri[4 * r + 2] = want, nbytes, table["hdr"][T_STEP]
                ri[4 * r + 3] = 0 if worker is None else len(label) + 1
                hdr[C_HEAD] = head + 1
                self.claims_made += 1
            finally:
                fcntl.flock(c.fd, fcntl.LOCK_UN)
        out = {}
        rd = reader()
        for name, (segs, offs, numels, (dtype, torch_dtype, _)) in zip(columns, places):
            out[name] = rd.rows_at([self._path(sid) for sid in segs], dtype, torch_dtype, offs, numels, copy,
                                   self.node_id)
        return out, picked

    def _alive(self) -> bool:
        """Whether the dock actor lives: it holds a shared lock on the table while it does."""
        try:
            fcntl.flock(self.table.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.table.fd, fcntl.LOCK_UN)
        return False

    def _kind(self, kid: int) -> tuple[str, str | None, int]:
        """Kind number kid's (numpy dtype, torch dtype or None, item size). Read once per number:
        the actor writes a kind's record whole before any cell names it and never changes it."""
        kind = self._kinds.get(kid)
        if kind is None:
            raw = self.table.flat["kinds"][2 * KIND_BYTES * kid:2 * KIND_BYTES * (kid + 1)].tobytes()
            dtype, torch_dtype = raw[:KIND_BYTES].rstrip(b"\0").decode(), raw[KIND_BYTES:].rstrip(b"\0").decode()
            kind = self._kinds[kid] = (dtype, torch_dtype or None, np.dtype(dtype).itemsize)
        return kind

    def _path(self, sid: int) -> str:
        path = self._paths.get(sid)
        if path is None:
            path = self._paths[sid] = _text(self.table.paths[sid])
        return path


_clients: dict[tuple[str, int], ClaimClient | None] = {}
_clients_lock = threading.Lock()


def client_for(info: dict) -> ClaimClient | None:
    """This process's `ClaimClient` for a dock (a forked child makes its own); None when the
    dock's files cannot be opened (a closed dock): the caller asks the actor."""
    key = (info["table"], os.getpid())
    cl = _clients.get(key, False)
    if cl is not False:
        return cl
    with _clients_lock:
        for old in [k for k in _clients if k[1] != os.getpid() or not os.path.exists(k[0])]:
            del _clients[old]  # a parent's, inherited by fork, or a closed dock's: its maps go with it
        if key not in _clients:
            try:
                _clients[key] = ClaimClient(info)
            except OSError:
                _clients[key] = None
        return _clients[key]
