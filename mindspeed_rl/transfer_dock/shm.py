"""Same-node data plane: large columns travel through shared-memory segments, not Ray objects.

Why: passing an `ObjectRef` through the dock makes the dock and every consumer a *borrower*, and
each borrow is a round of RPCs to the producer that owns the object; while the producer is busy
copying its next micro-batch those RPCs wait. Measured at 16 MB per micro-batch, that protocol
doubled the time of a hand-off (docs/transfer_dock.md). Here the producer copies a column once
into a segment it keeps mapped, and sends the dock only a small descriptor (`ShmBlock`); the
consumer maps the segment once and reads the rows zero-copy. No object has an owner to ask.

Lifetime, which Ray's reference counting would otherwise decide:
- Segments are files in `/dev/shm` named `msrl-<tag>-<producer pid>-<k>`; `tag` names the dock.
- A producer allocates by bumping an offset; nothing is freed row by row. `clear()` starts a new
  *generation*: the dock writes it to `msrl-<tag>-gen-<dock pid>`, and each producer, before its
  next write, starts again at offset 0 of its (already mapped, already faulted-in) segments. So
  zero-copy rows (`get_experience(copy=False)`) are valid until the dock's next `clear()`.
- A put made in an older generation is refused by the dock (it would read overwritten bytes).
- `close()` on the dock removes its files; a new dock removes files of docks whose process died.

Only for producers and consumers on the dock's node: a producer elsewhere puts Ray objects, and a
consumer elsewhere gets these rows as bytes the dock reads for it (`create_transfer_dock`).
"""
from __future__ import annotations

import glob
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .codec import ColumnBlock, unpack
from .errors import DockValueError

SHM_DIR = "/dev/shm"
PREFIX = "msrl-"
MIN_SEGMENT_BYTES = 4 << 20  # segments grow geometrically from here (their pages are reserved)
MAX_SEGMENT_BYTES = 1 << 30
ALIGN = 64
# Fault every page in when a segment is mapped: first-touch page faults one by one cost more
# than the copy itself on small VMs, and the maps are kept and reused step after step.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass
class ShmBlock:
    """A block that lies in a producer's shared-memory segment: what the dock stores for it."""

    segment: str  # file path
    offset: int  # bytes into the segment
    numel: np.ndarray  # per row
    dtype: str  # numpy dtype of the flat buffer
    torch_dtype: str | None  # as ColumnBlock
    generation: int
    node_id: str

    def __len__(self) -> int:
        return len(self.numel)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def kind(self) -> str:
        return f"torch.{self.torch_dtype}" if self.torch_dtype else f"numpy.{self.dtype}"

    def __reduce__(self):
        """Pickle as plain values: a dataclass holding a numpy array pickles in ~35 us and loads in
        ~40 us, and the dock pickles one descriptor per consumer's get (each unpickles one); as
        bytes and strings, both take a few microseconds."""
        numel = np.ascontiguousarray(self.numel, dtype=np.int64).tobytes()
        return _shm_block, (self.segment, self.offset, numel, self.dtype, self.torch_dtype, self.generation,
                            self.node_id)


def _shm_block(segment: str, offset: int, numel: bytes, dtype: str, torch_dtype: str | None, generation: int,
               node_id: str) -> ShmBlock:
    return ShmBlock(segment, offset, np.frombuffer(numel, dtype=np.int64), dtype, torch_dtype, generation, node_id)


