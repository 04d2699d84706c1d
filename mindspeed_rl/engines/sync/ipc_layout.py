"""What an IPC sync moves: a bucket's pieces (`Piece`), the handle a reader loads it from
(`IPCHandle`), the sender's own memory a zero-copy piece points into (`Source`), and how a
stream of tensors is cut into buckets (`piece_buckets`).

Layout. A bucket is at most `bucket_bytes`; tensors sit at 64-byte-aligned offsets
(`base.ALIGN`), raw bytes, no cast. A tensor bigger than a bucket is split into byte pieces across
consecutive buckets (`Piece.start`), so the staging memory is bounded by `slots * bucket_bytes`
whatever the model: Qwen2.5-0.5B's fp32 embedding (544 MB) would not fit a 512 MiB bucket. A
tensor seen twice in one bucket (tied weights, same view) takes one offset. The sender never
flattens the model: it holds at most one bucket's tensor references while packing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from .bucket_layout import aligned, dtype_name, dtype_of
from .weight_sync import Checksum


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + nbytes) of tensor `name` (shape, dtype), at `offset` in the bucket.
    A whole tensor is start 0, nbytes = all its bytes; a tensor bigger than a bucket comes as
    several pieces in consecutive buckets."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    start: int = 0
    source: int = -1      # -1: in the staging slot; else index into the handle's `sources` (zero copy)

    @property
    def total(self) -> int:
        """Bytes of the whole tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n * dtype_of(self.dtype).itemsize

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.nbytes == self.total


@dataclass(frozen=True)
class IPCHandle:
    """What a reader needs to load one bucket: where the staging buffer is and what is in it.
    Picklable (Ray, multiprocessing queues). `cuda` is reduce_tensor's (rebuild, args) on CUDA,
    None on the CPU, where `segment` is the /dev/shm file's name."""
    segment: str                  # the slot's name (a file in shm_dir() on the CPU); changes when the slot grows
    capacity: int                 # bytes of the segment
    pieces: tuple[Piece, ...]
    nbytes: int                   # bytes of the bucket used (offset of the end of its last piece)
    slot: int
    index: int                    # bucket index within this sync
    sync: int                     # the sender's sync counter (acks are checked against it)
    cuda: tuple | None = None
    sources: tuple["Source", ...] = ()   # memory of the sender's own tensors that pieces point into


@dataclass(frozen=True)
class Source:
    """The sender's own memory a zero-copy piece is read from (`IPCSender.adopt`): on the CPU a
    segment the module's parameters were moved into (a file name); on CUDA a registered storage
    (`cuda`: reduce_tensor's (rebuild, args) of the whole storage; `segment` a unique key)."""
    segment: str
    capacity: int
    cuda: tuple | None = None
    persistent: bool = True       # the reader may keep the mapping across syncs (adopted segments)


def named_pairs(named: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from pairs or from buckets (lists of pairs), as export_weights yields."""
    for x in named:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            yield x
        else:
            yield from x


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def piece_buckets(pairs: Iterator[tuple[str, torch.Tensor]], cap: int, digest: Checksum | None,
            shareable: Callable | None = None) -> Iterator[list[tuple[Piece, Any]]]:
    """Group tensors into buckets of at most `cap` bytes: [(piece, source)], source a 1-D uint8
    tensor of the piece's bytes, a whole non-contiguous tensor, None (same tensor as an earlier
    piece of this bucket), or a `Source` (zero copy: `shareable(t)` says where the reader can read
    it; the piece's offset is then in that memory, and it takes no staging). A tensor that does not
    fit starts a new bucket; one bigger than `cap` is split into byte pieces that fill consecutive
    buckets (zero-copy ones are never split: they take no staging; a bucket holds at most `cap`
    bytes of them too, so a reader's call stays bounded)."""
    cur: list = []
    off = 0
    zc = 0                  # zero-copy bytes in the current bucket
    seen: dict[tuple, int] = {}
    for name, t in pairs:
        t = t.detach()
        if digest is not None:
            digest.update([(name, t)])
        shape, dt = tuple(t.shape), dtype_name(t.dtype)
        total = t.numel() * t.element_size()
        key = (t.device, t.data_ptr(), t.dtype, shape, t.stride()) if total else None
        if key is not None and key in seen:
            cur.append((Piece(name, shape, dt, seen[key], total), None))
            continue
        if total == 0:
            cur.append((Piece(name, shape, dt, off, 0), None))
            continue
        shared = shareable(t) if shareable is not None else None
        if shared is not None:
            if cur and zc + total > cap:
                yield cur
                cur, off, zc, seen = [], 0, 0, {}
            cur.append((Piece(name, shape, dt, shared[1], total), shared[0]))
            zc += total
            continue
        if cur and off + total > cap:
            yield cur
            cur, off, zc, seen = [], 0, 0, {}
        if total <= cap:
            src = byte_view(t) if t.is_contiguous() else t
            cur.append((Piece(name, shape, dt, off, total), src))
            seen[key] = off
            off = aligned(off + total)
            continue
        flat = byte_view(t.contiguous())     # bigger than a bucket: pieces (a copy only if not contiguous)
        start = 0
        while start < total:
            n = min(total - start, cap - off)
            cur.append((Piece(name, shape, dt, off, n, start), flat[start:start + n]))
            start += n
            off = aligned(off + n)
            if start < total or off >= cap:
                yield cur
                cur, off, zc, seen = [], 0, 0, {}
    if cur:
        yield cur


def distinct_pieces(pieces: Iterable[Piece]) -> Iterator[Piece]:
    seen = set()
    for p in pieces:
        if p.nbytes and (p.source, p.offset) not in seen:
            seen.add((p.source, p.offset))
            yield p
