"""`TransferDockClient`: the dock's methods, for workers in other processes.

The client validates rows where they are made (a bad put fails in the caller, not in the actor),
packs each column into one flat buffer, and sends it inline when small or as an object-store
reference when large (`inline_bytes`), so big tensors are copied into the store once by the
producer and read zero-copy by the consumer. Every call has a timeout: a dead or stuck dock
raises instead of hanging a worker.
"""
from __future__ import annotations

import pickle
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import ray

from .actor import RefBlock, remote_actor_class
from .codec import ColumnBlock, pack, unpack
from .dock import checked_rows
from .errors import DockError, DockValueError

# Columns whose packed size is at least this go by reference. Chosen by benchmarks/dock_throughput.py
# (see docs/transfer_dock.md): below it, the extra ray.put costs more than copying through the actor.
DEFAULT_INLINE_BYTES = 256 * 1024
# Slack on top of a blocking get's own timeout before the client gives up on the actor itself.
CALL_SLACK_S = 30.0


class TransferDockClient:
    """Picklable handle to a dock actor; pass it to workers."""

    def __init__(self, actor: Any, default_timeout: float, inline_bytes: int = DEFAULT_INLINE_BYTES,
                 call_timeout: float = 300.0, max_pending_puts: int = 8) -> None:
        self.actor = actor
        self.default_timeout = default_timeout
        self.inline_bytes = inline_bytes
        self.call_timeout = call_timeout
        self.max_pending_puts = max_pending_puts
        self._local = threading.local()  # per thread: puts sent with wait=False, answer not checked yet

    @property
    def _pending(self) -> list:
        """This thread's unchecked puts: stages sharing a worker (threads) each flush their own."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending

    def __getstate__(self) -> dict:  # a copy sent to another process starts with nothing pending
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @staticmethod
    def _unwrap(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, DockError):  # the dock's own message says it all
                raise e.cause from None
            raise

    def _call(self, ref, timeout: float | None = None):
        self._check_pending()
        return self._unwrap(ray.get, ref, timeout=self.call_timeout if timeout is None else timeout)

    def _check_pending(self, wait_all: bool = False) -> None:
        """Raise the error of an earlier `wait=False` put, if one failed; keep at most
        `max_pending_puts` in flight."""
        while self._pending:
            must = wait_all or len(self._pending) > self.max_pending_puts
            done, _ = ray.wait(self._pending[:1], timeout=self.call_timeout if must else 0)
            if not done:
                if must:
                    raise TimeoutError(f"TransferDockClient: a put got no answer from the dock in "
                                       f"{self.call_timeout:.0f} s; the dock actor is stuck or dead")
                return
            self._pending.pop(0)
            self._unwrap(ray.get, done[0])

    def flush(self) -> None:
        """Wait until every put sent with `wait=False` is stored; raise the first one's error."""
        self._check_pending(wait_all=True)

    def put_experience(self, data: Mapping[str, Sequence[Any]], indexes: Sequence[int], *,
                       overwrite: bool = False, producer: str | None = None, wait: bool = True) -> None:
        """As `TransferDock.put_experience`, from another process.

        `wait=False` sends the put without waiting for the dock's answer (one round trip less
        per micro-batch; in order with this client's later calls). An error the dock finds (a cell
        written twice) is then raised by this client's next call or `flush()`; the bad put itself
        changes nothing in the dock. Call `flush()` before telling another process the rows are in.
        """
        if not isinstance(data, Mapping) or not data:
            raise DockValueError(f"put_experience: data must be a non-empty dict column -> values, got {type(data).__name__}")
        blocks: dict[str, ColumnBlock | RefBlock] = {}
        large: dict[str, ColumnBlock] = {}
        for column, values in data.items():
            block = pack(checked_rows(column, values))
            if block.nbytes >= self.inline_bytes:
                large[column] = block
                blocks[column] = RefBlock(0, column, np.diff(block.offsets), block.flat.itemsize, block.kind)
            else:
                blocks[column] = block
        # One object for all large columns: every ref passed through the dock costs Ray a
        # borrower registration (~1 ms), so a put pays it once, not once per column.
        refs = [ray.put(large)] if large else []
        idx = indexes.tolist() if hasattr(indexes, "tolist") else list(indexes)
        blob = pickle.dumps((blocks, idx, overwrite, producer), protocol=pickle.HIGHEST_PROTOCOL)
        ref = self.actor.put.remote(blob, refs) if refs else self.actor.put.remote(blob)
        if wait:
            self._call(ref)
        else:
            self._pending.append(ref)
            self._check_pending()

    def get_experience(self, consumer: str, columns: Sequence[str], count: int,
                       indexes: Sequence[int] | None = None, get_n_samples: bool = False,
                       blocking: bool = False, timeout: float | None = None,
                       copy: bool = True) -> tuple[dict[str, list], list[int]]:
        """As `TransferDock.get_experience`. Each column's rows share one private, writable buffer.
        `copy=False` skips that copy: rows are then views of Ray's object store that other
        consumers read too, so writing to them corrupts their data; use it only where the rows are
        collated into a new batch at once."""
        if indexes is not None and hasattr(indexes, "tolist"):
            indexes = indexes.tolist()
        columns = [columns] if isinstance(columns, str) else list(columns)
        wait = (self.default_timeout if timeout is None else timeout) if blocking else 0.0
        blob = pickle.dumps((consumer, columns, count, indexes, get_n_samples, blocking, timeout),
                            protocol=pickle.HIGHEST_PROTOCOL)
        reply = self._call(self.actor.get.remote(blob), timeout=self.call_timeout + wait + CALL_SLACK_S)
        reply, refs = (reply, []) if isinstance(reply, bytes) else reply
        parts_by_column, rows = pickle.loads(reply)
        return assemble(parts_by_column, len(rows), refs, copy), rows

    def all_consumed(self, consumer: str) -> bool:
        return self._call(self.actor.all_consumed.remote(consumer))

    def clear(self) -> None:
        self._call(self.actor.clear.remote())

    def get_consumer_status(self) -> dict:
        return self._call(self.actor.get_consumer_status.remote())

    def get_column_status(self) -> dict:
        return self._call(self.actor.get_column_status.remote())

    def get_metrics(self) -> dict[str, float]:
        return self._call(self.actor.get_metrics.remote())

    def get_event_log(self, since: int = 0) -> list[dict]:
        return self._call(self.actor.get_event_log.remote(since))

    def state_dict(self) -> dict:
        return self._call(self.actor.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        self._call(self.actor.load_state_dict.remote(state))

    def layout(self) -> dict:
        return self._call(self.actor.layout.remote())

    def noop(self) -> None:
        self._call(self.actor.noop.remote())


def assemble(parts_by_column: dict[str, list], n_rows: int, refs: list, copy: bool = True) -> dict[str, list]:
    """Rebuild each column's rows, in the order handed out, from inline blocks and referenced ones."""
    fetched = ray.get(refs) if refs else []
    out: dict[str, list] = {}
    for column, parts in parts_by_column.items():
        if len(parts) == 1 and parts[0][0] == list(range(n_rows)):  # the common case: one source, in order
            out_pos, source, src_pos = parts[0]
            block = source if src_pos is None else fetched[source[0]][source[1]].take(src_pos)
            out[column] = unpack(block, copy)
            continue
        rows: list = [None] * n_rows
        for out_pos, source, src_pos in parts:
            block = source if src_pos is None else fetched[source[0]][source[1]].take(src_pos)
            for p, value in zip(out_pos, unpack(block, copy)):
                rows[p] = value
        out[column] = rows
    return out


def create_transfer_dock(columns: Sequence[str], consumers: Sequence[str], prompts_num: int,
                         n_samples_per_prompt: int = 1, *, name: str | None = None, num_cpus: float = 0.0,
                         inline_bytes: int = DEFAULT_INLINE_BYTES, **dock_kwargs: Any) -> TransferDockClient:
    """Start a dock actor (Ray must be initialised) and return a client for it.

    `num_cpus` defaults to 0: the dock moves metadata and waits, it does not compute, and on a
    2-core machine a whole CPU for it would starve the workers.
    """
    cls = remote_actor_class(num_cpus)
    options = {"name": name} if name else {}
    actor = cls.options(**options).remote(columns, consumers, prompts_num, n_samples_per_prompt, **dock_kwargs)
    client = TransferDockClient(actor, default_timeout=float(dock_kwargs.get("default_timeout", 600.0)),
                                inline_bytes=inline_bytes)
    client.layout()  # fail here, with the dock's own error, if its arguments are bad
    return client
