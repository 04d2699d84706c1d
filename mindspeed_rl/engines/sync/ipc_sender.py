"""The trainer's side of an IPC sync: packs buckets into reused staging segments and hands out
their handles (`IPCSender`).

Zero copy (`IPCSender(zero_copy=True)`, the default). A tensor that already lies in memory the
reader can map is not packed: its piece points into that memory (`Source`) and the reader copies
straight from the trainer's parameter, so a sync costs ONE copy, as `load_state_dict` does in one
process; packing costs a second, and on a GPU both copies share the same memory bandwidth (the
packed path can reach only about half of an in-process copy there). What qualifies: contiguous
tensors in the storages of a module given to `IPCSender.adopt(module)`: on the CPU its parameters
are moved once into the sender's shared segments; on CUDA their storages are registered with their
IPC handles (nothing moves), which the reader opens once and keeps. The trainer must not change
those parameters until the sync ends (the worker's sync runs between optimizer steps). Everything
else (FSDP's gathered buckets, casts, non-contiguous tensors) goes through the staging slots.
"""
from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch

from ..base import ALIGN
from .ipc_layout import IPCHandle, Piece, Source, distinct_pieces, named_pairs, piece_buckets
from .ipc_segments import PREFIX, Registered, Segment, cleanup_stale, finalize_segments, start_reaper
from .weight_sync import Checksum


_counter = itertools.count()
_counter_lock = threading.Lock()


