"""Weight sync from a train engine to the engines that read the same model (rollout, inference).

The trainer's `export_weights(bucket_bytes)` yields the model a bucket at a time, in HF names, in
the model's dtype and on its device. In one process (colocated) a sync is a copy: every bucket is
handed to each reader's `update_weights` (`copy_weights`). Across processes (disaggregated) the
sending rank broadcasts every bucket in a process group of its own (`stateless_group`: a backend
over a TCPStore, never torch's default group, so it does not collide with DDP, FSDP or vLLM):

* The wire. A bucket travels as one byte buffer: its tensors' raw bytes (no cast: bf16 stays bf16)
  at 64-byte-aligned offsets. A run of tensors that already lie that way in the sender's memory
  (side by side in one storage, at the same relative offsets: a module whose parameters were
  moved into one buffer by `base.flatten_parameters`) goes out as ONE broadcast straight from that
  memory; so does a lone tensor, when the run has at least `inplace_min_bytes` (no copy either
  way). The rest is packed, on its device, into a small reused staging buffer and goes out as one
  broadcast per packed run. Per-broadcast cost is what matters on gloo: a Qwen2.5-0.5B bucket of
  unflattened tensors took ~180 broadcasts per sync and reached 0.69-0.78 of one flat broadcast.
  Receivers receive the bucket into one buffer on their device and get views into it, or, given
  `targets`, receive a run straight into the reader's tensors when those lie the same way.
* The layout. A bucket's `BucketSpec` (`bucket_layout.py`: names, shapes, dtypes, offsets, the broadcasts it takes)
  is what a receiver must know before it can receive. Each bucket is preceded by a 3-integer header
  broadcast (layout version, bucket index, bytes); the specs of a layout version are written to the
  group's TCPStore once, the first time that version is sent, and cached on every side. The sender
  compares each bucket's spec with the cached one: a different bucket size, name, shape or dtype
  bumps the version, and receivers, seeing a version they do not hold, read the new specs from the
  store (`SyncGroup.layout_changes` counts that).
* Overlap and memory. The sender issues bucket i+1's broadcasts before waiting for bucket i's, so a
  sharded engine's gather of the next bucket overlaps the transfer of the current one; the sender
  holds at most two buckets of the iterator (plus two staging buffers of small tensors). A
  receiver (`prefetch=True`) receives bucket i+1 into a second buffer while its consumer loads
  bucket i, and hands out views into that reused buffer: **a yielded bucket's tensors are valid
  until the generator is resumed**; `update_weights` must copy them out (every engine does) or the
  caller asks for `reuse_buffers=False` (a fresh buffer per bucket, views valid for good).

Every member of the group takes part in every sync to its end: the sender runs `send_buckets`, each
receiver exhausts `receive_buckets`; ranks of a sharded trainer other than the sender iterate
`export_weights` to its end without sending (its gathers are collective). A sending rank that also
holds readers, or checks what it sent, does it in the same pass (`tee_buckets`). `Checksum` /
`checksum` hash names, dtypes and bytes, fed a bucket at a time, so both sides of a sync can be
compared (`weight_sync.verify`; it reads every weight back to the CPU: tests and small models).

Usage (the worker's side):

    group = stateless_group(host, port, rank, world_size, dist_backend(device), timeout_s)
    # trainer, sync rank 0 (rank 0 of the model's DP group):
    send_buckets(group, tee_buckets(engine.export_weights(bucket_bytes), local_readers, version))
    # trainer, other DP ranks:    for _ in engine.export_weights(bucket_bytes): pass
    # a reader in another process (big tensors straight into the engine's own where it can):
    receive_weights(group, [engine], version)
    # colocated, no group:         copy_weights(engine.export_weights(bucket_bytes), readers, version)
"""
from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator, Sequence

import torch

from ..base import Bucket, NamedTensors
from .bucket_layout import INPLACE_MIN_BYTES, BucketSpec, Entry, dtype_name, dtype_of, location, span
_KEY = "weight_sync/layout"     # store keys: f"{_KEY}/{version}/{bucket index}" -> a BucketSpec's JSON


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the group

