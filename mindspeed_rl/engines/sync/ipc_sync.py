"""Colocated weight sync through shared memory: a trainer and a reader in two processes on ONE device.

Why: two processes on one GPU cannot form an NCCL group (NCCL refuses two ranks on one device), and
the gloo fallback (`weight_sync.backend: gloo`) takes every byte through the CPU twice. Here the
trainer packs a bucket of parameters into one flat staging buffer on its device and hands the
reader a *handle* to that buffer plus its layout; the reader maps the same memory, copies each
tensor by name straight into its own parameters (`receive_targets()`), and acknowledges, after
which the sender reuses the buffer for the next bucket. One copy on each side, no wire.

* CPU (what CI runs): a staging buffer is one file in /dev/shm, mapped by both processes; the
  handle is its name plus the layout. This is the SAME code path as on the GPU except for how a
  buffer is allocated and mapped (`ipc_segments.Segment`), so the tests prove the protocol, the layout, the
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

Checks. `weight_sync.Checksum` still proves arrival: the sender hashes the tensors it packs
(`start(..., digest)`), the receiver hashes what it wrote into its targets as they lie there after
the sync (and what it loaded elsewhere as received), so `weight_sync.verify` compares them as for
the gloo path.

The parts, each its own module beside this one: `ipc_layout` (pieces, handles, cutting a stream of
tensors into buckets), `ipc_segments` (the shared memory and its clean-up), `ipc_sender`,
`ipc_receiver`; this module holds the channels and the two loops over them.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Protocol, Sequence

from .ipc_layout import IPCHandle
from .ipc_receiver import IPCReceiver
from .ipc_sender import IPCSender
from .weight_sync import Checksum


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
