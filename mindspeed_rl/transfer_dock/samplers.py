"""Which ready rows a get hands out.

The dock keeps, per consumer and per requested column set, the rows that are ready for it (a
`ReadyRows`). A sampler only chooses among those rows: it never scans the dock's status arrays, so
the cost of a get grows with the rows asked for, not with the dock's capacity.

Four samplers cover what RL stages need:
- `AnyReadySampler`: any ready rows; the default, it is what lets stages overlap.
- `OrderedSampler`: rows strictly in index order (`guarantee_order=True`): micro-batch k of a
  consumer is always the same rows, so a run is deterministic whatever the timing.
- whole n-groups: every sampler serves `get_n_samples=True` with complete prompt groups.
- `LengthBalancedSampler`: data-parallel ranks of one consumer get micro-batches with similar
  token counts, so no rank waits for a straggler with all the long responses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np


class ReadyRows:
    """The rows one consumer may take for one column set: all columns written, not yet taken.

    Kept up to date on every put and every take, so asking "what is ready?" costs nothing.
    Rows are also counted per prompt group, so whole groups are found without a scan.
    """

    def __init__(self, columns: frozenset[str], capacity: int, n_samples_per_prompt: int):
        self.columns = columns
        self.n = n_samples_per_prompt
        self.rows: set[int] = set()
        self._group_count = np.zeros(capacity // n_samples_per_prompt, dtype=np.int32)
        self.full_groups: set[int] = set()

    def add(self, rows) -> list[int]:
        """Add rows that became ready; returns those that were not ready before (in order)."""
        n, counts = self.n, self._group_count
        added = []
        for r in rows:
            if r in self.rows:
                continue
            self.rows.add(r)
            added.append(r)
            g = r // n
            counts[g] += 1
            if counts[g] == n:
                self.full_groups.add(g)
        return added

    def discard(self, rows) -> None:
        n, counts = self.n, self._group_count
        for r in rows:
            if r not in self.rows:
                continue
            self.rows.remove(r)
            g = r // n
            if counts[g] == n:
                self.full_groups.discard(g)
            counts[g] -= 1

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class SampleRequest:
    """What a sampler sees of one get: the ready rows, the consumer's progress and sizes."""

    consumer: str
    ready: ReadyRows
    want: int  # rows to hand out now: count, or fewer at the step's tail
    group: bool  # get_n_samples: whole prompt groups only
    n_samples_per_prompt: int
    is_blocked: Callable[[int], bool]  # row already taken or reserved by this consumer
    cursor: int  # lowest row this consumer has not taken (rows below it are all taken)
    row_tokens: Callable[[list[int]], np.ndarray]  # tokens per row over the requested columns
    reserve: Callable[[list[int]], None]  # hold rows back from every other pick of this consumer
    release: Callable[[list[int]], None]  # undo reserve (the rows become ready again, or are handed out)
    examined: list[int] = field(default_factory=lambda: [0])  # rows looked at (for metrics)


class Sampler(Protocol):
    def select(self, req: SampleRequest) -> list[int]:
        """Return exactly `req.want` ready rows (whole groups if `req.group`), or [] to wait."""

    def reserved_rows(self) -> list[int]:
        """Rows this sampler holds back for later gets (returned to the dock on save/clear)."""

    def reset(self) -> None:
        """Forget everything held (called by `clear()` and `load_state_dict()`)."""


