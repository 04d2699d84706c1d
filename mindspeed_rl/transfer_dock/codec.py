"""How a column's rows cross a process boundary.

Ray pickles torch tensors but moves numpy arrays zero-copy through its object store, so rows
travel as one `ColumnBlock`: a flat numpy array of all the rows back to back plus their offsets,
and the torch dtype to restore. One flat buffer per column also avoids per-row object overhead.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# numpy has no bfloat16: such tensors travel as their int16 bit pattern and are viewed back.
_BITCAST = {torch.bfloat16: torch.int16}


@dataclass
class ColumnBlock:
    """Rows of one column, back to back. Row i is `flat[offsets[i]:offsets[i+1]]`."""

    flat: np.ndarray
    offsets: np.ndarray
    torch_dtype: str | None  # None: the rows were numpy arrays

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    @property
    def kind(self) -> str:
        """Row type and dtype, as `dock.row_kind` names them."""
        return f"torch.{self.torch_dtype}" if self.torch_dtype else f"numpy.{self.flat.dtype}"

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row_numel(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def take(self, positions: Sequence[int]) -> "ColumnBlock":
        """A new block with the given rows, in that order (one copy of just those bytes)."""
        positions = list(positions)
        if positions == list(range(len(self))):
            return self
        pieces = [self.flat[self.offsets[p]:self.offsets[p + 1]] for p in positions]
        sizes = [len(x) for x in pieces]
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        flat = np.concatenate(pieces) if pieces else self.flat[:0]
        return ColumnBlock(flat, offsets, self.torch_dtype)


def pack(rows: Sequence[Any]) -> ColumnBlock:
    """Rows (1-D tensors or arrays of one dtype) -> one block."""
    if not len(rows):
        raise ValueError("pack: no rows to pack")
    first = rows[0]
    sizes = [len(r) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if isinstance(first, torch.Tensor):
        dtype = first.dtype
        flat_t = _contiguous_view(rows, int(offsets[-1]))
        if flat_t is None:
            flat_t = torch.cat([r.detach().reshape(-1) for r in rows]) if len(rows) > 1 else first.detach().reshape(-1)
        flat_t = flat_t.detach().cpu()
        if dtype in _BITCAST:
            flat_t = flat_t.view(_BITCAST[dtype])
        return ColumnBlock(flat_t.numpy(), offsets, str(dtype).removeprefix("torch."))
    flat = np.concatenate([np.asarray(r).reshape(-1) for r in rows])
    return ColumnBlock(flat, offsets, None)


def _contiguous_view(rows: Sequence[torch.Tensor], total: int) -> torch.Tensor | None:
    """The rows as one flat tensor without copying, when they already lie back to back in one
    buffer (as the rows of a 2-D tensor do); else None."""
    first = rows[0]
    if not first.is_contiguous() or first.device.type != "cpu":
        return None
    storage = first.untyped_storage()
    if (first.storage_offset() + total) * first.element_size() > storage.nbytes():
        return None  # adjacent in memory but not one storage (e.g. rows from separate from_numpy calls)
    base, step = first.data_ptr(), first.element_size()
    pos = 0
    for r in rows:
        if (r.dtype != first.dtype or not r.is_contiguous() or r.data_ptr() != base + pos * step
                or r.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        pos += r.numel()
    return torch.as_strided(first, (total,), (1,))


def unpack(block: ColumnBlock, copy: bool = True) -> list:
    """One block -> its rows, as tensors (or arrays) that are views of one buffer.

    `copy=True` (default) gives the rows one private, writable buffer. `copy=False` is zero-copy:
    rows that came through Ray's object store are then views of an object other consumers read
    too, and torch cannot mark them read-only, so only a caller that never writes to them (one
    that collates them into a new batch at once) should ask for it.
    """
    flat = block.flat.copy() if copy else block.flat
    offs = block.offsets.tolist()
    if block.torch_dtype is None:
        return [flat[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
    if flat.flags.writeable:
        t = torch.from_numpy(flat)
    else:
        with warnings.catch_warnings():  # read-only by design; see the docstring
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(flat)
    dtype = getattr(torch, block.torch_dtype)
    if dtype in _BITCAST:
        t = t.view(dtype)
    return [t[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
