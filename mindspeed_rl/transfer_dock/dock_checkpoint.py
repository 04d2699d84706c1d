"""A dock's checkpoint: its written cells and who took which rows, saved and restored mid-step.

`DockCheckpoint` is a part of `TransferDock` (its base class): the methods read and replace the
dock's own arrays under its lock. A state is checked whole before anything is replaced, so a
rejected one leaves the dock as it was; wrappers (the Ray actor, the shared-memory dock) check
first (`checked_state`) and restore their own cells after (`restore_state`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .errors import DockKeyError, DockValueError
from .rows import checked_state_cells

STATE_VERSION = 1


class DockCheckpoint:
    """`state_dict` / `load_state_dict` of a `TransferDock` (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume mid-step: written cells and who took which rows.

        Rows a sampler had reserved but not handed out are saved as not taken, so they are
        handed out again after a resume rather than lost.
        """
        with self._cond:
            return {
                "version": STATE_VERSION,
                "columns": list(self.columns),
                "consumers": list(self.consumers),
                "prompts_num": self.prompts_num,
                "n_samples_per_prompt": self.n_samples_per_prompt,
                "step": self.step,
                "cells": {c: {int(r): self._cells[c][r] for r in np.flatnonzero(self._written[c]).tolist()}
                          for c in self.columns},
                "taken": {c: np.flatnonzero(s.taken & ~s.retired).tolist() for c, s in self._state.items()},
                "retired": np.flatnonzero(self._retired).tolist(),
                "extent": self._extent,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; the dock's columns, consumers and size must match.

        All or nothing: the whole state is checked before anything is replaced, so a rejected
        state (a `DockError` naming what is wrong) leaves the dock exactly as it was.
        """
        self.restore_state(state, self.checked_state(state))

    def checked_state(self, state: Any) -> dict[str, str]:
        """Check a saved state against this dock without changing anything; returns each
        non-empty column's row kind (see `row_kind`).

        A separate step so that wrappers (the Ray actor) can check the state's real rows before
        they convert them into their own cells and `restore_state` those."""
        if not isinstance(state, Mapping):
            raise DockValueError(f"load_state_dict: the state is a {type(state).__name__}, not a dict; "
                                 "pass what state_dict() returned")
        for key in ("version", "columns", "consumers", "prompts_num", "n_samples_per_prompt", "cells", "taken"):
            if key not in state:
                raise DockValueError(f"load_state_dict: the state has no '{key}'; pass what state_dict() returned")
        if state["version"] != STATE_VERSION:
            raise DockValueError(f"load_state_dict: state version {state['version']}; this dock reads {STATE_VERSION}")
        for key, mine in (("columns", self.columns), ("consumers", self.consumers), ("prompts_num", self.prompts_num),
                          ("n_samples_per_prompt", self.n_samples_per_prompt)):
            if state[key] != mine:
                raise DockValueError(f"load_state_dict: saved {key}={state[key]!r} but this dock has {mine!r}; "
                                     "build the dock with the same layout before loading")
        step = state.get("step", self.step)
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise DockValueError(f"load_state_dict: saved step={step!r}; it must be an integer >= 0")
        cells = _checked_names("cells", "column", state["cells"], self.columns)
        kinds = {}
        for column in self.columns:
            rows = cells[column]
            if not isinstance(rows, Mapping):
                raise DockValueError(f"load_state_dict: cells of column '{column}' are a {type(rows).__name__}; "
                                     "they must be a dict row -> value, as state_dict() gives")
            self._checked_indexes(f"load_state_dict: cells of column '{column}'", list(rows), allow_empty=True)
            if rows:
                kinds[column] = checked_state_cells(column, rows)
        taken = _checked_names("taken", "consumer", state["taken"], self.consumers)
        for consumer in self.consumers:
            self._checked_indexes(f"load_state_dict: rows taken by consumer '{consumer}'",
                                  _taken_rows(taken[consumer]), allow_empty=True)
        retired = self._checked_indexes("load_state_dict: retired rows", _taken_rows(state.get("retired", [])),
                                        allow_empty=True)
        n = self.n_samples_per_prompt
        if len(retired) and np.any(np.bincount(retired // n) % n):
            raise DockValueError("load_state_dict: the state's 'retired' rows hold part of a prompt group; "
                                 "pass what state_dict() returned")
        extent = state.get("extent", self.capacity)
        if not isinstance(extent, (int, np.integer)) or isinstance(extent, bool) or not 0 <= extent <= self.capacity \
                or extent % n:
            raise DockValueError(f"load_state_dict: saved extent={extent!r}; it must be a multiple of "
                                 f"n_samples_per_prompt={n} in [0, {self.capacity}]")
        return kinds

    def restore_state(self, state: Mapping[str, Any], kinds: Mapping[str, str]) -> None:
        """Replace the dock's contents with a state `checked_state` accepted; `kinds` is what it
        returned. Cells are stored as given (the actor passes its own cell objects)."""
        with self._cond:
            for c in self.columns:
                self._cells[c] = [None] * self.capacity
                self._written[c][:] = False
                self._numel[c][:] = 0
                for r, v in state["cells"][c].items():
                    self._cells[c][int(r)] = v
                    self._numel[c][int(r)] = len(v)
                    self._written[c][int(r)] = True
                self._written_count[c] = len(state["cells"][c])
            self._kind = dict(kinds)
            retired = np.asarray(sorted(int(r) for r in state.get("retired", [])), dtype=np.int64)
            self._retired[:] = False
            self._retired[retired] = True
            self._extent = int(state.get("extent", self.capacity))
            for c, s in self._state.items():
                s.reset(self.n_samples_per_prompt)
                s.views = {}
                taken = self._checked_indexes("load_state_dict", _taken_rows(state["taken"][c]), allow_empty=True)
                self._take(s, taken.tolist())
                fresh = retired[~s.taken[retired]]
                s.retired[fresh] = True
                s.retired_count = len(fresh)
                self._take(s, fresh.tolist())
            self.step = int(state.get("step", self.step))
            self._cond.notify_all()


def _checked_names(key: str, what: str, saved: Any, names: Sequence[str]) -> Mapping[str, Any]:
    """A saved state's `cells` or `taken`: a dict with exactly this dock's column or consumer names."""
    if not isinstance(saved, Mapping):
        raise DockValueError(f"load_state_dict: the state's '{key}' is a {type(saved).__name__}; it must be a dict "
                             f"{what} -> rows, as state_dict() gives")
    unknown = [n for n in saved if n not in names]
    if unknown:
        raise DockKeyError(f"load_state_dict: the state's '{key}' names unknown {what}s {unknown}; this dock's "
                           f"{what}s are {list(names)}")
    missing = [n for n in names if n not in saved]
    if missing:
        raise DockKeyError(f"load_state_dict: the state's '{key}' has no entry for {what}s {missing}; "
                           "pass what state_dict() returned")
    return saved


def _taken_rows(rows: Any) -> Any:
    """A saved consumer's taken rows; their order means nothing, so a set is as good as a list."""
    return sorted(rows) if isinstance(rows, (set, frozenset)) else rows
