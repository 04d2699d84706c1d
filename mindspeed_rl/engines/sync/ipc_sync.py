"""Colocated weight sync through shared memory: a trainer and a reader in two processes on ONE device.

Why: two processes on one GPU cannot form an NCCL group (NCCL refuses two ranks on one device), and
the gloo fallback (`weight_sync.backend: gloo`) takes every byte through the CPU twice. Here the
trainer packs a bucket of parameters into one flat staging buffer on its device and hands the
reader a *handle* to that buffer plus its layout; the reader maps the same memory, copies each
tensor by name straight into its own parameters (`receive_targets()`), and acknowledges, after
which the sender reuses the buffer for the next bucket. One copy on each side, no wire.

* CPU (what CI runs): a staging buffer is one file in /dev/shm, mapped by both processes; the
  handle is its name plus the layout. This is the SAME code path as on the GPU except for how a
  buffer is allocated and mapped (`_Segment`), so the tests prove the protocol, the layout, the
  splitting of big tensors, the acknowledgements and the cleanup.
* CUDA: a staging buffer is a `torch.empty(..., device="cuda")`; the handle carries the
  `(rebuild function, args)` pair that `torch.multiprocessing.reductions.reduce_tensor` returns
  (the public API the CUDA IPC sharing of torch.multiprocessing is built on; the reader calls
  `rebuild(*args)` with args[6], the device index, replaced by its own, as CUDA_VISIBLE_DEVICES may
  differ between the two processes). Imported lazily. **Written against that API but never run
  here: this machine has no GPU.** Both sides synchronize their current stream before a handle is
  handed over and before it is acknowledged, so no copy is in flight across the hand-off.

Protocol (the caller owns the channel between the processes: Ray calls in the trainer, a
process-local queue in the tests):

    sender = IPCSender(bucket_bytes, device)              # trainer side, kept for the job's life
    sender.start(named_tensors_or_buckets, digest)        # e.g. engine.export_weights(bucket_bytes)
    handles = sender.next()                               # packs a bucket into every free slot
    while handles:                                        # [] once everything was sent and acked
        ... hand `handles` to each reader; each runs receiver.receive(handles) ...
        handles = sender.next(done=handles)               # the readers' ack frees those slots
    sender.close()                                        # unlinks the segments

    receiver = IPCReceiver(targets, load, digest, attachments)   # reader side, one per sync
    receiver.receive(handles) -> bytes; receiver.finish() -> stats

`send_ipc` / `serve_ipc` run exactly that loop over a `Channel` (put/get), pipelined: the sender
packs bucket i+1 into the second slot while the reader copies bucket i out of the first.

Layout. A bucket is at most `bucket_bytes`; tensors sit at 64-byte-aligned offsets
(`base.ALIGN`), raw bytes, no cast. A tensor bigger than a bucket is split into byte pieces across
consecutive buckets (`Piece.start`), so the staging memory is bounded by `slots * bucket_bytes`
whatever the model: Qwen2.5-0.5B's fp32 embedding (544 MB) would not fit a 512 MiB bucket. A
tensor seen twice in one bucket (tied weights, same view) takes one offset. The sender never
flattens the model: it holds at most one bucket's tensor references while packing.

Zero copy (`IPCSender(zero_copy=True)`, the default). A tensor that already lies in memory the
reader can map is not packed: its piece points into that memory (`Source`) and the reader copies
straight from the trainer's parameter, so a sync costs ONE copy, as `load_state_dict` does in one
process; packing costs a second, and on a GPU both copies share the same memory bandwidth (the
packed path can reach only about half of an in-process copy there). What qualifies: contiguous
tensors in the storages of a module given to `IPCSender.adopt(module)`: on the CPU its parameters
are moved once into the sender's shared segments; on CUDA their storages are registered with their
IPC handles (nothing moves), which the reader opens once and keeps. The trainer must not change
those parameters until the sync ends (the worker's sync runs between optimizer steps). Everything else (FSDP's gathered buckets, casts, non-contiguous
tensors) goes through the staging slots.

Memory on the reader. The reader maps the sender's segments (shared pages, not a copy) and writes
each piece straight into its own tensor when that tensor is contiguous with the same dtype and
shape (byte copy, also for the pieces of a split tensor). Otherwise a whole tensor is copied with
a cast (`copy_`), and a split one is assembled in a temporary of that ONE tensor first. Names the
reader has no target for go, a bucket at a time, to `load(bucket)` (e.g. an engine's
`update_weights`; the views are valid only during the call). So the reader never holds a second
copy of the model.

Cleanup. Segment files are named `msrl-ipc-<sender pid>-<sender counter>-s<slot>g<generation>`.
They are unlinked by `IPCSender.close()`, by a finalizer at interpreter exit, and, when the sender
is killed (SIGKILL runs no Python), by a small reaper process the sender starts with its first
segment: it blocks reading a pipe only the sender writes to, sees EOF when the sender dies, and
unlinks every file with the sender's prefix. `cleanup_stale()` (run by every new sender) also
removes files of any pid that no longer exists. A reader's mapping keeps the pages alive after an
unlink until it detaches (`IPCAttachments.close()`), as with any shared memory.

Checks. `weight_sync.Checksum` still proves arrival: the sender hashes the tensors it packs
(`start(..., digest)`), the receiver hashes what it wrote into its targets as they lie there after
the sync (and what it loaded elsewhere as received), so `weight_sync.verify` compares them as for
the gloo path.
"""
from __future__ import annotations