@dataclass
class SyncGroup:
    """A stateless group's backend and store, and what a sync over it caches between calls."""
    pg: object              # the c10d backend (ProcessGroupGloo / NCCL / HCCL), not a registered group
    store: object           # the TCPStore (held so it lives as long as the group; rank 0 hosts it)
    rank: int
    world_size: int
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where buffers live
    layout_version: int = 0             # the layout version this side holds (0: none yet)
    layout: dict = field(default_factory=dict)  # bucket index -> BucketSpec of `layout_version`
    layout_changes: int = 0             # times a new layout version was sent or received
    last_sync: dict = field(default_factory=dict)  # what the last send/receive moved
    _buffers: dict = field(default_factory=dict)  # (role, slot, device) -> reused byte buffer

    def buffer(self, key, nbytes: int, device: torch.device) -> torch.Tensor:
        """A reused 1-D uint8 buffer of at least `nbytes` (grown, never shrunk, while the group lives)."""
        k = (key, str(device))
        buf = self._buffers.get(k)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(k, None)
            del buf                      # release the old one before allocating the larger one
            buf = self._buffers[k] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def release_buffers(self) -> None:
        """Free the reused buffers (a rollout engine about to sleep, or the end of the run)."""
        self._buffers.clear()

    def broadcast(self, tensor: torch.Tensor, src: int):
        return self.pg.broadcast([tensor], _broadcast_options(src))