def available() -> bool:
    """Whether this machine has a writable `/dev/shm` (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def generation_path(tag: str, dock_pid: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{tag}-gen-{dock_pid}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dock_files(tag: str) -> int:
    """Remove every file of one dock (its generation file and all producers' segments)."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{tag}-*")):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def remove_stale_files() -> int:
    """Remove the files of docks whose process is gone (a crash or `ray.kill` skips `close()`).
    A dock's generation file and its channel's socket (`channel.py`) both end in its pid."""
    n = 0
    for marker in ("-gen-", "-sock-"):
        for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*{marker}*")):
            name = os.path.basename(path)[len(PREFIX):]
            tag, _, pid = name.rpartition(marker)
            if pid.isdigit() and not pid_alive(int(pid)):
                n += remove_dock_files(tag)
    return n


class Generation:
    """The dock's side: one int64 in a shared file that producers read before they write."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.path = generation_path(tag, os.getpid())
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self._value = np.frombuffer(self._map, dtype=np.int64, count=1)
        self._value[0] = 0

    @property
    def value(self) -> int:
        return int(self._value[0])

    def bump(self) -> int:
        self._value[0] += 1
        return self.value

    def set(self, value: int) -> None:
        self._value[0] = value

    def close(self) -> None:
        remove_dock_files(self.tag)


class _Segment:
    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: on tmpfs a full /dev/shm then fails here with an OSError,
            # not later with a SIGBUS in the middle of a copy
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self.size, self.used = path, size, 0
        self.array = np.frombuffer(self.map, dtype=np.uint8)


class ShmArena:
    """A producer process's segments for one dock, reused from generation to generation."""

    def __init__(self, tag: str, gen_path: str, node_id: str) -> None:
        self.tag, self.node_id, self.gen_path = tag, node_id, gen_path
        fd = os.open(gen_path, os.O_RDONLY)
        try:
            self._gen_map = mmap.mmap(fd, 8, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._gen = np.frombuffer(self._gen_map, dtype=np.int64, count=1)
        self._segments: list[_Segment] = []
        self._generation = -1
        self._lock = threading.Lock()  # stages sharing a worker are threads

    def write(self, block: ColumnBlock) -> ShmBlock:
        """Copy one block into shared memory; the returned descriptor is what travels."""
        flat = np.ascontiguousarray(block.flat)
        nbytes = flat.nbytes
        with self._lock:
            gen = int(self._gen[0])
            if gen != self._generation:  # the dock was cleared: every old row is dead
                self._generation = gen
                for seg in self._segments:
                    seg.used = 0
            seg, offset = self._allocate(nbytes)
        seg.array[offset:offset + nbytes] = flat.view(np.uint8).reshape(-1)
        torch_dtype = block.torch_dtype
        return ShmBlock(seg.path, offset, np.diff(block.offsets), str(flat.dtype), torch_dtype, gen, self.node_id)

    def _allocate(self, nbytes: int) -> tuple[_Segment, int]:
        for seg in self._segments:
            start = -(-seg.used // ALIGN) * ALIGN
            if start + nbytes <= seg.size:
                seg.used = start + nbytes
                return seg, start
        have = sum(s.size for s in self._segments)
        size = max(-(-nbytes // ALIGN) * ALIGN, min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, 4 * nbytes, have)))
        path = os.path.join(SHM_DIR, f"{PREFIX}{self.tag}-{os.getpid()}-{len(self._segments)}")
        seg = _Segment(path, size)
        self._segments.append(seg)
        seg.used = nbytes
        return seg, 0

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self._segments)


class ShmReader:
    """A consumer process's read-only maps of the segments it has seen (one map per segment)."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # segment -> all its bytes, as one uint8 tensor
        self._typed_cache: dict[tuple, torch.Tensor | None] = {}  # (segment, torch dtype) -> viewed as it
        self._lock = threading.Lock()

    def block(self, desc: ShmBlock) -> ColumnBlock:
        """The described rows as a `ColumnBlock` whose buffer is a read-only view of the segment."""
        m = self._map(desc)
        offsets = np.zeros(len(desc.numel) + 1, dtype=np.int64)
        np.cumsum(desc.numel, out=offsets[1:])
        flat = np.frombuffer(m, dtype=desc.dtype, count=int(offsets[-1]), offset=desc.offset)
        return ColumnBlock(flat, offsets, desc.torch_dtype)

    def rows(self, desc: ShmBlock) -> list:
        """The described rows, zero-copy, as `codec.unpack(self.block(desc), copy=False)` gives
        them, for a fraction of its cost: a get on the fast path (`copy=False`) does this once per
        column, and with several consumers each does it while the others wait for the CPU.

        Torch rows are views of one uint8 tensor per segment, made once (with its read-only
        warning silenced once, not per get), cut by one `split`."""
        if desc.torch_dtype is None:
            return unpack(self.block(desc), copy=False)
        base = self._base(desc.segment, desc.node_id)
        sizes = desc.numel.tolist()
        nbytes = sum(sizes) * desc.itemsize
        flat = base[desc.offset:desc.offset + nbytes].view(getattr(torch, desc.torch_dtype))
        return list(torch.split(flat, sizes))

    def rows_at(self, segments: list[str], dtype: str, torch_dtype: str | None, offsets: list[int],
                numels: list[int], copy: bool, node_id: str = "this") -> list:
        """Rows given by place: row i has `numels[i]` items of `dtype` at byte `offsets[i]` of
        `segments[i]` (a consumer's own claim, `claims.py`). Rows that lie back to back in one
        segment (a micro-batch put at once) are cut from one view; `copy=True` gives the column's
        rows one private, writable buffer, as `unpack` does."""
        itemsize = np.dtype(dtype).itemsize
        one = len(set(segments)) == 1 and all(
            offsets[i + 1] == offsets[i] + numels[i] * itemsize for i in range(len(offsets) - 1))
        if torch_dtype is not None:
            tdt = getattr(torch, torch_dtype)
            if one and not copy:
                typed = self._typed(segments[0], tdt, node_id)
                if typed is not None and offsets[0] % itemsize == 0:
                    start = offsets[0] // itemsize
                    return list(typed[start:start + sum(numels)].split_with_sizes(numels))
                flat = self._base(segments[0], node_id)[offsets[0]:offsets[0] + sum(numels) * itemsize].view(tdt)
            else:
                # The private buffer is numpy's: it asks for huge pages, so a 16 MB copy takes a
                # few page faults, not 4096 (a torch clone's took ~1.5x longer here).
                places = [(segments[0], offsets[0], sum(numels))] if one else zip(segments, offsets, numels)
                pieces = [np.frombuffer(self._map_path(s, node_id), dtype=np.uint8, count=n * itemsize, offset=o)
                          for s, o, n in places]
                buf = pieces[0].copy() if one else np.concatenate(pieces)
                flat = torch.from_numpy(buf).view(tdt) if len(buf) else torch.empty(0, dtype=tdt)
            return list(torch.split(flat, numels))
        if one:
            flat = np.frombuffer(self._map_path(segments[0], node_id), dtype=dtype, count=sum(numels),
                                 offset=offsets[0])
        else:
            flat = np.concatenate([np.frombuffer(self._map_path(s, node_id), dtype=dtype, count=n, offset=o)
                                   for s, o, n in zip(segments, offsets, numels)])
            copy = False
        offs = np.zeros(len(numels) + 1, dtype=np.int64)
        np.cumsum(numels, out=offs[1:])
        return unpack(ColumnBlock(flat, offs, None), copy=copy)

    def _typed(self, segment: str, dtype: torch.dtype, node_id: str) -> torch.Tensor | None:
        """The whole segment viewed as `dtype` (made once per segment and dtype), or None if its
        size is not a whole number of items."""
        key = (segment, dtype)
        typed = self._typed_cache.get(key, False)
        if typed is False:
            base = self._base(segment, node_id)
            size = dtype.itemsize if hasattr(dtype, "itemsize") else torch.empty(0, dtype=dtype).element_size()
            typed = base.view(dtype) if len(base) % size == 0 else None
            self._typed_cache[key] = typed
        return typed

    def _base(self, segment: str, node_id: str) -> torch.Tensor:
        """All of a segment's bytes as one uint8 tensor, made once (its read-only warning silenced once)."""
        base = self._tensors.get(segment)
        if base is None:
            m = self._map_path(segment, node_id)
            with warnings.catch_warnings():  # read-only by design: see codec.unpack
                warnings.simplefilter("ignore", UserWarning)
                base = torch.frombuffer(m, dtype=torch.uint8)
            self._tensors[segment] = base
        return base

    def _map(self, desc: ShmBlock) -> mmap.mmap:
        return self._map_path(desc.segment, desc.node_id)

    def _map_path(self, segment: str, node_id: str) -> mmap.mmap:
        """This process's map of `segment`, made at the first sight of it."""
        m = self._maps.get(segment)
        if m is None:
            with self._lock:
                m = self._maps.get(segment)
                if m is None:
                    for path in [p for p in self._maps if not os.path.exists(p)]:
                        del self._maps[path]  # segments of closed docks
                        self._tensors.pop(path, None)
                        for key in [k for k in self._typed_cache if k[0] == path]:
                            del self._typed_cache[key]
                    try:
                        fd = os.open(segment, os.O_RDONLY)
                    except FileNotFoundError:
                        raise DockValueError(
                            f"shared-memory segment {segment} is not on this node (or its dock was "
                            f"closed): rows written on node {node_id} can only be read there; use "
                            "data_plane='ray' for a dock whose workers span nodes") from None
                    try:
                        m = self._maps[segment] = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE,
                                                            prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
        return m


# One arena per (process, dock) and one reader per process: clients are pickled to every worker,
# so these live at module level, keyed by the dock's tag.
_arenas: dict[str, ShmArena] = {}
_arenas_lock = threading.Lock()
_reader = ShmReader()


def arena_for(tag: str, gen_path: str, node_id: str) -> ShmArena:
    arena = _arenas.get(tag)
    if arena is not None:
        return arena
    with _arenas_lock:
        for old, a in list(_arenas.items()):  # docks closed since: let their memory go
            if not os.path.exists(a.gen_path):
                del _arenas[old]
        arena = _arenas.get(tag)
        if arena is None:
            arena = _arenas[tag] = ShmArena(tag, gen_path, node_id)
        return arena


def reader() -> ShmReader:
    return _reader