class IPCSender:
    """The trainer's side: packs buckets of (name, tensor) into `slots` reused staging buffers of
    at most `bucket_bytes` each on `device`, and hands out their handles.

    One sender per trained model, kept across syncs (the segments are reused: a sync allocates
    nothing after the first unless a bucket grows). Not thread-safe: one sync at a time.
    `last_sync` after a sync: buckets, bytes, pieces, split (tensors split across buckets),
    max_bucket_bytes, segments_allocated (this sync)."""

    def __init__(self, bucket_bytes: int, device: torch.device | str = "cpu", slots: int = 2,
                 reaper: bool = True, zero_copy: bool = True):
        if bucket_bytes < ALIGN:
            raise ValueError(f"ipc sync: bucket_bytes={bucket_bytes}: must be at least {ALIGN}")
        if slots < 1:
            raise ValueError(f"ipc sync: slots={slots}: must be >= 1")
        self.bucket_bytes = bucket_bytes // ALIGN * ALIGN
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with _counter_lock:
            n = next(_counter)
        self.prefix = f"{PREFIX}{os.getpid()}-{n}-"
        self.slots = slots
        self._segments: dict[int, Segment] = {}
        self._gen = itertools.count()
        self._busy: dict[int, int] = {}       # slot -> index of the bucket in it, until acked
        self.zero_copy = zero_copy
        self._adopted: dict[int, Any] = {}   # storage address -> its Segment (CPU) / Registered (CUDA)
        self._reaper: list = []
        self._want_reaper = reaper and self.device.type == "cpu"
        self._finalizer = weakref.finalize(self, finalize_segments, self._segments, self._reaper, self._adopted)
        self._sync = 0
        self._stream: Iterator | None = None
        self._index = 0
        self._stats: dict[str, Any] = {}
        self.last_sync: dict[str, Any] = {}
        if self.device.type == "cpu":
            cleanup_stale()

    # ---- the step protocol
    def start(self, named: Iterable, digest: Checksum | None = None) -> None:
        """Begin a sync of `named`: (name, tensor) pairs, or buckets of them (`export_weights`).
        `digest` is fed every tensor as it is packed (the sender's side of `weight_sync.verify`)."""
        if self._stream is not None or self._busy:
            raise RuntimeError("ipc sync: start() while a sync is in progress (finish it or abort())")
        self._sync += 1
        self._index = 0
        self._stream = piece_buckets(named_pairs(named), self.bucket_bytes, digest,
                               self._shareable if self.zero_copy else None)
        self._stats = {"buckets": 0, "bytes": 0, "bytes_zero_copy": 0, "pieces": 0, "split": 0,
                       "max_bucket_bytes": 0, "segments_allocated": 0}

    def release(self, done: Iterable[IPCHandle | int] = ()) -> None:
        """The readers acknowledged these handles (or bucket indexes): their slots may be reused."""
        for h in done:
            index = h.index if isinstance(h, IPCHandle) else int(h)
            if isinstance(h, IPCHandle) and h.sync != self._sync:
                raise RuntimeError(f"ipc sync: ack for sync {h.sync}, this is sync {self._sync}")
            slot = next((s for s, i in self._busy.items() if i == index), None)
            if slot is None:
                raise RuntimeError(f"ipc sync: ack for bucket {index}, which is not awaiting one")
            del self._busy[slot]

    def free_slots(self) -> int:
        return self.slots - len(self._busy)

    @property
    def has_more(self) -> bool:
        """The stream of this sync may still hold buckets to pack."""
        return self._stream is not None

    @property
    def active(self) -> bool:
        """A sync is in progress: buckets left to send or handles not acknowledged."""
        return self._stream is not None or bool(self._busy)

    def next(self, done: Iterable[IPCHandle | int] = (), limit: int | None = None) -> list[IPCHandle]:
        """Release `done`, then pack the next buckets into the free slots (at most `limit`) and
        return their handles. [] means the sync is over: everything was sent and acknowledged
        (`last_sync` then holds its stats). Raises if more is left but no slot is free."""
        self.release(done)
        if self._stream is None:
            if not self._busy and self._stats:
                self._end()
            return []
        out: list[IPCHandle] = []
        want = self.free_slots() if limit is None else min(limit, self.free_slots())
        if want <= 0:
            raise RuntimeError(f"ipc sync: no free staging slot ({self.slots} awaiting an ack); pass the "
                               "readers' acknowledgements to next(done=...) first")
        while len(out) < want:
            bucket = next(self._stream, None)
            if bucket is None:
                self._stream = None
                break
            out.append(self._pack(bucket))
        if not out and not self._busy:
            self._end()
        return out

    def abort(self) -> None:
        """Drop the sync in progress (a reader failed): all slots free, the stream closed."""
        self._stream = None
        self._busy.clear()
        self._stats = {}

    def close(self) -> None:
        """Unlink/free every segment and let the reaper go. Readers' mappings stay valid until they
        detach, but the names are gone."""
        self.abort()
        self._finalizer()

    def __enter__(self) -> "IPCSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def adopt(self, module: torch.nn.Module) -> int:
        """CPU: move `module`'s parameters into shared segments of this sender (one per storage they
        use, same byte offsets, so a `base.flatten_parameters` layout stays flat), so a sync hands
        the reader their memory instead of a packed copy: one copy per sync (the reader's), as
        `load_state_dict` in one process. `p.data` becomes a view; the Parameter objects stay
        (ties, optimizers, hooks keep working); values are unchanged. Call it after the module is on
        its device and dtype (like `flatten_parameters`). On CUDA nothing moves: the storages are
        registered with their IPC handles (any CUDA storage can be shared); only registered
        (long-lived) storages go zero copy, never an export's transient gathered tensors. Returns
        the bytes moved (0 on CUDA). The segments are unlinked by `close()` like the
        staging ones; the parameters keep their memory."""
        moved = 0
        storages: dict[int, list[torch.nn.Parameter]] = {}
        for p in {id(p): p for p in module.parameters()}.values():
            if p.device.type == self.device.type and p.numel():
                storages.setdefault(p.data.untyped_storage().data_ptr(), []).append(p)
        for addr, params in storages.items():
            if addr in self._adopted:
                continue
            if self.device.type == "cuda":    # register only: the reader maps the storage itself
                self._adopted[addr] = Registered(f"{self.prefix}p{len(self._adopted)}g{next(self._gen)}",
                                                  params[0].data.untyped_storage())
                continue
            old = params[0].data.untyped_storage()
            n = old.nbytes()
            if self._want_reaper and not self._reaper:
                self._reaper.append(start_reaper(self.prefix))
            seg = Segment(f"{self.prefix}p{len(self._adopted)}g{next(self._gen)}", max(n, 1), self.device)
            seg.buf[:n].copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (n,)))
            new = seg.buf.untyped_storage()
            with torch.no_grad():
                for p in params:
                    p.data = torch.empty(0, dtype=p.dtype).set_(new, p.data.storage_offset(), p.shape, p.data.stride())
            self._adopted[new.data_ptr()] = seg
            moved += n
        return moved

    def _shareable(self, t: torch.Tensor) -> tuple[Source, int] | None:
        """(where `t` lies in memory the reader can map, its byte offset there) or None."""
        if not t.is_contiguous() or t.device.type != self.device.type:
            return None
        seg = self._adopted.get(t.untyped_storage().data_ptr())
        if seg is None:
            return None
        return Source(seg.name, seg.capacity, seg.cuda), t.storage_offset() * t.element_size()

    # ---- internals
    def _end(self) -> None:
        self.last_sync = dict(self._stats, sync=self._sync)
        self._stats = {}

    def _slot(self, nbytes: int) -> tuple[int, Segment | None]:
        slot = next(s for s in range(self.slots) if s not in self._busy)
        if nbytes == 0:                   # everything in this bucket goes zero copy
            return slot, None
        seg = self._segments.get(slot)
        if seg is None or seg.capacity < nbytes:
            if seg is not None:
                seg.close()
            if self._want_reaper and not self._reaper:
                self._reaper.append(start_reaper(self.prefix))
            cap = min(self.bucket_bytes, max(nbytes, 1 << 20))   # at least 1 MiB: fewer regrowths
            seg = self._segments[slot] = Segment(f"{self.prefix}s{slot}g{next(self._gen)}", cap, self.device)
            self._stats["segments_allocated"] += 1
        return slot, seg

    def _pack(self, bucket: list[tuple[Piece, Any]]) -> IPCHandle:
        staged = [(p, src) for p, src in bucket if not isinstance(src, Source)]
        nbytes = max((p.offset + p.nbytes for p, _ in staged), default=0)
        slot, seg = self._slot(nbytes)
        sources: list[Source] = []
        pieces = []
        for p, src in bucket:
            if isinstance(src, Source):   # zero copy: the reader reads the sender's own memory
                if src not in sources:
                    sources.append(src)
                p = Piece(p.name, p.shape, p.dtype, p.offset, p.nbytes, p.start, sources.index(src))
            pieces.append(p)
        for p, src in staged:
            if src is None:          # an alias of a tensor already in this bucket
                continue
            dst = seg.buf[p.offset:p.offset + p.nbytes]
            if src.dtype == torch.uint8 and src.dim() == 1 and src.numel() == p.nbytes:
                dst.copy_(src, non_blocking=True)
            else:                    # a whole non-contiguous tensor: copy it into place as itself
                dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()   # the bytes are there before the reader looks
        self._busy[slot] = self._index
        h = IPCHandle(seg.name if seg else "", seg.capacity if seg else 0, tuple(pieces), nbytes, slot,
                      self._index, self._sync, seg.cuda if seg else None, tuple(sources))
        st = self._stats
        st["buckets"] += 1
        st["bytes"] += sum(p.nbytes for p in distinct_pieces(pieces))
        st["bytes_zero_copy"] += sum(p.nbytes for p in distinct_pieces(pieces) if p.source >= 0)
        st["pieces"] += len(bucket)
        st["split"] += sum(1 for p, _ in bucket if not p.whole and p.start == 0)
        st["max_bucket_bytes"] = max(st["max_bucket_bytes"], nbytes)
        self._index += 1
        return h