import itertools
import mmap
import os
import re
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from ...transfer_dock.shm import pid_alive
from ..base import ALIGN, Bucket
from .weight_sync import Checksum, _dtype, _dtype_name, direct_reader

PREFIX = "msrl-ipc-"
_NAME_RE = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-")
_counter = itertools.count()
_counter_lock = threading.Lock()


def shm_dir() -> str:
    """Where CPU segments live: /dev/shm (tmpfs, RAM) where it exists, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------- layout and handles

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
        return n * _dtype(self.dtype).itemsize

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


# ---------------------------------------------------------------------------- the sender's staging

class _Segment:
    """One staging buffer: a /dev/shm file mapped into this process (CPU) or a CUDA allocation
    with its IPC handle. `buf` is a 1-D uint8 tensor over all of it."""

    def __init__(self, name: str, capacity: int, device: torch.device):
        self.name, self.capacity, self.device = name, capacity, device
        self.cuda = None
        self._mm = None
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor   # lazy: CUDA only
            self.buf = torch.empty(capacity, dtype=torch.uint8, device=device)
            self.cuda = reduce_tensor(self.buf)
        elif device.type == "cpu":
            path = os.path.join(shm_dir(), name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, capacity)
                self._mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        else:
            raise ValueError(f"ipc sync: device {device} has no shared-memory transport (cpu or cuda)")

    def close(self) -> None:
        """Unlink the name and drop our references. The mapping is never closed by hand: tensors
        from `torch.frombuffer` hold the mmap object, which unmaps when the last of them dies
        (an adopted module's parameters keep working; closing it under them would crash)."""
        self.buf = None
        self.cuda = None
        if self._mm is not None:
            self._mm = None
            _unlink(os.path.join(shm_dir(), self.name))


class _Registered:
    """CUDA: a long-lived storage of the sender's (an adopted module's parameters) with its IPC
    handle, made once; holds the storage so its address cannot be reused while registered."""

    def __init__(self, name: str, storage):
        from torch.multiprocessing.reductions import reduce_tensor   # lazy: CUDA only
        self.name, self.capacity = name, storage.nbytes()
        self.buf = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
        self.cuda = reduce_tensor(self.buf)

    def close(self) -> None:
        self.buf = None
        self.cuda = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_REAPER = r"""
import glob, os, sys
d, p = sys.argv[1], sys.argv[2]
try:
    while sys.stdin.buffer.read(1 << 16):
        pass
except BaseException:
    pass
for f in glob.glob(os.path.join(glob.escape(d), glob.escape(p) + "*")):
    try:
        os.unlink(f)
    except OSError:
        pass
"""


def _start_reaper(prefix: str) -> subprocess.Popen:
    """A process that unlinks `prefix`* when this one dies, however (it reads EOF on a pipe only
    this process holds open). Its own session, so a kill of our process group spares it; and not
    our child: `sh` starts it in the background (stdin through fd 3, as a background job's own
    stdin is /dev/null) and exits, so it is re-parented. A Ray actor's exit, ray.kill included,
    kills the actor's child processes (RAY_kill_child_processes_on_worker_exit, on by default),
    which took a direct-child reaper with it and left the segments behind in a trainer run.
    The returned Popen is that `sh` (already gone); closing its stdin lets the reaper go."""
    proc = subprocess.Popen(["sh", "-c", 'exec 3<&0; "$0" -S -c "$1" "$2" "$3" <&3 3<&- &',
                             sys.executable, _REAPER, shm_dir(), prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)
    proc.wait(timeout=30)   # the reaper runs on, holding the pipe's read end
    return proc


def _finalize(segments: dict, reaper: list, adopted: dict | None = None) -> None:
    """Close every segment (unlinking its file) and let the reaper go; safe to run twice. An
    adopted segment stays mapped while the module's parameters use it; only its name goes."""
    for seg in list(segments.values()) + list((adopted or {}).values()):
        seg.close()
    segments.clear()
    if adopted:
        adopted.clear()
    if reaper:
        proc = reaper.pop()
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except Exception:   # noqa: BLE001 - best effort at exit; the reaper still unlinks on EOF
            pass


def cleanup_stale(directory: str | None = None) -> list[str]:
    """Unlink segment files whose sender pid no longer exists (a sender killed before its reaper
    ran, or whose reaper was killed too). Returns the paths removed."""
    directory = directory or shm_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        _unlink(path)
        removed.append(path)
    return removed


def segment_files(prefix: str = PREFIX, directory: str | None = None) -> list[str]:
    """The segment files in shm_dir() whose name starts with `prefix` (a sender's `prefix`)."""
    directory = directory or shm_dir()
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix))


