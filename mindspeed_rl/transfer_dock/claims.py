"""Local claims: a consumer on the dock's node takes its rows in shared memory, with no round
trip to the dock actor.

Why: with several consumers asking at once, a get that is a request to the one dock actor process
waits on a loaded machine for that process to be scheduled (0.4-1.5 ms between requests on 2 shared
cores, for ~0.13 ms of work each; docs/benchmarks.md, "One micro-batch to 4 consumers"). Plain Ray's
gets go to its object store instead, in parallel. Here the consumer claims its rows itself, so gets
of different consumers queue nowhere.

What lives in shared memory is in `claim_files.py`; the actor's dock that keeps it in step with
every put and take is `shared_dock.SharedDock`. This module holds the two ends: the actor's
`ClaimBoard` and a consumer process's `ClaimClient`.

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
import os
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from .claim_files import (C_CLAIMS, C_ENABLED, C_EXAMINED, C_HEAD, C_TAIL, C_TAKEN, KIND_BYTES, MAX_KINDS,
                          MAX_SEGMENTS, MAX_VIEWS, PATH_BYTES, RING, T_ENABLED, T_STEP, V_ACTIVE, V_LEN, V_POS,
                          WORKER_BYTES, Mapped, consumer_layout, lock_file, put_text, table_layout, text_of)
from .shm import PREFIX, SHM_DIR, ShmBlock, reader


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
        self.table = Mapped(os.path.join(SHM_DIR, f"{PREFIX}{tag}-claims-{pid}"),
                             table_layout(len(self.columns), capacity), create=True)
        self.table.seg[:] = -1
        self.cons = [Mapped(os.path.join(SHM_DIR, f"{PREFIX}{tag}-claims{i}-{pid}"),
                             consumer_layout(len(self.columns), capacity), create=True)
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
            lock_file(self.cons[i].fd, f"consumer '{self.consumers[i]}'")
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
            put_text(self.table.kinds[kid, 0], dtype)
            put_text(self.table.kinds[kid, 1], torch_dtype or "")
            self._kind_ids[key] = kid
        return kid

    def _segment_id(self, path: str) -> int:
        sid = self._seg_ids.get(path)
        if sid is None:
            raw = path.encode()
            if len(self._seg_ids) >= MAX_SEGMENTS or len(raw) >= PATH_BYTES:
                return -1
            sid = len(self._seg_ids)
            put_text(self.table.paths[sid], path)
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
        self.table = Mapped(info["table"], table_layout(len(self._col), self.capacity), create=False)
        self._cons: list[Mapped | None] = [None] * len(self._cons_index)
        self._locks = [threading.Lock() for _ in self._cons_index]
        self._slots: dict[tuple[int, tuple[int, ...]], int] = {}
        self._kinds: dict[int, tuple] = {}  # kind number -> kind: a number's record never changes
        self._paths: dict[int, str] = {}
        self.claims_made = 0  # gets this process answered itself (for tests and curiosity)

    def _consumer(self, i: int) -> Mapped:
        c = self._cons[i]
        if c is None:
            with self._locks[i]:  # one map and one descriptor per consumer and process
                c = self._cons[i]
                if c is None:
                    c = self._cons[i] = Mapped(self.info["consumer_files"][i],
                                                consumer_layout(len(self._col), self.capacity), create=False)
        return c

    def _slot(self, i: int, c: Mapped, cols: tuple[int, ...]) -> int | None:
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
        with self._locks[i]:
            lock_file(c.fd, f"consumer '{consumer}'")
            try:
                got = self._claim_locked(i, c, cols, count, worker, t_start)
            finally:
                fcntl.flock(c.fd, fcntl.LOCK_UN)
        if got is None:
            return None
        picked, places = got
        out = {}
        rd = reader()
        for name, (segs, offs, numels, (dtype, torch_dtype, _)) in zip(columns, places):
            out[name] = rd.rows_at([self._path(sid) for sid in segs], dtype, torch_dtype, offs, numels, copy,
                                   self.node_id)
        return out, picked

    def _claim_locked(self, i: int, c: Mapped, cols: tuple[int, ...], count: int, worker: str | None,
                      t_start: float) -> tuple[list[int], list] | None:
        """The claim itself, under consumer i's lock: (the rows, their cells' places) or None."""
        cap = self.capacity
        table, f = self.table.flat, c.flat
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
        taken = f["taken"]
        picked, j = _untaken(taken, f["vlog"], slot * cap, pos, n, want)
        if len(picked) < want:
            return None
        places = self._places(cols, picked)
        if places is None:
            return None
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
        _record(f, want, nbytes, table["hdr"][T_STEP], worker, t_start)
        self.claims_made += 1
        return picked, places

    def _places(self, cols: tuple[int, ...], picked: list[int]) -> list | None:
        """Per column: the picked rows' (segments, offsets, items, kind), or None when a cell is
        held by the actor (inline or a Ray object) or the rows' kinds differ."""
        cap = self.capacity
        table = self.table.flat
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
        return places

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
            path = self._paths[sid] = text_of(self.table.paths[sid])
        return path


def _untaken(taken, log, at: int, pos: int, n: int, want: int) -> tuple[list[int], int]:
    """The first `want` rows of a ready list (entries pos..n-1 at `at` in `log`) whose taken bit is
    clear, and the entry after the last one read (every row before `pos` is taken)."""
    picked: list[int] = []
    j = pos
    while j < n:
        r = log[at + j]
        j += 1
        if not taken[r]:
            picked.append(r)
            if len(picked) == want:
                break
    return picked, j


def _record(f: dict, rows: int, nbytes: int, step: int, worker: str | None, t_start: float) -> None:
    """One local get in the consumer's ring, for the actor's metrics and event log."""
    hdr = f["hdr"]
    head = hdr[C_HEAD]
    r = head % RING
    rt, ri = f["rt"], f["ri"]
    rt[2 * r], rt[2 * r + 1] = t_start, time.time()
    label = b"" if worker is None else str(worker).encode()[:WORKER_BYTES]
    f["rw"][WORKER_BYTES * r:WORKER_BYTES * r + len(label)] = label
    ri[4 * r], ri[4 * r + 1], ri[4 * r + 2] = rows, nbytes, step
    ri[4 * r + 3] = 0 if worker is None else len(label) + 1
    hdr[C_HEAD] = head + 1


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
