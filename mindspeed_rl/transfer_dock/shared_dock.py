"""The dock actor's `TransferDock` when consumers claim rows locally (`claims.py`): every call
that reads or changes a consumer's taken rows first reads that consumer's claim log, and every put
publishes the cells' places and the rows that became ready to the shared files.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .claim_files import C_ENABLED
from .claims import ClaimBoard
from .dock import TransferDock
from .samplers import AnyReadySampler


class SharedDock(TransferDock):
    """The actor's `TransferDock`, kept in step with a `ClaimBoard` (see `claims.py`).

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
