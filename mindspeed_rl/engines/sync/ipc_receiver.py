"""The reader's side of an IPC sync: maps the sender's segments (`IPCAttachments`) and writes
each piece into the reader's own tensors or hands it to `load` (`IPCReceiver`).

Memory on the reader. The reader maps the sender's segments (shared pages, not a copy) and writes
each piece straight into its own tensor when that tensor is contiguous with the same dtype and
shape (byte copy, also for the pieces of a split tensor). Otherwise a whole tensor is copied with
a cast (`copy_`), and a split one is assembled in a temporary of that ONE tensor first. Names the
reader has no target for go, a bucket at a time, to `load(bucket)` (e.g. an engine's
`update_weights`; the views are valid only during the call). So the reader never holds a second
copy of the model.
"""
from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Sequence

import torch

from ..base import Bucket
from .bucket_layout import dtype_of
from .ipc_layout import IPCHandle, Piece, Source, byte_view, distinct_pieces
from .ipc_segments import shm_dir
from .weight_sync import Checksum, direct_reader


class IPCAttachments:
    """The reader's mappings of senders' segments, by name, kept across syncs so a sync maps
    nothing new while the sender reuses its slots (mapping 512 MiB costs page-table work).
    A handle naming a new segment for a slot (the sender grew it) replaces that slot's mapping.
    `close()` detaches all: the sender's pages are freed only once both sides let go."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self._by_slot: dict[tuple[str, int], tuple[str, Any, torch.Tensor]] = {}
        self._sources: dict[str, tuple[bool, Any, torch.Tensor]] = {}

    def buffer(self, h: IPCHandle) -> torch.Tensor:
        """The staging buffer of handle `h`, mapped here (once per sender slot)."""
        key = (h.segment.rsplit("-", 1)[0], h.slot)     # the sender's prefix and the slot
        got = self._by_slot.get(key)
        if got is not None and got[0] == h.segment:
            return got[2]
        if got is not None:
            self._detach(self._by_slot, key)
        mm, buf = self._map(h.segment, h.capacity, h.cuda)
        self._by_slot[key] = (h.segment, mm, buf)
        return buf

    def source(self, src: "Source") -> torch.Tensor:
        """The sender's own memory a zero-copy piece reads, mapped here (adopted segments once,
        CUDA storages once per sync: `release_transient`)."""
        got = self._sources.get(src.segment)
        if got is not None:
            return got[2]
        mm, buf = self._map(src.segment, src.capacity, src.cuda)
        self._sources[src.segment] = (src.persistent, mm, buf)
        return buf

    def release_transient(self) -> None:
        """Drop the mappings valid for one sync only (CUDA storages of the sender's tensors)."""
        for key in [k for k, v in self._sources.items() if not v[0]]:
            self._detach(self._sources, key)

    def _map(self, segment: str, capacity: int, cuda: tuple | None):
        if cuda is not None:
            rebuild, args = cuda
            args = list(args)
            dev = self.device if self.device is not None and self.device.type == "cuda" else None
            args[6] = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
            return None, rebuild(*args)   # the sender's memory, mapped here (CUDA IPC)
        fd = os.open(os.path.join(shm_dir(), segment), os.O_RDWR)
        try:   # MAP_POPULATE: map every page now in one call instead of a fault per page later
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return mm, torch.frombuffer(mm, dtype=torch.uint8)

    @property
    def mapped_bytes(self) -> int:
        return sum(v[2].numel() for d in (self._by_slot, self._sources) for v in d.values())

    @staticmethod
    def _detach(table: dict, key) -> None:
        """Drop the mapping: it is unmapped when no tensor over it is left (never closed by hand,
        so a view someone kept cannot turn into a dangling pointer)."""
        table.pop(key)

    def close(self) -> None:
        for table in (self._by_slot, self._sources):
            for key in list(table):
                self._detach(table, key)

    def __enter__(self) -> "IPCAttachments":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class IPCReceiver:
    """The reader's side of one sync: `receive(handles)` for each batch the sender hands out, then
    `finish()`.

    `targets` ({HF name: the reader's own tensor}, an engine's `receive_targets()`, tied ones under
    each name) are written in place; a name without a target goes to `load(bucket)` (views valid
    during the call only: `update_weights` copies them), or raises if there is no `load`.
    `digest` hashes what arrived (see the module docstring). `attachments`: keep one per sender
    across syncs (the default makes a private one, detached at finish)."""

    def __init__(self, targets: dict[str, torch.Tensor] | None = None,
                 load: Callable[[Bucket], None] | None = None, digest: Checksum | None = None,
                 attachments: IPCAttachments | None = None, device: torch.device | str | None = None):
        self.targets = targets or {}
        self.load = load
        self.digest = digest
        self._own = attachments is None
        self.attachments = attachments if attachments is not None else IPCAttachments(device)
        self._partial: dict[str, list] = {}   # name -> [uint8 buffer of the whole tensor, bytes received]
        self._into: set[str] = set()          # names written byte-for-byte into their target
        self._readers: list = []
        self._direct = None
        self._version = 0
        self.stats = {"buckets": 0, "bytes": 0, "bytes_into_targets": 0, "names_into_targets": []}

    def receive(self, handles: Sequence[IPCHandle]) -> int:
        """Load these buckets; returns their bytes. When it returns, the sender may reuse them."""
        total = 0
        cuda = False
        with torch.no_grad():
            for h in handles:
                staging = self.attachments.buffer(h) if h.segment else None
                bufs = [self.attachments.source(src) for src in h.sources]
                cuda = cuda or any(b.device.type == "cuda" for b in bufs + ([staging] if staging is not None else []))
                loads: Bucket = []
                for p in h.pieces:
                    self._piece(p, staging if p.source < 0 else bufs[p.source], loads)
                if loads:
                    if self.digest is not None:
                        self.digest.update(loads)
                    self.load(loads)
                    loads.clear()
                nbytes = sum(p.nbytes for p in distinct_pieces(h.pieces))
                self.stats["buckets"] += 1
                self.stats["bytes"] += nbytes
                total += nbytes
            if cuda:
                torch.cuda.current_stream().synchronize()   # copied out before the sender may overwrite
        return total

    def _piece(self, p: Piece, buf: torch.Tensor, loads: Bucket) -> None:
        dt = dtype_of(p.dtype)
        src = buf[p.offset:p.offset + p.nbytes]
        tgt = self.targets.get(p.name)
        if tgt is not None and tuple(tgt.shape) != p.shape:
            raise ValueError(f"ipc sync: {p.name!r} has shape {p.shape} but the reader's is "
                             f"{tuple(tgt.shape)}; the reader's architecture differs from the trainer's")
        if tgt is None and self.load is None:
            raise ValueError(f"ipc sync: {p.name!r} is not a weight of the reader (no target, no load)")
        if p.total == 0:
            if tgt is None:
                loads.append((p.name, torch.empty(p.shape, dtype=dt)))
            return
        if tgt is not None and tgt.dtype == dt and tgt.is_contiguous():
            byte_view(tgt)[p.start:p.start + p.nbytes].copy_(src, non_blocking=True)   # straight into the parameter
            self._into.add(p.name)
            self.stats["bytes_into_targets"] += p.nbytes
            return
        if p.whole:
            whole = src.view(dt).view(p.shape)
        else:   # a piece of a tensor that cannot take bytes in place: assemble that one tensor
            part = self._partial.get(p.name)
            if part is None:
                part = self._partial[p.name] = [torch.empty(p.total, dtype=torch.uint8, device=buf.device), 0]
            part[0][p.start:p.start + p.nbytes].copy_(src)
            part[1] += p.nbytes
            if part[1] < p.total:
                return
            del self._partial[p.name]
            whole = part[0].view(dt).view(p.shape)
        if tgt is not None:
            tgt.copy_(whole)          # with a cast where the reader keeps another dtype
            if self.digest is not None:
                self.digest.update([(p.name, whole)])
        else:
            loads.append((p.name, whole))

    def finish(self) -> dict:
        """End of the sync: every split tensor must be complete; hash the in-place tensors as they
        now lie in the reader. Returns the stats (buckets, bytes, bytes_into_targets,
        names_into_targets)."""
        if self._partial:
            raise RuntimeError(f"ipc sync: tensors left incomplete at the end of the sync: {sorted(self._partial)}")
        names = sorted(self._into)
        if self.digest is not None and names:
            self.digest.update([(n, self.targets[n]) for n in names])
        self.stats["names_into_targets"] = names
        self.attachments.release_transient()
        if self._own:
            self.attachments.close()
        return dict(self.stats)

    @classmethod
    def for_readers(cls, readers: Sequence, version: int, digest: Checksum | None = None,
                    attachments: IPCAttachments | None = None) -> "IPCReceiver":
        """What a reader worker runs (the IPC twin of `weight_sync.receive_weights`): the first reader
        whose `receive_targets()` is not None takes every tensor it has in place; all readers load
        the rest a bucket at a time (`update_weights(bucket, version)`). Call `finish_readers()`
        instead of `finish()`: the other readers then load the in-place tensors from the first's
        own, and the first is told `update_weights((), version)` (it now serves `version`)."""
        direct, targets = direct_reader(readers)

        def load(bucket: Bucket) -> None:
            for r in readers:
                r.update_weights(bucket, version)

        rx = cls(targets, load, digest, attachments)
        rx._readers, rx._direct, rx._version = list(readers), direct, version
        return rx

    def finish_readers(self) -> dict:
        """`finish()` for a receiver made by `for_readers`."""
        info = self.finish()
        in_place = [(n, self.targets[n]) for n in info["names_into_targets"]]
        for r in self._readers:
            if r is not self._direct and in_place:
                r.update_weights(in_place, self._version)
        if self._direct is not None:
            self._direct.update_weights((), self._version)
        return info


def receive_ipc(handles: Sequence[IPCHandle], targets: dict[str, torch.Tensor],
                load: Callable[[Bucket], None] | None = None,
                attachments: IPCAttachments | None = None) -> int:
    """Load these buckets into `targets` by name (the rest through `load`); returns the bytes
    received. Stateless between calls for tensors written in place (every split tensor of a
    reader whose targets match the sender's dtypes); use an `IPCReceiver` for a whole sync."""
    rx = IPCReceiver(targets, load, None, attachments)
    n = rx.receive(handles)
    if rx._partial:
        raise RuntimeError(f"ipc sync: receive_ipc cannot assemble split tensors across calls "
                           f"({sorted(rx._partial)}): use an IPCReceiver for the whole sync")
    if attachments is None:
        rx.attachments.close()
    return n
