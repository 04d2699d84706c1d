"""How a bucket lies in its wire buffer: each tensor's name, shape, dtype and 64-byte-aligned
offset (`Entry`), and the broadcasts it takes (`BucketSpec`).

Both ends of a collective sync derive the same broadcasts from a spec alone, so the spec is all a
receiver must learn before it can receive (`weight_sync` writes it to the group's store once per
layout version). The helpers that say where a tensor's bytes lie in memory (`location`, `span`)
decide which runs go straight from the sender's memory and which are packed; the IPC transport
(`ipc_layout`) uses the same dtype names and alignment.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..base import ALIGN, Bucket  # ALIGN: byte alignment of every tensor in a bucket's wire buffer

INPLACE_MIN_BYTES = 1 << 20     # tensors this large are broadcast in place, smaller ones packed


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in a bucket layout")
    return d


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int         # byte offset in the bucket's buffer

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=dtype_of(self.dtype)).element_size()


@dataclass(frozen=True)
class BucketSpec:
    """How one bucket lies in its wire buffer, and the broadcasts ([start, end) byte ranges) it takes.

    A segment is either a span sent straight from the sender's memory (packed=False: one tensor,
    or several that lie side by side in one storage at exactly their relative offsets here, so
    the span, gaps included, is one broadcast) or a run of packed tensors (packed=True: copied
    into a staging buffer first). Both sides derive the broadcasts from the segments alone.
    Tensors that are the same view of the same storage (tied weights in one bucket) share one
    offset."""
    entries: tuple[Entry, ...]
    segments: tuple[tuple[int, int, bool], ...]   # (start, end, packed)
    nbytes: int

    @staticmethod
    def describe(bucket: Bucket, inplace_min_bytes: int = INPLACE_MIN_BYTES) -> "BucketSpec":
        """The layout of `bucket`: spans of at least `inplace_min_bytes` that lie in the sender's
        memory as on the wire go straight from it, the rest is packed."""
        entries = []
        seen: dict[tuple, int] = {}
        offset = 0
        spans: list[list] = []      # [start, end, where the first lies (or None)] of adjacent tensors
        for name, t in bucket:
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
            if key is not None and key in seen:
                entries.append(Entry(name, tuple(t.shape), dtype_name(t.dtype), seen[key]))
                continue
            n = t.numel() * t.element_size()
            entries.append(Entry(name, tuple(t.shape), dtype_name(t.dtype), offset))
            if key is None:
                continue
            seen[key] = offset
            at = location(t)
            last = spans[-1] if spans else None
            if (at is not None and last is not None and last[2] is not None and at[:2] == last[2][:2]
                    and at[2] - last[2][2] == offset - last[0]):
                last[1] = offset + n                    # lies right where the wire puts it: same span
            else:
                spans.append([offset, offset + n, at])
            offset = aligned(offset + n)
        segments, run_start = [], None      # run_start: start of the current packed run
        for start, end, at in spans:
            if at is not None and end - start >= inplace_min_bytes:
                if run_start is not None:
                    segments.append((run_start, start, True))
                    run_start = None
                segments.append((start, end, False))
            elif run_start is None:
                run_start = start
        if run_start is not None:
            segments.append((run_start, offset, True))
        return BucketSpec(tuple(entries), tuple(segments), offset)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed runs together (the sender's staging buffer for this bucket)."""
        return sum(end - start for start, end, packed in self.segments if packed)

    def to_json(self) -> str:
        return json.dumps({"entries": [[e.name, list(e.shape), e.dtype, e.offset] for e in self.entries],
                           "segments": [list(s) for s in self.segments], "nbytes": self.nbytes})

    @staticmethod
    def from_json(text: str | bytes) -> "BucketSpec":
        d = json.loads(text)
        return BucketSpec(tuple(Entry(n, tuple(s), dt, o) for n, s, dt, o in d["entries"]),
                          tuple((a, b, bool(p)) for a, b, p in d["segments"]), int(d["nbytes"]))

    def views(self, buffer: torch.Tensor) -> Bucket:
        """(name, tensor) views into a received buffer laid out by this spec."""
        out = []
        for e in self.entries:
            out.append((e.name, buffer[e.offset:e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)))
        return out

    def pack(self, bucket: Bucket, buffer: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Copy the tensors of bytes [start, end) of this bucket into `buffer` (at offset - start)."""
        end = self.nbytes if end is None else end
        done = set()
        for e, (_, t) in zip(self.entries, bucket):
            n = e.nbytes
            if n == 0 or e.offset < start or e.offset + n > end or e.offset in done:
                continue
            done.add(e.offset)
            dst = buffer[e.offset - start:e.offset - start + n].view(t.dtype).view(t.shape)
            dst.copy_(t.detach())


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def location(t: torch.Tensor) -> tuple | None:
    """(device, storage address, byte offset in it) of a contiguous tensor; None if not contiguous."""
    if not t.is_contiguous():
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size())


def span(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` of `t`'s storage from where `t` starts, as a 1-D uint8 tensor (no copy): the bytes
    of a run of adjacent tensors that starts with `t`."""
    if nbytes == t.numel() * t.element_size():
        return byte_view(t)
    storage = t.untyped_storage()
    start = t.storage_offset() * t.element_size()
    if start + nbytes > storage.nbytes():
        raise AssertionError(f"weight sync: a span of {nbytes} bytes runs past its storage")
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,))
