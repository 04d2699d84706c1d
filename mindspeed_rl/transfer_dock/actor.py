"""The dock as a Ray actor: one `TransferDock` served to many workers at once.

It is an async actor: every call runs on one event loop, so the dock needs no lock contention,
and a blocking get awaits a put without holding a thread, so one stalled consumer never stalls
the others. Data comes in two forms (see `docs/transfer_dock.md` for the measurements behind it):
- inline: the rows travel in the call (`ColumnBlock`) and the actor keeps them;
- by reference: the producer `ray.put`s its block and the actor keeps only the `ObjectRef`, so the
  bytes go from the producer's object store straight to the consumer, once.
Workers use it through `TransferDockClient`, which picks the form by size.
"""
from __future__ import annotations

import asyncio
import pickle
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray

from .codec import ColumnBlock, pack, unpack
from .dock import TransferDock


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

    def __init__(self, source: ColumnBlock | RefBlock, pos: int, numel: int, nbytes: int):
        self.source, self.pos, self.numel, self.nbytes = source, pos, numel, nbytes

    def __len__(self) -> int:
        return self.numel


def _cells(block: ColumnBlock | RefBlock) -> list[Cell]:
    if isinstance(block, RefBlock):
        return [Cell(block, i, int(n), int(n) * block.itemsize) for i, n in enumerate(block.numel.tolist())]
    itemsize = block.flat.itemsize
    return [Cell(block, i, block.row_numel(i), block.row_numel(i) * itemsize) for i in range(len(block))]


def reply_parts(cells: Sequence[Cell], refs: list) -> list[tuple[list[int], Any, list[int] | None]]:
    """Group a column's cells by source: (output positions, inline block or ref slot, source positions).

    Referenced blocks are appended to `refs` (once each) and named by their slot in it.
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
        else:
            parts.append((out_pos, source.take(src_pos), None))
    return parts


class TransferDockActor:
    """Ray actor around one `TransferDock` (create it with `create_transfer_dock`)."""

    def __init__(self, columns: Sequence[str], consumers: Sequence[str], prompts_num: int,
                 n_samples_per_prompt: int = 1, **dock_kwargs: Any) -> None:
        self._dock = TransferDock(columns, consumers, prompts_num, n_samples_per_prompt, **dock_kwargs)
        self._puts = 0  # bumped by every put and clear; blocked gets wait for it to change
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the actor's event loop, at first use
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        self._puts += 1
        async with self._condition():
            self._condition().notify_all()

    async def noop(self) -> None:
        """An empty call: the floor any dock call is measured against."""

    # put and get take one pickled blob and answer one: each extra argument or reply object costs
    # Ray ~0.1-0.2 ms of serialization, as much as the dock's own work (docs/transfer_dock.md).
    async def put(self, blob: bytes, refs: list | None = None) -> None:
        blocks, indexes, overwrite, producer = pickle.loads(blob)
        for block in blocks.values():
            if isinstance(block, RefBlock):
                block.ref = refs[block.ref]
        kinds = {c: b.kind for c, b in blocks.items()}
        self._dock.put_cells({c: _cells(b) for c, b in blocks.items()}, indexes, overwrite=overwrite,
                             producer=producer, kinds=kinds)
        await self._notify()

    async def get(self, blob: bytes):
        """Answers the pickled `(parts_by_column, rows)`, with the list of refs they name if any."""
        data, rows = await self._get(*pickle.loads(blob))
        refs: list = []
        reply = pickle.dumps(({c: reply_parts(cells, refs) for c, cells in data.items()}, rows),
                             protocol=pickle.HIGHEST_PROTOCOL)
        return (reply, refs) if refs else reply

    async def _get(self, consumer: str, columns: Sequence[str], count: int, indexes: Sequence[int] | None = None,
                   get_n_samples: bool = False, blocking: bool = False, timeout: float | None = None):
        dock = self._dock
        columns, idx = dock.checked_get(consumer, columns, count, indexes, get_n_samples, timeout)
        t_start = time.time()
        deadline = t_start + (dock.default_timeout if timeout is None else float(timeout))
        while True:
            seen = self._puts
            with dock._cond:  # uncontended: every call runs on this one event loop
                got = dock.try_take(consumer, columns, count, idx, get_n_samples, raise_missing=not blocking)
            if got is not None or not blocking:
                break
            left = deadline - time.time()
            if left <= 0:
                with dock._cond:
                    dock.finish_get(consumer, columns, count, idx, None, t_start, timed_out=True)
            cond = self._condition()
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait_for(lambda: self._puts != seen), timeout=max(left, 0.0))
                except asyncio.TimeoutError:
                    pass
        with dock._cond:
            return dock.finish_get(consumer, columns, count, idx, got, t_start)

    async def all_consumed(self, consumer: str) -> bool:
        return self._dock.all_consumed(consumer)

    async def clear(self) -> None:
        self._dock.clear()
        await self._notify()

    async def get_consumer_status(self) -> dict:
        return self._dock.get_consumer_status()

    async def get_column_status(self) -> dict:
        return self._dock.get_column_status()

    async def get_metrics(self) -> dict:
        return self._dock.get_metrics()

    async def get_event_log(self, since: int = 0) -> list[dict]:
        return self._dock.get_event_log(since)

    async def layout(self) -> dict:
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
            for r, cell in list(cells.items()):
                block = fetched.get(id(cell.source), cell.source)
                cells[r] = unpack(block.take([cell.pos]))[0]
        return state

    async def load_state_dict(self, state: dict) -> None:
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
        self._dock.load_state_dict(state)
        await self._notify()


def remote_actor_class(num_cpus: float = 0.0):
    """The Ray actor class; async methods make Ray run it as an async actor."""
    return ray.remote(num_cpus=num_cpus, max_concurrency=1000)(TransferDockActor)