def _broadcast_options(src: int):
    import torch.distributed as dist
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def stateless_group(host: str, port: int, rank: int, world_size: int, backend: str | None = None,
                    timeout_s: float = 60.0, device: torch.device | str | None = None) -> SyncGroup:
    """A process group of its own over a TCPStore; rank 0 hosts the store.

    `backend`: gloo (CPU tensors), nccl (CUDA) or hccl (Ascend NPU, torch_npu's ProcessGroupHCCL);
    None picks it from `device` (`device.dist_backend`). Every member must call this at about the
    same time (the constructor rendezvous); `timeout_s` bounds that wait and every collective, so a
    missing member fails with an error instead of hanging.
    """
    import torch.distributed as dist

    from ...device import dist_backend

    if backend is None:
        backend = dist_backend(device if device is not None else "cpu")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=True)
    pg_store = dist.PrefixStore("weight_sync_pg", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(pg_store, rank, world_size, timeout)
        dev = torch.device(device) if device is not None else torch.device("cpu")
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(pg_store, rank, world_size, opts)
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    elif backend == "hccl":
        import torch_npu  # noqa: F401  (registers the npu device)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupHCCL(pg_store, rank, world_size, opts)
        dev = torch.device("npu", torch.npu.current_device()) if device is None else torch.device(device)
    else:
        raise ValueError(f"weight sync backend={backend!r}: gloo, nccl and hccl are supported")
    if hasattr(pg, "_set_sequence_number_for_group"):
        pg._set_sequence_number_for_group()
    return SyncGroup(pg=pg, store=store, rank=rank, world_size=world_size, backend=backend, device=dev)



def _store_key(version: int, index: int) -> str:
    return f"{_KEY}/{version}/{index}"


# ---------------------------------------------------------------------------- sending

def send_buckets(group: SyncGroup, buckets: Iterable[Bucket], src: int = 0,
                 inplace_min_bytes: int = INPLACE_MIN_BYTES, overlap: bool = True) -> dict:
    """Broadcast every bucket from this rank (`src` of `group`) to the other members.

    `overlap`: pull (gather) the next bucket while this one is in flight (two buckets alive);
    False waits for each bucket first (one alive: less memory, slower with a gathering engine).

    Returns what was sent: buckets, bytes (on the wire), max_bucket_bytes, max_packed_bytes (the
    largest staging a bucket took; two are kept), layout_version, layout_changed (also kept as
    `group.last_sync`)."""
    if group.rank != src:
        raise ValueError(f"send_buckets on rank {group.rank} of the sync group; only src={src} sends")
    old, old_version = group.layout, group.layout_version
    version, changed = old_version, False
    new: dict[int, BucketSpec] = {}
    inflight: list = []         # [(works, bucket kept alive)] of the bucket(s) not yet waited for
    sent_bytes = biggest = staged = 0
    index = -1
    for index, bucket in enumerate(buckets):
        spec = BucketSpec.describe(bucket, inplace_min_bytes)
        new[index] = spec
        if not changed and old.get(index) != spec:
            changed, version = True, old_version + 1
            for j in range(index):                   # the unchanged buckets before it, under the new version
                group.store.set(_store_key(version, j), new[j].to_json())
        if changed:
            group.store.set(_store_key(version, index), spec.to_json())
        works = [group.broadcast(_header(version, index, spec.nbytes, group.device), src)]
        # packed runs side by side in one staging buffer (all of a bucket's broadcasts are in
        # flight together); slot index % 2, as the previous bucket's may still be in flight too
        staging, at = None, 0
        for start, end, packed in spec.segments:
            if packed:
                if staging is None:
                    staging = group.buffer(("send", index % 2), spec.packed_bytes, _device_of(bucket))
                buf = staging[at:at + end - start]
                at += end - start
                spec.pack(bucket, buf, start, end)
            else:   # one tensor, or a span of adjacent ones, straight from the sender's memory
                buf = span(_tensor_at(spec, bucket, start), end - start)
            works.append(group.broadcast(buf, src))
        sent_bytes += spec.nbytes
        biggest = max(biggest, spec.nbytes)
        staged = max(staged, spec.packed_bytes)
        inflight.append((works, bucket))
        del bucket
        while len(inflight) > (1 if overlap else 0):   # wait for the bucket(s) before the next pull
            for w in inflight.pop(0)[0]:
                w.wait()
    if not changed and len(old) != index + 1:        # fewer buckets than the cached layout
        changed, version = True, old_version + 1
        for j, spec in new.items():
            group.store.set(_store_key(version, j), spec.to_json())
    works = [group.broadcast(_header(version, -1, index + 1, group.device), src)]
    for ws, _ in inflight:
        for w in ws:
            w.wait()
    for w in works:
        w.wait()
    inflight.clear()
    if changed:
        group.layout, group.layout_version = new, version
        group.layout_changes += 1
    group.last_sync = {"buckets": index + 1, "bytes": sent_bytes, "max_bucket_bytes": biggest,
                       "max_packed_bytes": staged, "layout_version": version, "layout_changed": changed}
    return dict(group.last_sync)


def _header(version: int, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([version, index, nbytes], dtype=torch.int64, device=device)


def _device_of(bucket: Bucket) -> torch.device:
    return bucket[0][1].device


def _tensor_at(spec: BucketSpec, bucket: Bucket, offset: int) -> torch.Tensor:
    for e, (_, t) in zip(spec.entries, bucket):
        if e.offset == offset and e.nbytes:
            return t
    raise AssertionError(f"no tensor at offset {offset}")


# ---------------------------------------------------------------------------- receiving

def receive_buckets(group: SyncGroup, device: torch.device | str | None = None, src: int = 0,
                    prefetch: bool = True, reuse_buffers: bool = True,
                    targets: dict[str, torch.Tensor] | None = None) -> Iterator[Bucket]:
    """Yield the buckets `src` sends, as [(name, view into the received buffer)].

    Pass each straight to `engine.update_weights(bucket, version)`. With `reuse_buffers` (the
    default) the views are valid until the generator is resumed (the consumer copies them out);
    with `prefetch` the next bucket is received while the consumer loads this one (two buffers).
    `targets` ({HF name: the reader's own tensor}, e.g. an HF model's
    `dict(named_parameters(remove_duplicate=False))`): a span the sender sends straight from its
    memory (one tensor, or adjacent ones) whose targets have the same shapes and dtypes, are
    contiguous on `device` and lie side by side in one storage at the span's relative offsets (a
    reader that ran `base.flatten_parameters`), with no other target in the gaps, is received
    straight into them in one broadcast, with no copy, and left out of the yielded bucket (a
    bucket left empty is not yielded). The gap bytes between the targets of a span (alignment
    padding) are overwritten.
    The generator must be exhausted: every member takes part in every broadcast of a sync.
    `group.last_sync` then says what came (buckets, bytes, bytes_into_targets, names_into_targets,
    layout_version, layout_changed). A reader engine's side of a sync is `receive_weights`."""
    device = torch.device(device) if device is not None else group.device
    spans = _target_spans(targets) if targets else {}
    changed = False
    nbytes_total = direct_total = 0
    into_targets: list[str] = []
    header = torch.empty(3, dtype=torch.int64, device=group.device)
    group.broadcast(header, src).wait()
    pending: Bucket | None = None
    slot = 0
    while True:
        version, index, nbytes = (int(v) for v in header.tolist())
        if index < 0:
            break
        if version != group.layout_version:
            group.layout, group.layout_version = {}, version
            group.layout_changes += 1
            changed = True
        spec = group.layout.get(index)
        if spec is None:
            spec = group.layout[index] = BucketSpec.from_json(group.store.get(_store_key(version, index)))
        if spec.nbytes != nbytes:
            raise RuntimeError(f"weight sync: bucket {index} of layout version {version} is {nbytes} bytes "
                               f"on the sender but {spec.nbytes} in its stored layout")
        direct = _direct_targets(spec, targets, device, spans) if targets else {}
        covered = _covered(spec, direct)
        into = sum(e.nbytes for e in covered.values())
        if all(start in direct for start, _, _ in spec.segments):
            buf = None
        elif reuse_buffers:
            buf = group.buffer(("recv", slot), spec.nbytes, device)[:spec.nbytes]
            slot = (slot + 1) % 2 if prefetch else 0
        else:
            buf = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
        works = [group.broadcast(direct[start] if start in direct else buf[start:end], src)
                 for start, end, _ in spec.segments]
        header = torch.empty(3, dtype=torch.int64, device=group.device)
        works.append(group.broadcast(header, src))
        nbytes_total += spec.nbytes
        direct_total += into
        into_targets += [e.name for e in spec.entries if e.nbytes and e.offset in covered]
        if not prefetch:
            for w in works:
                w.wait()
            got = _views(spec, buf, covered, device)
            if got:
                yield got
            continue
        if pending:
            yield pending                      # loaded while this bucket arrives
        for w in works:
            w.wait()
        pending = _views(spec, buf, covered, device)
    if pending:
        yield pending
    if version != group.layout_version:     # only the bucket count changed (seen in the end header)
        group.layout, group.layout_version = {}, version
        group.layout_changes += 1
        changed = True
    group.last_sync = {"buckets": nbytes, "bytes": nbytes_total, "bytes_into_targets": direct_total,
                       "names_into_targets": into_targets,
                       "layout_version": version, "layout_changed": changed}  # end header: the bucket count


def direct_reader(readers) -> tuple[Any, dict | None]:
    """The first reader that offers tensors to receive into in place (`receive_targets()`), with them;
    (None, None) when none does. Every transport (collective or IPC) lands bytes in that one reader."""
    for reader in readers:
        targets = reader.receive_targets()
        if targets:
            return reader, targets
    return None, None


def receive_weights(group: SyncGroup, readers: Sequence, version: int, digest: "Checksum | None" = None,
                    src: int = 0, prefetch: bool = True, reuse_buffers: bool = True) -> dict:
    """A reader process's whole side of a sync (`Worker.sync_weights` runs exactly this): receive
    every bucket `src` sends and have `readers` serve `version`.

    The first reader whose `receive_targets()` is not None gets the big tensors straight into its
    own (`receive_buckets(targets=...)`): on a CPU the copy out of a receive buffer is a third of
    the sync. Every reader loads the rest a bucket at a time (`update_weights`); the other readers
    then load the tensors that went in place from that reader's (a copy in this process),
    and that reader is told `update_weights((), version)`. `digest` hashes what arrived: the yielded
    buckets and then the in-place tensors themselves, so it equals the sender's digest only if every
    byte arrived, and `weight_sync.verify` still compares it (and each reader's `state_checksum`)
    with what was sent. Returns `group.last_sync` (bytes_into_targets: what needed no copy)."""
    direct, targets = direct_reader(readers)
    for bucket in tee_buckets(receive_buckets(group, group.device, src, prefetch, reuse_buffers, targets),
                              readers, version, digest):
        pass
    info = dict(group.last_sync)
    in_place = [(name, targets[name]) for name in info.get("names_into_targets", ())]
    if in_place:
        for reader in readers:
            if reader is not direct:
                reader.update_weights(in_place, version)
        if digest is not None:
            digest.update(in_place)
    if direct is not None:
        direct.update_weights((), version)   # its tensors are loaded: serve `version` (versions, caches)
    return info


def _target_spans(targets: dict) -> dict[tuple, list[tuple[int, int]]]:
    """(device, storage address) -> the byte ranges the targets take in that storage."""
    out: dict[tuple, set] = {}
    for t in targets.values():
        at = location(t) if t is not None and t.numel() else None
        if at is not None:
            out.setdefault(at[:2], set()).add((at[2], at[2] + t.numel() * t.element_size()))
    return {k: sorted(v) for k, v in out.items()}


def _direct_targets(spec: BucketSpec, targets: dict, device: torch.device,
                    spans: dict[tuple, list[tuple[int, int]]]) -> dict[int, torch.Tensor]:
    """segment start -> the reader's bytes to receive it into, for the segments sent straight
    from the sender's memory whose targets lie exactly as the segment: each entry's target has
    its shape and dtype, is contiguous on `device`, and sits in one storage at the entry's offset
    relative to the segment (aliases in the bucket at the same place), and no other target of
    that storage overlaps the segment's bytes (the gaps are padding of nobody's)."""
    out = {}
    by_offset: dict[int, list[Entry]] = {}
    for e in spec.entries:
        if e.nbytes:
            by_offset.setdefault(e.offset, []).append(e)
    offsets = sorted(by_offset)
    for start, end, packed in spec.segments:
        if packed:
            continue
        placed = _placed(start, [e for off in offsets if start <= off < end for e in by_offset[off]], targets, device)
        if placed is None:
            continue
        t, at, mine = placed
        lo, hi = at[2], at[2] + (end - start)
        if all(r in mine for r in spans.get(at[:2], ()) if r[0] < hi and r[1] > lo):
            out[start] = span(t.detach(), end - start)
    return out


def _placed(start: int, entries: list[Entry], targets: dict, device: torch.device):
    """(the first entry's target, where it lies, the byte ranges all take) when every entry of the
    segment starting at `start` has a target of its shape and dtype, contiguous on `device`, at
    the entry's offset relative to the first one in the same storage; None otherwise."""
    first, mine = None, set()
    for e in entries:
        t = targets.get(e.name)
        at = location(t) if t is not None else None
        if at is None or t.device != device or t.dtype != dtype_of(e.dtype) or tuple(t.shape) != e.shape:
            return None
        if first is None:
            first = (t, at)
        elif at[:2] != first[1][:2] or at[2] - first[1][2] != e.offset - start:
            return None
        mine.add((at[2], at[2] + e.nbytes))
    return None if first is None else (*first, mine)


def _covered(spec: BucketSpec, direct: dict[int, torch.Tensor]) -> dict[int, Entry]:
    """offset -> the first entry there, for every entry inside a segment received into targets."""
    ranges = [(start, end) for start, end, _ in spec.segments if start in direct]
    out: dict[int, Entry] = {}
    for e in spec.entries:
        if e.nbytes and any(a <= e.offset < b for a, b in ranges):
            out.setdefault(e.offset, e)
    return out


def _views(spec: BucketSpec, buf: torch.Tensor | None, covered: dict[int, Entry],
           device: torch.device) -> Bucket:
    """The bucket's tensors that were not received straight into targets."""
    out = []
    for e in spec.entries:
        if e.nbytes == 0:
            out.append((e.name, torch.empty(e.shape, dtype=dtype_of(e.dtype), device=device)))
        elif e.offset not in covered:
            out.append((e.name, buf[e.offset:e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)))
    return out


# ---------------------------------------------------------------------------- in one process

def tee_buckets(buckets: Iterable[Bucket], readers: Sequence = (), version: int = 0,
                digest: "Checksum | None" = None) -> Iterator[Bucket]:
    """Pass buckets through, first handing each to local readers' `update_weights` and/or hashing
    it into `digest`: a trainer rank that sends and also holds readers (or checks what it sent)
    does it all in one pass over `export_weights`, e.g.
    `send_buckets(group, tee_buckets(engine.export_weights(b), local_readers, version, digest))`."""
    for bucket in buckets:
        for reader in readers:
            reader.update_weights(bucket, version)
        if digest is not None:
            digest.update(bucket)
        yield bucket


def copy_weights(buckets: Iterable[Bucket], readers: Sequence, version: int) -> dict:
    """Colocated sync: hand every bucket to each reader's `update_weights` (no group, no buffer)."""
    n = nbytes = 0
    for bucket in tee_buckets(buckets, readers, version):
        n += 1
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return {"buckets": n, "bytes": nbytes}


class Checksum:
    """sha256 of named weights that can be fed a bucket at a time, in any order: each tensor's
    dtype, shape and raw bytes are hashed on their own, then the per-name digests in name order.
    Equal on two sides iff they hold the same weights under the same names and dtypes (a name fed
    twice counts once, its last value). Reads every weight back to the CPU: for tests and small
    models (`weight_sync.verify`)."""

    def __init__(self):
        self._parts: dict[str, bytes] = {}

    def update(self, named_tensors: NamedTensors | Sequence[torch.Tensor]) -> "Checksum":
        for i, x in enumerate(named_tensors):
            name, t = (f"#{i:08d}", x) if isinstance(x, torch.Tensor) else x
            t = t.detach()
            h = hashlib.sha256(f"{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            self._parts[name] = h.digest()
        return self

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self._parts):
            h.update(name.encode() + b"\0" + self._parts[name])
        return h.hexdigest()[:16]


def checksum(named_tensors: NamedTensors | Sequence[torch.Tensor]) -> str:
    """`Checksum` of (name, tensor) pairs in one go; bare tensors are named by their position."""
    return Checksum().update(named_tensors).hexdigest()
