"""Errors the dock raises. Each message names the column, consumer or row and what was expected.

They subclass the built-in types users already catch (`ValueError`, `KeyError`, `IndexError`,
`TimeoutError`), and all share `DockError`, so one `except DockError` catches any of them.
"""
from __future__ import annotations


class DockError(Exception):
    """Any error raised by the TransferDock."""


class DockValueError(DockError, ValueError):
    """Bad arguments: lengths, duplicates, counts, a cell written twice."""


class DockKeyError(DockError, KeyError):
    """An unknown column or consumer."""

    def __str__(self) -> str:  # KeyError quotes its message; show it as written
        return str(self.args[0]) if self.args else ""


class DockIndexError(DockError, IndexError):
    """A row index outside 0 .. capacity-1."""


class MissingDataError(DockValueError):
    """Rows asked for by index whose columns are not written yet."""


class DockTimeoutError(DockError, TimeoutError):
    """A blocking get that could not be answered in time; says what is ready and what is missing."""


def preview(rows, limit: int = 8) -> str:
    """Rows for a message: the first few, then how many more."""
    rows = list(rows)
    head = ", ".join(str(r) for r in rows[:limit])
    return f"[{head}{', ...' if len(rows) > limit else ''}] ({len(rows)} rows)"