# ---------------------------------------------------------------------------- sender

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
        self._segments: dict[int, _Segment] = {}
        self._gen = itertools.count()
        self._busy: dict[int, int] = {}       # slot -> index of the bucket in it, until acked
        self.zero_copy = zero_copy
        self._adopted: dict[int, Any] = {}   # storage address -> its _Segment (CPU) / _Registered (CUDA)
        self._reaper: list = []
        self._want_reaper = reaper and self.device.type == "cpu"
        self._finalizer = weakref.finalize(self, _finalize, self._segments, self._reaper, self._adopted)
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
        self._stream = _pieces(_pairs(named), self.bucket_bytes, digest,
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
                self._adopted[addr] = _Registered(f"{self.prefix}p{len(self._adopted)}g{next(self._gen)}",
                                                  params[0].data.untyped_storage())
                continue
            old = params[0].data.untyped_storage()
            n = old.nbytes()
            if self._want_reaper and not self._reaper:
                self._reaper.append(_start_reaper(self.prefix))
            seg = _Segment(f"{self.prefix}p{len(self._adopted)}g{next(self._gen)}", max(n, 1), self.device)
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

    def _slot(self, nbytes: int) -> tuple[int, _Segment | None]:
        slot = next(s for s in range(self.slots) if s not in self._busy)
        if nbytes == 0:                   # everything in this bucket goes zero copy
            return slot, None
        seg = self._segments.get(slot)
        if seg is None or seg.capacity < nbytes:
            if seg is not None:
                seg.close()
            if self._want_reaper and not self._reaper:
                self._reaper.append(_start_reaper(self.prefix))
            cap = min(self.bucket_bytes, max(nbytes, 1 << 20))   # at least 1 MiB: fewer regrowths
            seg = self._segments[slot] = _Segment(f"{self.prefix}s{slot}g{next(self._gen)}", cap, self.device)
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
        st["bytes"] += sum(p.nbytes for p in _unique(pieces))
        st["bytes_zero_copy"] += sum(p.nbytes for p in _unique(pieces) if p.source >= 0)
        st["pieces"] += len(bucket)
        st["split"] += sum(1 for p, _ in bucket if not p.whole and p.start == 0)
        st["max_bucket_bytes"] = max(st["max_bucket_bytes"], nbytes)
        self._index += 1
        return h


def _pairs(named: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from pairs or from buckets (lists of pairs), as export_weights yields."""
    for x in named:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            yield x
        else:
            yield from x


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pieces(pairs: Iterator[tuple[str, torch.Tensor]], cap: int, digest: Checksum | None,
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
        shape, dt = tuple(t.shape), _dtype_name(t.dtype)
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
            src = _bytes(t) if t.is_contiguous() else t
            cur.append((Piece(name, shape, dt, off, total), src))
            seen[key] = off
            off = _align(off + total)
            continue
        flat = _bytes(t.contiguous())     # bigger than a bucket: pieces (a copy only if not contiguous)
        start = 0
        while start < total:
            n = min(total - start, cap - off)
            cur.append((Piece(name, shape, dt, off, n, start), flat[start:start + n]))
            start += n
            off = _align(off + n)
            if start < total or off >= cap:
                yield cur
                cur, off, zc, seen = [], 0, 0, {}
    if cur:
        yield cur


# ---------------------------------------------------------------------------- receiver

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
                nbytes = sum(p.nbytes for p in _unique(h.pieces))
                self.stats["buckets"] += 1
                self.stats["bytes"] += nbytes
                total += nbytes
            if cuda:
                torch.cuda.current_stream().synchronize()   # copied out before the sender may overwrite
        return total

    def _piece(self, p: Piece, buf: torch.Tensor, loads: Bucket) -> None:
        dt = _dtype(p.dtype)
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
            _bytes(tgt)[p.start:p.start + p.nbytes].copy_(src, non_blocking=True)   # straight into the parameter
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


def _unique(pieces: Iterable[Piece]) -> Iterator[Piece]:
    seen = set()
    for p in pieces:
        if p.nbytes and (p.source, p.offset) not in seen:
            seen.add((p.source, p.offset))
            yield p


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


# ---------------------------------------------------------------------------- over a channel

class Channel(Protocol):
    """One direction each way between a sender and a reader: `put(obj)`; `get(timeout_s)` returns
    the next object from the other side or raises TimeoutError."""

    def put(self, obj: Any) -> None: ...

    def get(self, timeout_s: float) -> Any: ...


class QueueChannel:
    """A Channel over two queues (queue.Queue in one process, multiprocessing queues across)."""

    def __init__(self, outbox, inbox):
        self.outbox, self.inbox = outbox, inbox

    def put(self, obj: Any) -> None:
        self.outbox.put(obj)

    def get(self, timeout_s: float) -> Any:
        import queue
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"ipc sync: nothing from the other side within {timeout_s}s") from None


class CallChannel:
    """The sender's Channel when each hand-off is a call to the reader that returns its ack (a Ray
    actor method: `CallChannel(lambda x: reader.ipc_deliver.remote(model, x),
    lambda ref, t: ray.get(ref, timeout=t))`). `put` starts a call; `get` waits for the oldest
    one's reply, so an ack always belongs to the handles it answers, whatever order the reader's
    threads ran the calls in."""

    def __init__(self, call: Callable[[Any], Any], wait: Callable[[Any, float], Any]):
        self.call, self.wait = call, wait
        self._pending: deque = deque()

    def put(self, obj: Any) -> None:
        self._pending.append(self.call(obj))

    def get(self, timeout_s: float) -> Any:
        if not self._pending:
            raise RuntimeError("ipc sync: get() with no call in flight")
        return self.wait(self._pending.popleft(), timeout_s)


class Mailbox:
    """The reader's Channel when the handles arrive as calls on other threads (a threaded Ray
    actor's method): the call runs `deliver(handles, timeout_s)`, which queues them for the thread
    running `serve_ipc(receiver, mailbox)` (the one holding the weights' write lock) and returns
    that thread's reply (the ack, or at the end the stats). A delivery that comes before the serving
    thread starts simply waits in the queue (bounded by its timeout)."""

    def __init__(self):
        import queue
        self._q: "queue.Queue" = queue.Queue()
        self._reply = None

    def deliver(self, obj: Any, timeout_s: float) -> Any:
        import queue
        reply: "queue.Queue" = queue.Queue(1)
        self._q.put((obj, reply))
        try:
            return reply.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"ipc sync: the reader did not answer within {timeout_s}s") from None

    def get(self, timeout_s: float) -> Any:
        import queue
        try:
            obj, self._reply = self._q.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"ipc sync: nothing from the sender within {timeout_s}s") from None
        return obj

    def put(self, obj: Any) -> None:
        reply, self._reply = self._reply, None
        if reply is None:
            raise RuntimeError("ipc sync: Mailbox.put with no delivery to answer")
        reply.put(obj)


def send_ipc(sender: IPCSender, named: Iterable, channels: Channel | Sequence[Channel],
             timeout_s: float = 60.0, digest: Checksum | None = None) -> dict:
    """The sender's whole side of a sync to one or more readers, each behind a channel. Pipelined:
    bucket i+1 is packed into a free slot while the readers load bucket i; a slot is reused only
    once every reader acknowledged it. Ends with None to each reader, whose final stats come back.
    Returns the sender's `last_sync` plus `readers` (each reader's `finish()` stats)."""
    chans = [channels] if not isinstance(channels, (list, tuple)) else list(channels)
    sender.start(named, digest)
    inflight: deque[list[IPCHandle]] = deque()
    try:
        while True:
            if sender.has_more and sender.free_slots():
                hs = sender.next(limit=1)
                if hs:
                    for ch in chans:
                        ch.put(hs)
                    inflight.append(hs)
                    continue
            if not inflight:
                break
            hs = inflight.popleft()
            for ch in chans:
                ack = ch.get(timeout_s)
                if isinstance(ack, BaseException):
                    raise RuntimeError("ipc sync: a reader failed") from ack
                if ack != [h.index for h in hs]:
                    raise RuntimeError(f"ipc sync: reader acknowledged {ack}, expected {[h.index for h in hs]}")
            sender.release(hs)
        sender.next()                        # [] and the sync's stats
    except BaseException:
        sender.abort()
        raise
    for ch in chans:
        ch.put(None)
    readers = [ch.get(timeout_s) for ch in chans]
    for r in readers:
        if isinstance(r, BaseException):
            raise RuntimeError("ipc sync: a reader failed") from r
    return dict(sender.last_sync, readers=readers)


def serve_ipc(receiver: IPCReceiver, channel: Channel, timeout_s: float = 60.0,
              finish: Callable[[], dict] | None = None) -> dict:
    """The reader's whole side: receive each batch of handles, acknowledge it with its bucket
    indexes, and at None finish (`finish`, default `receiver.finish`) and send back the stats.
    A failure is sent to the sender (so it stops waiting) and re-raised."""
    try:
        while True:
            hs = channel.get(timeout_s)
            if hs is None:
                break
            receiver.receive(hs)
            channel.put([h.index for h in hs])
        info = (finish or receiver.finish)()
    except BaseException as e:
        receiver.attachments.close()
        try:
            channel.put(RuntimeError(f"ipc sync reader: {type(e).__name__}: {e}"))
        except Exception:   # noqa: BLE001 - the channel itself may be what failed
            pass
        raise
    channel.put(info)
    return info
