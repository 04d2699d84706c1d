"""Hand one micro-batch from a replica's dock reader to the other ranks of the replica.

Only the reader rank (see `topology.dock_reader_ranks`) pulls from the dock, so the dock serves
one request per replica instead of one per rank; the TP and PP peers get the same rows over the
collective backend, which is the fast path between devices of one mesh.

A micro-batch is the dock's shape: ``{column: [one 1-D tensor per row]}`` with rows of any length,
plus the row indexes. It travels in ``1 + n_columns`` collectives: a small header (column names,
dtypes, per-row lengths, row indexes) with ``broadcast_object_list``, then each column as one flat
tensor (its rows concatenated) with ``broadcast``, which the receivers split back into rows.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# dtype <-> name for the header (names, not torch objects: the header is pickled)
DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}
_NAMES = {v: k for k, v in DTYPES.items()}
# bool goes over the wire as uint8: not every backend (HCCL, older NCCL) broadcasts bool tensors
_WIRE = {torch.bool: torch.uint8}

MicroBatch = dict[str, list[torch.Tensor]]


def _header(batch: Any, rows: Any) -> dict:
    """The header the reader sends: the micro-batch's description, or ``{"error": why}`` so that
    every rank of the replica raises the same error instead of waiting for tensors that never come."""
    if not isinstance(batch, dict):
        return {"error": f"batch={type(batch).__name__} on the source rank; pass a dict column -> list of "
                         f"1-D tensors (an empty micro-batch is {{}} with rows=[])"}
    if rows is None or isinstance(rows, (str, bytes)):
        return {"error": f"rows={rows!r} on the source rank; pass the list of row indexes ([] when empty)"}
    try:
        rows = [int(r) for r in rows]
    except (TypeError, ValueError):
        return {"error": f"rows={rows!r} on the source rank are not integers; pass the dock's row indexes"}
    columns = []
    for name, values in batch.items():
        if not isinstance(name, str):
            return {"error": f"column name {name!r} is not a string"}
        if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
            return {"error": f"column {name!r} is a {type(values).__name__}; give a list with one 1-D tensor per row"}
        if len(values) != len(rows):
            return {"error": f"column {name!r} has {len(values)} rows but rows lists {len(rows)}; give one tensor "
                             f"per row index"}
        dtype = None
        for i, t in enumerate(values):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                what = f"a {t.dim()}-D tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                return {"error": f"column {name!r} row {i} is {what}; every row must be a 1-D tensor "
                                 f"(reshape(-1) it, or split a 2-D tensor into its rows)"}
            if t.dtype not in _NAMES:
                return {"error": f"column {name!r} row {i} has dtype {t.dtype}; supported dtypes are "
                                 f"{list(DTYPES)}, convert it with .to(...)"}
            if dtype is not None and t.dtype != dtype:
                return {"error": f"column {name!r} mixes dtypes {dtype} and {t.dtype}; give every row of a "
                                 f"column one dtype"}
            dtype = t.dtype
        dtype = dtype if dtype is not None else torch.float32  # no rows: any dtype will do
        columns.append((name, _NAMES[dtype], [int(t.numel()) for t in values]))
    return {"columns": columns, "rows": rows}


def broadcast_micro_batch(batch: MicroBatch | None, rows: list[int] | None, src: int, group=None,
                          device: torch.device | str | None = None) -> tuple[MicroBatch, list[int]]:
    """Send `batch` and `rows` from global rank `src` to every rank of `group`; returns them on all.

    Every rank of `group` calls this with the same `src` and `group`. On `src`, `batch` is
    ``{column: [1-D tensor per row]}`` (``{}`` with ``rows=[]`` for an empty micro-batch, e.g. the end
    of a step) and is returned as given; elsewhere pass ``None, None``. Receivers allocate on
    `device` (default CPU; give the rank's CUDA/NPU device with NCCL/HCCL). A bad batch on `src`
    raises the same ValueError on every rank of the group.
    """
    me = dist.get_rank()
    header = [_header(batch, rows) if me == src else None]
    dist.broadcast_object_list(header, src=src, group=group, device=device)
    head = header[0]
    if "error" in head:
        raise ValueError(f"broadcast_micro_batch from rank {src}: {head['error']}")
    sending = me == src
    out: MicroBatch = {}
    for name, dtype_name, lengths in head["columns"]:
        dtype = DTYPES[dtype_name]
        wire = _WIRE.get(dtype, dtype)
        total = sum(lengths)
        if sending:
            flat = (torch.cat([t.to(wire) for t in batch[name]]) if lengths else torch.empty(0, dtype=wire))
            if device is not None:
                flat = flat.to(device)
        else:
            flat = torch.empty(total, dtype=wire, device=device or "cpu")
        if total:  # both sides know the lengths: an empty column needs no collective
            dist.broadcast(flat, src=src, group=group)
        if not sending:
            out[name] = [part.to(dtype) for part in torch.split(flat, lengths)] if lengths else []
    if sending:
        return batch, list(head["rows"])
    return out, list(head["rows"])