def _pop_groups(req: SampleRequest) -> list[int]:
    n = req.n_samples_per_prompt
    n_groups = req.want // n
    if len(req.ready.full_groups) < n_groups:
        return []
    groups = req.ready.full_groups
    rows: list[int] = []
    for _ in range(n_groups):
        g = groups.pop()
        rows.extend(range(g * n, g * n + n))
    groups.update(r // n for r in rows[::n])  # the dock's take() removes them properly
    req.examined[0] += len(rows)
    return rows


class AnyReadySampler:
    """Any ready rows, in no particular order: the cheapest pick and the one that overlaps."""

    def select(self, req: SampleRequest) -> list[int]:
        if req.group:
            return _pop_groups(req)
        ready = req.ready.rows
        if len(ready) < req.want:
            return []
        # set.pop() keeps a search finger, so repeated pops stay O(1) even after many removals.
        rows = [ready.pop() for _ in range(req.want)]
        ready.update(rows)  # the dock's take() removes them with their group counts
        req.examined[0] += len(rows)
        return rows

    def reserved_rows(self) -> list[int]:
        return []

    def reset(self) -> None:
        pass


class OrderedSampler:
    """Rows strictly in index order: a consumer's k-th get always returns the same rows.

    If the next rows in order are not all ready yet, it waits rather than skip ahead; this is
    what makes blocking and non-blocking runs hand identical micro-batches to every stage.
    """

    def select(self, req: SampleRequest) -> list[int]:
        n = req.n_samples_per_prompt
        start = (req.cursor // n) * n if req.group else req.cursor
        rows: list[int] = []
        r = start
        ready = req.ready.rows
        capacity = len(req.ready._group_count) * n
        while len(rows) < req.want:
            if r >= capacity:  # groups partly taken by index reads cannot go out whole
                return []
            req.examined[0] += 1
            if req.group:
                group = range(r, r + n)
                if not any(req.is_blocked(x) for x in group):
                    if not all(x in ready for x in group):
                        return []
                    rows.extend(group)
                r += n
            else:
                if not req.is_blocked(r):
                    if r not in ready:
                        return []
                    rows.append(r)
                r += 1
        return rows

    def reserved_rows(self) -> list[int]:
        return []

    def reset(self) -> None:
        pass


class LengthBalancedSampler:
    """Micro-batches with similar token counts for the `dp_size` ranks of one consumer.

    When a rank asks for `count` rows and no balanced micro-batch is waiting, the sampler takes
    up to `count * dp_size` ready rows at once, cuts them into micro-batches of `count` rows
    (the last one smaller at the step's tail) with near-equal token sums (longest row first, each
    into the lightest micro-batch that still has room), hands one out and reserves the rest for
    the next callers of that consumer. Ranks need not identify themselves: whichever rank calls
    next gets the next balanced micro-batch. Whole-group gets (`get_n_samples`) are served as
    groups, unbalanced.
    """

    def __init__(self, dp_size: int):
        if dp_size < 1:
            raise ValueError(f"LengthBalancedSampler: dp_size={dp_size}; it must be >= 1")
        self.dp_size = dp_size
        self._pending: list[list[int]] = []
        self._pending_columns: frozenset | None = None  # the column set the pending batches are ready for

    def select(self, req: SampleRequest) -> list[int]:
        if req.group:
            return _pop_groups(req)
        if self._pending_columns == req.ready.columns:
            for i, batch in enumerate(self._pending):
                if len(batch) == req.want:
                    del self._pending[i]
                    req.release(batch)
                    return batch
        if self._pending:  # cut for another count or column set: give the rows back, cut anew
            req.release(self.reserved_rows())
            self._pending.clear()
        ready = req.ready.rows
        if len(ready) < req.want:
            return []
        pool = [ready.pop() for _ in range(min(len(ready), req.want * self.dp_size))]
        ready.update(pool)
        req.examined[0] += len(pool)
        sizes = [req.want] * (len(pool) // req.want) + ([len(pool) % req.want] if len(pool) % req.want else [])
        parts: list[list[int]] = [[] for _ in sizes]
        sums = [0] * len(sizes)
        tokens = req.row_tokens(pool)
        for i in np.argsort(-tokens, kind="stable"):
            p = min((p for p in range(len(sizes)) if len(parts[p]) < sizes[p]), key=sums.__getitem__)
            parts[p].append(pool[i])
            sums[p] += int(tokens[i])
        first, self._pending = parts[0], parts[1:]
        self._pending_columns = req.ready.columns
        if self._pending:
            req.reserve(self.reserved_rows())
        return first

    def reserved_rows(self) -> list[int]:
        return [r for b in self._pending for r in b]

    def reset(self) -> None:
        self._pending.clear()
