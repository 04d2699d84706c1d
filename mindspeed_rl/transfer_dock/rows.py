"""What a caller hands the dock, checked: a column's rows, row indexes, names, a saved column's cells.

Each check raises a `DockError` that names the call, the column or row, and what to pass instead,
on the caller's own object (before any conversion could hide the mistake). The dock, its Ray
client and its checkpoint all check through these.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .errors import DockValueError, preview

try:  # torch is a core dependency, but the dock itself works on numpy alone
    import torch
except ImportError:  # pragma: no cover
    torch = None


def is_tensor(v: Any) -> bool:
    return torch is not None and isinstance(v, torch.Tensor)


def cell_nbytes(v: Any) -> int:
    """Bytes of one cell: a tensor, an array, or anything with `nbytes` (the actor's cells)."""
    return int(v.nbytes)


def unique_names(what: str, names: Sequence[str]) -> list[str]:
    if isinstance(names, str):
        raise DockValueError(f"TransferDock: {what} must be a list of names, not the string {names!r}")
    names = list(names)
    if not names:
        raise DockValueError(f"TransferDock: {what} is empty; give at least one name")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise DockValueError(f"TransferDock: {what} must be non-empty strings, got {bad}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DockValueError(f"TransferDock: {what} {dup} are given more than once; name each once")
    return names


def checked_state_cells(column: str, rows: Mapping[Any, Any]) -> str:
    """A saved column's cells are 1-D tensors or arrays of one type and dtype; returns that kind,
    or raises a `DockValueError` naming the first row that is not."""
    first_row, first = next(iter(rows.items()))
    for r, v in rows.items():
        if not (is_tensor(v) or isinstance(v, np.ndarray)) or v.ndim != 1:
            what = f"{type(v).__name__} of shape {tuple(v.shape)}" if hasattr(v, "shape") else type(v).__name__
            raise DockValueError(f"load_state_dict: column '{column}', row {r} is a {what}; each saved cell must be a "
                                 "1-D torch.Tensor or numpy array, as state_dict() gives")
        if row_kind(v) != row_kind(first):
            raise DockValueError(f"load_state_dict: column '{column}', row {r} is {row_kind(v)} but row {first_row} is "
                                 f"{row_kind(first)}; a column's cells must share one type and dtype")
    return row_kind(first)


def row_kind(row: Any) -> str:
    """'torch.float32', 'numpy.int64', ...: what one column's rows must all be."""
    return f"{'torch' if is_tensor(row) else 'numpy'}.{str(row.dtype).removeprefix('torch.')}"


def checked_rows(column: str, values: Any) -> list:
    """A column's values as a list of 1-D rows of one dtype, or a `DockValueError` saying why not.

    A 2-D tensor or array stands for its rows.
    """
    if (is_tensor(values) or isinstance(values, np.ndarray)) and values.ndim == 2:
        return list(values)
    if is_tensor(values) or isinstance(values, np.ndarray):
        raise DockValueError(
            f"put_experience: column '{column}' got one {values.ndim}-D {type(values).__name__} of shape "
            f"{tuple(values.shape)}; give a list of 1-D rows, or a 2-D [rows, length] tensor "
            "(for one scalar per row, use x.reshape(-1, 1))")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise DockValueError(f"put_experience: column '{column}' got {type(values).__name__}; "
                             "give a list with one 1-D tensor or array per row")
    values = list(values)
    for i, v in enumerate(values):
        if not (is_tensor(v) or isinstance(v, np.ndarray)) or v.ndim != 1:
            what = f"{type(v).__name__} of shape {tuple(v.shape)}" if hasattr(v, "shape") else type(v).__name__
            raise DockValueError(
                f"put_experience: column '{column}', value {i} is a {what}; each row must be a 1-D "
                "torch.Tensor or numpy array (wrap a scalar as tensor([x]) or reshape(1))")
        if type(v) is not type(values[0]) or v.dtype != values[0].dtype:
            raise DockValueError(
                f"put_experience: column '{column}', value {i} is a {type(v).__name__} of dtype {v.dtype} but value 0 "
                f"is a {type(values[0]).__name__} of dtype {values[0].dtype}; give one column's rows one type and dtype")
    return values


def checked_index_list(where: str, indexes: Any) -> list:
    """The caller's row `indexes` as a list, or a `DockValueError` for a container that is not an
    ordered sequence of ints.

    Refused here, on the caller's own object, because conversion hides them: a set becomes a list
    in hash order (the answer's row order would be undefined) and an object-dtype array's
    `tolist()` gives plain ints. The Ray client calls this before it sends anything.
    """
    if isinstance(indexes, (set, frozenset)):
        try:
            shown = sorted(indexes)
        except TypeError:  # mixed types: shown as they come
            shown = list(indexes)
        raise DockValueError(
            f"{where}: indexes is a {type(indexes).__name__} {preview(shown)}; a set has no "
            "order, so the rows would line up with the values in an undefined order; pass a list, tuple, range "
            "or integer array (e.g. sorted(indexes))")
    if isinstance(indexes, (str, bytes, bytearray)):
        raise DockValueError(f"{where}: indexes is a {type(indexes).__name__} {indexes!r}; pass a list of row ints")
    if isinstance(indexes, np.ndarray) and indexes.dtype == object:
        raise DockValueError(
            f"{where}: indexes is a numpy array of dtype object (shape {indexes.shape}); its items may be "
            "anything, so pass an integer array (indexes.astype(np.int64)) or a list of ints")
    try:
        rows = indexes.tolist() if hasattr(indexes, "tolist") else list(indexes)
    except TypeError:
        raise DockValueError(f"{where}: indexes must be a sequence of ints, got {type(indexes).__name__}") from None
    if not isinstance(rows, list):  # a 0-d array or tensor: tolist() gives its one value
        raise DockValueError(f"{where}: indexes is a 0-d {type(indexes).__name__} holding {rows!r}; pass a 1-D "
                             f"sequence of row ints, e.g. [{rows!r}]")
    return rows
