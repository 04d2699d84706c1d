"""The shared files of local claims (`claims.py`): their layouts, their maps, their lock.

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

Both ends map the same layouts (`table_layout`, `consumer_layout`); the header slots and ready-list
fields are named by the constants below.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import time
from typing import Any

import numpy as np

from .errors import DockTimeoutError

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


def table_layout(n_columns: int, capacity: int):
    return _layout([("hdr", np.int64, (8,)), ("kinds", np.uint8, (MAX_KINDS, 2, KIND_BYTES)),
                    ("seg", np.int32, (n_columns, capacity)), ("off", np.int64, (n_columns, capacity)),
                    ("numel", np.int64, (n_columns, capacity)), ("kind", np.int8, (n_columns, capacity)),
                    ("paths", np.uint8, (MAX_SEGMENTS, PATH_BYTES))])


def consumer_layout(n_columns: int, capacity: int):
    return _layout([("hdr", np.int64, (8,)), ("taken", np.uint8, (capacity,)), ("claims", np.int32, (capacity,)),
                    ("vcols", np.uint8, (MAX_VIEWS, n_columns)), ("vstate", np.int64, (MAX_VIEWS, 4)),
                    ("vlog", np.int32, (MAX_VIEWS, capacity)), ("rt", np.float64, (RING, 2)),
                    ("ri", np.int64, (RING, 4)), ("rw", np.uint8, (RING, WORKER_BYTES))])


class Mapped:
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


def lock_file(fd: int, what: str) -> None:
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


def text_of(raw: np.ndarray) -> str:
    return bytes(raw).rstrip(b"\0").decode()


def put_text(raw: np.ndarray, text: str) -> None:
    data = text.encode()[:len(raw)]
    raw[:] = 0
    raw[:len(data)] = np.frombuffer(data, dtype=np.uint8)
