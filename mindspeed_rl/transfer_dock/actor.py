"""The dock as a Ray actor: one `TransferDock` served to many workers at once.

It is an async actor: Ray calls run on one event loop, and a blocking get awaits a put there
without holding a thread, so one stalled consumer never stalls the others. Data comes in three forms (see `docs/transfer_dock.md` for the measurements behind it):
- inline: the rows travel in the call (`ColumnBlock`) and the actor keeps them;
- in shared memory (same node): the producer copies its block into a segment it owns and the actor
  keeps only a descriptor (`ShmBlock`, see `shm.py`), so the bytes go producer -> consumer once;
- by reference (across nodes): the producer `ray.put`s its block and the actor keeps only the
  `ObjectRef`.
Workers use it through `TransferDockClient`, which picks the form by size and by node.

Calls come two ways: as Ray actor calls, and, from callers on the dock's node, over the dock's
local channel (`channel.py`), a Unix socket, ~20x cheaper than a Ray call. The channel's
connection threads answer what need not wait themselves (`_channel_direct`), every dock access
under the dock's lock; a get that must wait goes to the loop. A put or clear on either path wakes
the waiting gets of both (`_changed_now`).
"""
from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray

from . import channel, shm
from .claims import ClaimBoard
from .codec import ColumnBlock, pack, unpack
from .dock import TransferDock
from .errors import DockValueError
from .metrics import RayMetricsExport
from .shared_dock import SharedDock
from .shm import ShmBlock


@dataclass
class HeldReply:
    """A get answered over the local channel whose rows include Ray object references: refs
    must travel through Ray's own serializer, so the reply waits in the actor under `token` and
    the caller fetches it with a Ray call (`take_held`)."""

    token: int


@dataclass
class RefBlock:
    """A block that stayed in the producer's object store: the actor sees only sizes.

    On the wire `ref` is a slot number into the call's list of refs (refs must travel through
    Ray's own serializer, or Ray pins their objects forever); the actor swaps in the ObjectRef.
    """

    ref: Any  # slot number on the wire; the ObjectRef once stored
    column: str  # the object holds {column: ColumnBlock} for all large columns of one put
    numel: np.ndarray  # per row
    itemsize: int
    kind: str  # as ColumnBlock.kind

    def __len__(self) -> int:
        return len(self.numel)


class Cell:
    """One stored cell: row `pos` of a block held inline or by reference."""

    __slots__ = ("source", "pos", "numel", "nbytes")

    def __init__(self, source: ColumnBlock | RefBlock | ShmBlock, pos: int, numel: int, nbytes: int):
        self.source, self.pos, self.numel, self.nbytes = source, pos, numel, nbytes

    def __len__(self) -> int:
        return self.numel


def _cells(block: ColumnBlock | RefBlock | ShmBlock) -> list[Cell]:
    if isinstance(block, (RefBlock, ShmBlock)):
        return [Cell(block, i, int(n), int(n) * block.itemsize) for i, n in enumerate(block.numel.tolist())]
    itemsize = block.flat.itemsize
    return [Cell(block, i, block.row_numel(i), block.row_numel(i) * itemsize) for i in range(len(block))]


def reply_parts(cells: Sequence[Cell], refs: list,
                inline_shm: bool = False) -> list[tuple[list[int], Any, list[int] | None]]:
    """Group a column's cells by source: (output positions, inline block or ref slot, source positions).

    Referenced blocks are appended to `refs` (once each) and named by their slot in it; a
    shared-memory block travels as its descriptor, or, for a caller on another node (`inline_shm`),
    which cannot map the segment, as its rows read here (the dock shares the producer's node).
    """
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    for out_pos, cell in enumerate(cells):
        g = groups.setdefault(id(cell.source), (cell.source, [], []))
        g[1].append(out_pos)
        g[2].append(cell.pos)
    parts = []
    for source, out_pos, src_pos in groups.values():
        if isinstance(source, RefBlock):
            slot = next((i for i, r in enumerate(refs) if r is source.ref), None)
            if slot is None:
                slot = len(refs)
                refs.append(source.ref)
            parts.append((out_pos, (slot, source.column), src_pos))
        elif isinstance(source, ShmBlock) and not inline_shm:
            parts.append((out_pos, source, src_pos))
        elif isinstance(source, ShmBlock):
            parts.append((out_pos, shm.reader().block(source).take(src_pos), None))
        else:
            parts.append((out_pos, source.take(src_pos), None))
    return parts


