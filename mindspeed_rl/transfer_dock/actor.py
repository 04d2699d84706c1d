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
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray

from .codec import ColumnBlock, pack, unpack
from .dock import TransferDock


@dataclass
class RefBlock:
    """A block that stayed in the producer's object store: the actor sees only sizes."""

    ref: list  # [ObjectRef]: a ref nested in a list is passed as a ref, not resolved
    numel: np.ndarray  # per row
    itemsize: int

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


def reply_parts(cells: Sequence[Cell]) -> list[tuple[list[int], Any, list[int]]]:
    """Group a column's cells by source: (output positions, inline block or [ref], source positions)."""
    groups: dict[int, tuple[Any, list[int], list[int]]] = {}
    for out_pos, cell in enumerate(cells):
        g = groups.setdefault(id(cell.source), (cell.source, [], []))
        g[1].append(out_pos)
        g[2].append(cell.pos)
    parts = []
    for source, out_pos, src_pos in groups.values():
        if isinstance(source, RefBlock):
            parts.append((out_pos, source.ref, src_pos))
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

    async def put(self, blocks: dict[str, ColumnBlock | RefBlock], indexes: Sequence[int],
                  overwrite: bool = False, producer: str | None = None) -> None:
        self._dock.put_cells({c: _cells(b) for c, b in blocks.items()}, indexes, overwrite=overwrite, producer=producer)
        await self._notify()

    async def get(self, consumer: str, columns: Sequence[str], count: int, indexes: Sequence[int] | None = None,
                  get_n_samples: bool = False, blocking: bool = False, timeout: float | None = None):
        dock = self._dock
        columns, idx = dock.checked_get(consumer, columns, count, indexes, get_n_samples)
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
            data, rows = dock.finish_get(consumer, columns, count, idx, got, t_start)
        return {c: reply_parts(cells) for c, cells in data.items()}, rows

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
                    fetched[id(src)] = await src.ref[0]
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