class TransferDockActor:
    """Ray actor around one `TransferDock` (create it with `create_transfer_dock`)."""

    def __init__(self, columns: Sequence[str], consumers: Sequence[str], prompts_num: int,
                 n_samples_per_prompt: int = 1, shm_tag: str | None = None, metrics_interval_s: float = 1.0,
                 channel_tag: str | None = None, local_claims: bool = False, **dock_kwargs: Any) -> None:
        # With shared memory and the local channel, same-node consumers claim rows themselves
        # (claims.py); the dock is then a SharedDock, which keeps the shared files in step.
        local_claims = bool(local_claims and shm_tag and channel_tag)
        self._dock = (SharedDock if local_claims else TransferDock)(columns, consumers, prompts_num,
                                                                    n_samples_per_prompt, **dock_kwargs)
        self._claims: ClaimBoard | None = None
        if local_claims:
            try:
                self._claims = ClaimBoard(shm_tag, self._dock.columns, self._dock.consumers, self._dock.capacity,
                                          ray.get_runtime_context().get_node_id())
            except OSError as e:  # no room in /dev/shm: every get goes to the actor, as without claims
                warnings.warn(f"TransferDock: no local claims ({e}); every get calls the dock", RuntimeWarning)
            else:
                self._dock.attach(self._claims)
        # the counters go to ray.util.metrics on a timer (0: never), not per call: see RayMetricsExport
        self._metrics_interval_s = float(metrics_interval_s)
        self._export: RayMetricsExport | None = None
        self._export_task: asyncio.Task | None = None
        self._export_error: str | None = None
        # the same-node data plane's generation counter, bumped by clear() (see shm.py)
        self._generation = shm.Generation(shm_tag) if shm_tag else None
        self._puts = 0  # bumped by every put and clear; blocked gets wait for it to change
        self._changed: asyncio.Condition | None = None
        self._waiting = 0  # gets waiting on the loop: a put from a channel thread wakes the loop only then
        # Puts, clears and held replies run on the loop and on the channel's threads: this lock
        # makes each whole (a put's generation check and its store, a clear and its generation
        # bump); taken before the dock's own `_cond`, never after.
        self._lock = threading.RLock()
        self._loop: asyncio.AbstractEventLoop | None = None
        # the local channel (a Unix socket, served from the first `local_info` call on)
        self._channel_path = channel.socket_path(shm.SHM_DIR, channel_tag, os.getpid()) if channel_tag else None
        self._channel: asyncio.AbstractServer | None = None
        self._held: dict[int, tuple[bytes, list]] = {}  # HeldReply.token -> (reply, refs)
        self._next_token = 0

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the actor's event loop, at first use
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        """Wake the gets waiting on the loop (call on the loop, after `_changed_now`)."""
        async with self._condition():
            self._condition().notify_all()

    def _changed_now(self) -> None:
        """Count a put or clear (under `_lock`) and, from a channel thread, wake the loop's
        waiting gets. A get that begins to wait reads `_puts` before its attempt and counts itself
        in `_waiting` before it sleeps, so a put that sees `_waiting == 0` cannot leave it asleep."""
        self._puts += 1
        loop = self._loop
        if self._waiting and loop is not None and not _on_loop(loop):
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._notify()))

    async def noop(self) -> None:
        """An empty call: the floor any dock call is measured against."""

    def _start_export(self) -> None:
        """Start the metrics timer on the actor's event loop (at the first put or layout call)."""
        if self._export_task is None and self._metrics_interval_s > 0:
            self._export_task = asyncio.get_running_loop().create_task(self._export_loop())

    async def _export_loop(self) -> None:
        try:
            self._export = RayMetricsExport()
        except Exception as e:  # no ray.util.metrics here: the dock works on, without export
            self._export_error = f"{type(e).__name__}: {e}"
            return
        while True:
            try:
                self._export.update(self._dock.get_metrics())
            except Exception as e:  # keep the dock serving; the status call reports it
                self._export_error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(self._metrics_interval_s)

    async def metrics_export_status(self) -> dict:
        """What the metrics timer last handed to `ray.util.metrics` (get_metrics keys -> values)."""
        e = self._export
        return {"interval_s": self._metrics_interval_s, "running": self._export_task is not None
                and not self._export_task.done(), "updates": e.updates if e else 0,
                "sent": dict(e.sent) if e else {}, "error": self._export_error}

    # put and get take one pickled blob and answer one: each extra argument or reply object costs
    # Ray ~0.1-0.2 ms of serialization, as much as the dock's own work (docs/transfer_dock.md).
    async def put(self, blob: bytes, refs: list | None = None) -> None:
        await self._put(pickle.loads(blob), refs)

    async def _put(self, payload: tuple, refs: list | None = None) -> None:
        if self._export_task is None:
            self._start_export()
        self._put_now(payload, refs)
        await self._notify()

    def _put_direct(self, payload: tuple) -> None:
        """A put from the local channel, on its connection's thread."""
        if self._export_task is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_export)
        self._put_now(payload, None)

    def _put_now(self, payload: tuple, refs: list | None) -> None:
        blocks, indexes, overwrite, producer, *worker = payload  # worker: a label, may be absent
        with self._lock:  # the generation checked and the cells stored with no clear() between
            for column, block in blocks.items():
                if isinstance(block, RefBlock):
                    if refs is None:
                        raise DockValueError(f"put_experience: column '{column}' names a Ray object, which must come "
                                             "with a Ray actor call (the client sends such puts that way), not over "
                                             "the local channel")
                    block.ref = refs[block.ref]
                elif isinstance(block, ShmBlock) and (self._generation is None
                                                      or block.generation != self._generation.value):
                    now = "no shared memory" if self._generation is None else f"generation {self._generation.value}"
                    raise DockValueError(
                        f"put_experience: column '{column}' (rows {indexes[:8]}{'...' if len(indexes) > 8 else ''}) was "
                        f"written to shared memory in generation {block.generation}, but the dock has {now}: the "
                        "dock was cleared after the rows were made, so their bytes may be reused; put a step's rows "
                        "before clear() ends it")
            kinds = {c: b.kind for c, b in blocks.items()}
            self._dock.put_cells({c: _cells(b) for c, b in blocks.items()}, indexes, overwrite=overwrite,
                                 producer=producer, kinds=kinds, worker=worker[0] if worker else None)
            self._changed_now()

    async def get(self, blob: bytes, off_node: bool = False):
        """Answers the pickled `(parts_by_column, rows)`, with the list of refs they name if any;
        `off_node`: the caller is not on this node, so rows in shared memory go as bytes."""
        reply, refs = await self._reply(pickle.loads(blob), inline_shm=off_node)
        return (reply, refs) if refs else reply

    async def _reply(self, request: tuple, inline_shm: bool = False) -> tuple[bytes, list]:
        data, rows = await self._get(*request)
        refs: list = []
        reply = pickle.dumps(({c: reply_parts(cells, refs, inline_shm) for c, cells in data.items()}, rows),
                             protocol=pickle.HIGHEST_PROTOCOL)
        return reply, refs

    async def _channel_get(self, request: tuple):
        return self._channel_reply(*(await self._reply(request)))

    def _channel_reply(self, reply: bytes, refs: list):
        if not refs:
            return channel.Raw(reply)
        with self._lock:
            self._next_token += 1
            self._held[self._next_token] = (reply, refs)
            return HeldReply(self._next_token)

    def _get_direct(self, request: tuple):
        """A get from the local channel, on its connection's thread: answered here when it need
        not wait; a blocking get that finds no rows goes to the loop (`channel.LATER`), which
        waits for a put without holding this connection's later calls."""
        consumer, columns, count, indexes, get_n_samples, blocking, timeout, worker = _get_args(*request)
        dock = self._dock
        columns, idx = dock.checked_get(consumer, columns, count, indexes, get_n_samples, timeout)
        t_start = time.time()
        with dock._cond:
            got = dock.try_take(consumer, columns, count, idx, get_n_samples, raise_missing=not blocking)
            if got is None and blocking:
                return channel.LATER
            data, rows = dock.finish_get(consumer, columns, count, idx, got, t_start, worker=worker)
        refs: list = []
        reply = pickle.dumps(({c: reply_parts(cells, refs) for c, cells in data.items()}, rows),
                             protocol=pickle.HIGHEST_PROTOCOL)
        return self._channel_reply(reply, refs)

    async def take_held(self, token: int):
        """A get reply that the local channel could not carry (it names Ray objects)."""
        with self._lock:
            if token not in self._held:
                raise DockValueError(f"take_held: no reply held under token {token}: the dock was cleared after "
                                     "the get took its rows, which are then lost to that caller; fetch before clear()")
            return self._held.pop(token)

    async def _get(self, consumer: str, columns: Sequence[str], count: int, indexes: Sequence[int] | None = None,
                   get_n_samples: bool = False, blocking: bool = False, timeout: float | None = None,
                   worker: str | None = None):
        dock = self._dock
        columns, idx = dock.checked_get(consumer, columns, count, indexes, get_n_samples, timeout)
        t_start = time.time()
        deadline = t_start + (dock.default_timeout if timeout is None else float(timeout))
        while True:
            with dock._cond:  # the channel's threads take it too
                seen = self._puts
                got = dock.try_take(consumer, columns, count, idx, get_n_samples, raise_missing=not blocking)
            if got is not None or not blocking:
                break
            left = deadline - time.time()
            if left <= 0:
                with dock._cond:
                    dock.finish_get(consumer, columns, count, idx, None, t_start, timed_out=True, worker=worker)
            cond = self._condition()
            self._waiting += 1  # before the predicate is first checked: see _changed_now
            try:
                async with cond:
                    try:
                        await asyncio.wait_for(cond.wait_for(lambda: self._puts != seen), timeout=max(left, 0.0))
                    except asyncio.TimeoutError:
                        pass
            finally:
                self._waiting -= 1
        with dock._cond:
            return dock.finish_get(consumer, columns, count, idx, got, t_start, worker=worker)

    async def all_consumed(self, consumer: str) -> bool:
        return self._dock.all_consumed(consumer)

    async def clear(self) -> None:
        self._clear_now()
        await self._notify()

    async def retire(self, indexes) -> None:
        self._retire_now(indexes)
        await self._notify()

    def _retire_now(self, indexes) -> None:
        """Retire rows (dropped groups) and wake the waiting gets: their step's tail may have come."""
        with self._lock:
            self._dock.retire(indexes)
            self._changed_now()

    async def set_extent(self, rows: int) -> None:
        self._set_extent_now(rows)
        await self._notify()

    def _set_extent_now(self, rows: int) -> None:
        with self._lock:
            self._dock.set_extent(rows)
            self._changed_now()

    def _clear_now(self) -> None:
        with self._lock:
            self._dock.clear()
            self._held.clear()  # replies nobody fetched: let their objects go with the step
            if self._generation is not None:
                self._generation.bump()  # producers reuse their segments from offset 0
            self._changed_now()

    async def shm_info(self) -> dict | None:
        """Where producers find the generation counter, or None without shared memory."""
        if self._generation is None:
            return None
        return {"tag": self._generation.tag, "gen_path": self._generation.path,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def local_info(self) -> dict:
        """What same-node callers need: the shared-memory info and the local channel's socket
        (None for either that this dock does not have). Starts the channel at the first call."""
        node_id = ray.get_runtime_context().get_node_id()
        if self._channel is None and self._channel_path is not None:
            self._loop = asyncio.get_running_loop()
            try:
                self._channel = await channel.serve(self._channel_path, self._channel_handlers(),
                                                    self._channel_direct())
            except OSError as e:  # no socket here (another node without /dev/shm): Ray calls only
                warnings.warn(f"TransferDock: no local channel at {self._channel_path} ({e}); callers use "
                              "Ray calls", RuntimeWarning)
                self._channel_path = None
        claims = self._claims.info() if self._claims is not None and self._channel and self._dock.board else None
        return {"shm": await self.shm_info(),
                "channel": {"path": self._channel_path, "node_id": node_id} if self._channel else None,
                "claims": claims}

    def _channel_handlers(self) -> dict:
        """The methods the local channel serves: the same as by Ray, with puts and gets taking
        their payload unpickled (the channel pickled the frame already)."""
        handlers = {name: getattr(self, name) for name in (
            "noop", "all_consumed", "clear", "retire", "set_extent", "get_consumer_status", "get_column_status",
            "get_metrics", "get_event_log", "metrics_export_status", "state_dict", "load_state_dict", "layout")}
        handlers.update(put=self._put, get=self._channel_get)
        return handlers

    def _channel_direct(self) -> dict:
        """What the channel's connection threads answer themselves (each dock access under the
        dock's lock): the calls that never wait, and gets that need not. The rest (a get that
        must wait, state_dict, load_state_dict, layout, metrics_export_status) runs on the loop."""
        dock = self._dock
        return {"noop": _noop, "all_consumed": dock.all_consumed, "clear": self._clear_now,
                "retire": self._retire_now, "set_extent": self._set_extent_now,
                "get_consumer_status": dock.get_consumer_status, "get_column_status": dock.get_column_status,
                "get_metrics": dock.get_metrics, "get_event_log": dock.get_event_log,
                "put": self._put_direct, "get": self._get_direct}

    async def close(self) -> None:
        """Remove this dock's shared-memory files (the segments of every producer) and its
        channel's socket. Callers already connected keep their connection; new ones use Ray."""
        if self._claims is not None:
            self._dock.detach()  # local claims end: every get comes to the actor
        if self._channel is not None:
            self._channel.close()  # stops listening; open connections stay
        if self._channel_path is not None:
            try:
                os.unlink(self._channel_path)
            except FileNotFoundError:
                pass
            self._channel_path = None
        if self._generation is not None:
            self._generation.close()
            self._generation = None  # later shared-memory puts are refused, not leaked

    async def get_consumer_status(self) -> dict:
        return self._dock.get_consumer_status()

    async def get_column_status(self) -> dict:
        return self._dock.get_column_status()

    async def get_metrics(self) -> dict:
        return self._dock.get_metrics()

    async def get_event_log(self, since: int = 0) -> list[dict]:
        return self._dock.get_event_log(since)

    async def layout(self) -> dict:
        self._start_export()
        d = self._dock
        return {"columns": d.columns, "consumers": d.consumers, "prompts_num": d.prompts_num,
                "n_samples_per_prompt": d.n_samples_per_prompt, "capacity": d.capacity,
                "default_timeout": d.default_timeout}

    async def state_dict(self) -> dict:
        """The plain dock's state with every cell as a real row (referenced blocks are fetched)."""
        state = self._dock.state_dict()
        fetched: dict[int, ColumnBlock] = {}
        for column, cells in state["cells"].items():
            for cell in cells.values():
                src = cell.source
                if isinstance(src, RefBlock) and id(src) not in fetched:
                    fetched[id(src)] = (await src.ref)[src.column]
                elif isinstance(src, ShmBlock) and id(src) not in fetched:
                    fetched[id(src)] = shm.reader().block(src)
            for r, cell in list(cells.items()):
                block = fetched.get(id(cell.source), cell.source)
                cells[r] = unpack(block.take([cell.pos]))[0]
        return state

    async def load_state_dict(self, state: dict) -> None:
        kinds = self._dock.checked_state(state)  # the real rows, before they become cells: all or nothing
        state = dict(state)
        cells = {}
        for column, rows in state["cells"].items():
            if rows:
                order = sorted(rows)
                block = pack([rows[r] for r in order])
                cells[column] = dict(zip(order, _cells(block)))
            else:
                cells[column] = {}
        state["cells"] = cells
        with self._lock:
            self._dock.restore_state(state, kinds)
            self._changed_now()
        await self._notify()


def _noop() -> None:
    return None


def _get_args(consumer: str, columns: Sequence[str], count: int, indexes: Sequence[int] | None = None,
              get_n_samples: bool = False, blocking: bool = False, timeout: float | None = None,
              worker: str | None = None) -> tuple:
    """A get request's fields with `_get`'s defaults (a bad count of fields raises TypeError)."""
    return consumer, columns, count, indexes, get_n_samples, blocking, timeout, worker


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def remote_actor_class(num_cpus: float = 0.0):
    """The Ray actor class; async methods make Ray run it as an async actor."""
    return ray.remote(num_cpus=num_cpus, max_concurrency=1000)(TransferDockActor)
