"""`TransferDockClient`: the dock's methods, for workers in other processes.

The client validates rows where they are made (a bad put fails in the caller, not in the actor),
packs each column into one flat buffer, and sends it inline when small. A large column
(`inline_bytes`) is copied once by the producer, into shared memory when the producer is on the
dock's node (`shm.py`) or into Ray's object store otherwise, and read zero-copy by the consumer;
the dock sees only its descriptor. On the dock's node, calls go over the dock's local channel
(`channel.py`, a Unix socket: ~0.05 ms against ~1 ms for a Ray actor call); elsewhere, and for
puts that carry Ray object references, as Ray actor calls. Every call has a timeout: a dead or
stuck dock raises instead of hanging a worker.
"""
from __future__ import annotations

import os
import pickle
import threading
import uuid
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import ray

from . import channel, claims, shm
from .actor import HeldReply, RefBlock, remote_actor_class
from .codec import ColumnBlock, pack, unpack
from .shm import ShmBlock
from .rows import checked_index_list, checked_rows
from .errors import DockError, DockValueError

# Columns whose packed size is at least this go by reference. Chosen by benchmarks/dock_throughput.py
# (see docs/transfer_dock.md): below it, the extra ray.put costs more than copying through the actor.
DEFAULT_INLINE_BYTES = 256 * 1024
DATA_PLANES = ("auto", "shm", "ray")
# Slack on top of a blocking get's own timeout before the client gives up on the actor itself.
CALL_SLACK_S = 30.0


class TransferDockClient:
    """Picklable handle to a dock actor; pass it to workers.

    `worker` labels this process's puts and gets in the dock's event log (e.g. "actor/0"), so a
    timeline can draw one lane per stage and worker; set it on the copy a worker received.
    """

    def __init__(self, actor: Any, default_timeout: float, inline_bytes: int = DEFAULT_INLINE_BYTES,
                 call_timeout: float = 300.0, max_pending_puts: int = 8, shm_info: dict | None = None,
                 worker: str | None = None, channel_info: dict | None = None,
                 claims_info: dict | None = None) -> None:
        self.actor = actor
        self.worker = worker
        self.shm_info = shm_info  # None: large columns go by Ray object reference
        self.channel_info = channel_info  # None: every call is a Ray actor call
        self.claims_info = claims_info  # None: every get goes to the dock actor (no local claims)
        self.default_timeout = default_timeout
        self.inline_bytes = inline_bytes
        self.call_timeout = call_timeout
        self.max_pending_puts = max_pending_puts
        self._local = threading.local()  # per thread: puts sent with wait=False, answer not checked yet

    @property
    def _pending(self) -> list:
        """This thread's unchecked puts, as `("channel", (connection, rid))` or `("ray", ref)`:
        stages sharing a worker (threads) each flush their own."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending

    @property
    def data_plane(self) -> str:
        return "shm" if self.shm_info else "ray"

    def _arena(self):
        """This process's shared-memory arena for the dock, or None off the dock's node."""
        info = self.shm_info
        if info is None or _this_node_id() != info["node_id"]:
            return None
        return shm.arena_for(info["tag"], info["gen_path"], info["node_id"])

    def _connection(self) -> channel.Connection | None:
        """This thread's connection to the dock's local channel; None off the dock's node, without
        a channel, or if it cannot be reached (then every call of this thread goes through Ray)."""
        info, pid = self.channel_info, os.getpid()
        # (the info and process it was made for, connection or False); a forked child makes its
        # own, or two processes would read one socket's answers
        cached = getattr(self._local, "conn", None)
        if cached is None or cached[0] is not info or cached[1] != pid:
            conn = False
            if info is not None and info.get("path") and _this_node_id() == info["node_id"]:
                try:
                    conn = channel.Connection(info["path"])
                except OSError as e:  # closed dock, or a socket we may not open: Ray calls work too
                    _warn_once(f"TransferDock: local channel {info['path']} unreachable ({e}); "
                               "calling the dock through Ray")
            cached = self._local.conn = (info, pid, conn)
        return cached[2] or None

    def _claim(self, consumer: str, columns: list[str], count: Any, timeout: Any,
               copy: bool) -> tuple[dict, list[int]] | None:
        """Take the rows in shared memory, without a call to the dock (`claims.py`), or None
        when this get must go to the dock: off its node, a count or timeout the dock would refuse
        (it raises the error), too few rows ready, the step's tail."""
        info = self.claims_info
        if (not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count <= 0
                or (timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                                 and 0 <= timeout < float("inf")))):
            return None
        if _this_node_id() != info["node_id"]:
            return None
        claimer = claims.client_for(info)
        if claimer is None:
            return None
        self._check_pending()  # an earlier pipelined put's error, as any later call raises it
        return claimer.claim(consumer, columns, int(count), self.worker, copy)

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

    def _call(self, method: str, *args: Any, timeout: float | None = None):
        """Call a dock method: over the local channel when this thread has one, else through Ray."""
        timeout = self.call_timeout if timeout is None else timeout
        conn = self._connection()
        if conn is not None:
            self._check_pending(before="channel")
            return conn.result(conn.send(method, args), timeout, what=f"{method}()")
        self._check_pending(before="ray")
        return self._unwrap(ray.get, getattr(self.actor, method).remote(*args), timeout=timeout)

    def _check_pending(self, wait_all: bool = False, before: str | None = None, keep_newest: bool = False) -> None:
        """Raise the error of an earlier `wait=False` put, if one failed; keep at most
        `max_pending_puts` in flight.

        `before` names the path of the call about to be sent ("channel" or "ray"). Each path keeps
        a caller's calls in order, but the two paths do not keep order with each other, so puts
        pending on the other path are waited for first. A channel answer is looked at whenever it
        has come (a `select`, a few microseconds); a Ray answer only once half of
        `max_pending_puts` are pending (each look is a `ray.wait`, ~0.3 ms). `keep_newest`: the
        put just sent is not looked at (its error belongs to a later call or `flush()`, as documented,
        however fast the dock answered)."""
        pending = self._pending
        if not pending:
            return
        if before is not None and any(path != before for path, _ in pending):
            wait_all = True
        if not wait_all and pending[0][0] == "ray" and len(pending) < max(1, self.max_pending_puts // 2):
            return
        while pending:
            if keep_newest and len(pending) == 1:
                return
            path, handle = pending[0]
            must = wait_all or len(pending) > self.max_pending_puts
            if path == "channel":
                conn, rid = handle
                if not must and not conn.done(rid):
                    return
                pending.pop(0)
                conn.result(rid, self.call_timeout, what="put_experience()")  # raises the put's error
                continue
            done, _ = ray.wait([handle], timeout=self.call_timeout if must else 0)
            if not done:
                if must:
                    raise TimeoutError(f"TransferDockClient: a put got no answer from the dock in "
                                       f"{self.call_timeout:.0f} s; the dock actor is stuck or dead")
                return
            pending.pop(0)
            self._unwrap(ray.get, done[0])

    def flush(self) -> None:
        """Wait until every put sent with `wait=False` is stored; raise the first one's error."""
        self._check_pending(wait_all=True)

    def put_experience(self, data: Mapping[str, Sequence[Any]], indexes: Sequence[int], *,
                       overwrite: bool = False, producer: str | None = None, wait: bool = True) -> None:
        """As `TransferDock.put_experience`, from another process.

        `wait=False` sends the put without waiting for the dock's answer (one round trip less
        per micro-batch; in order with this client's later calls). An error the dock finds (a cell
        written twice) is then raised by a later call of this client (once `max_pending_puts // 2`
        puts are pending) or by `flush()`; the bad put itself changes nothing in the dock. Call
        `flush()` before telling another process the rows are in.
        """
        if not isinstance(data, Mapping) or not data:
            raise DockValueError(f"put_experience: data must be a non-empty dict column -> values, got {type(data).__name__}")
        # the caller's own object (a set is refused, not listed), before any bytes are written
        idx = checked_index_list("put_experience", indexes)
        blocks: dict[str, ColumnBlock | RefBlock | ShmBlock] = {}
        large: dict[str, ColumnBlock] = {}
        arena = None
        for column, values in data.items():
            block = pack(checked_rows(column, values))
            if block.nbytes < self.inline_bytes:
                blocks[column] = block
                continue
            arena = arena or self._arena()
            if arena is not None:
                try:
                    blocks[column] = arena.write(block)
                    continue
                except OSError as e:  # /dev/shm full: this column goes through Ray's store instead
                    _warn_once(f"TransferDock: shared memory unavailable ({e}); large columns go as Ray objects")
            large[column] = block
            blocks[column] = RefBlock(0, column, np.diff(block.offsets), block.flat.itemsize, block.kind)
        # One object for all large columns: every ref passed through the dock costs Ray a
        # borrower registration (~1 ms), so a put pays it once, not once per column.
        refs = [ray.put(large)] if large else []
        payload = (blocks, idx, overwrite, producer, self.worker)
        conn = None if refs else self._connection()  # refs must travel in a Ray call
        if conn is not None:
            self._check_pending(before="channel")
            entry = ("channel", (conn, conn.send("put", (payload,))))
        else:
            self._check_pending(before="ray")
            blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            entry = ("ray", self.actor.put.remote(blob, refs) if refs else self.actor.put.remote(blob))
        self._pending.append(entry)
        if wait:
            self._check_pending(wait_all=True)
        else:
            self._check_pending(keep_newest=True)

    def get_experience(self, consumer: str, columns: Sequence[str], count: int,
                       indexes: Sequence[int] | None = None, get_n_samples: bool = False,
                       blocking: bool = False, timeout: float | None = None,
                       copy: bool = True) -> tuple[dict[str, list], list[int]]:
        """As `TransferDock.get_experience`. Each column's rows share one private, writable buffer.
        `copy=False` skips that copy: rows are then views of Ray's object store that other
        consumers read too, so writing to them corrupts their data; use it only where the rows are
        collated into a new batch at once."""
        return self.get_experience_async(consumer, columns, count, indexes, get_n_samples, blocking, timeout,
                                         copy).result()

    def get_experience_async(self, consumer: str, columns: Sequence[str], count: int,
                             indexes: Sequence[int] | None = None, get_n_samples: bool = False,
                             blocking: bool = False, timeout: float | None = None,
                             copy: bool = True) -> "PendingGet":
        """Send a get now and collect its rows later with `.result()`; arguments as `get_experience`.

        Why: a get is a round trip to the dock actor (0.1-0.5 ms over the local channel, 1.5-4 ms
        as a Ray call, on a loaded 2-core machine); a consumer that sends its next get before it uses the
        current rows (`run_stage_loop` does) overlaps the round trip with its work. The answer waits
        in the socket (or in Ray), holding no Python thread, until `result()`. The rows are taken
        when the dock answers, as with `get_experience`; a blocking get's `timeout` counts from
        when it was sent."""
        if indexes is not None:  # the caller's object: a set is refused, not listed
            indexes = checked_index_list("get_experience", indexes)
        columns = [columns] if isinstance(columns, str) else list(columns)
        if indexes is None and not get_n_samples and self.claims_info is not None:
            got = self._claim(consumer, columns, count, timeout, copy)
            if got is not None:
                return ClaimedGet(self, got)
        wait = (self.default_timeout if timeout is None else timeout) if blocking else 0.0
        request = (consumer, columns, count, indexes, get_n_samples, blocking, timeout, self.worker)
        limit = self.call_timeout + wait + CALL_SLACK_S
        conn = self._connection()
        if conn is not None:
            self._check_pending(before="channel")
            return PendingGet(self, ("channel", (conn, conn.send("get", (request,)))), limit, copy)
        self._check_pending(before="ray")
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        off_node = self.shm_info is not None and _this_node_id() != self.shm_info["node_id"]
        return PendingGet(self, ("ray", self.actor.get.remote(blob, off_node)), limit, copy)

    def all_consumed(self, consumer: str) -> bool:
        return self._call("all_consumed", consumer)

    def clear(self) -> None:
        self._call("clear")

    def retire(self, indexes: Sequence[int]) -> None:
        """As `TransferDock.retire`: whole prompt groups out of the step for every consumer."""
        self._call("retire", checked_index_list("retire", indexes))  # the caller's own object: a set is refused

    def set_extent(self, rows: int) -> None:
        """As `TransferDock.set_extent`: rows 0 .. rows-1 are in the (growing) step so far."""
        self._call("set_extent", rows)

    def get_consumer_status(self) -> dict:
        return self._call("get_consumer_status")

    def get_column_status(self) -> dict:
        return self._call("get_column_status")

    def get_metrics(self) -> dict[str, float]:
        return self._call("get_metrics")

    def get_event_log(self, since: int = 0) -> list[dict]:
        return self._call("get_event_log", since)

    def metrics_export_status(self) -> dict:
        """What the dock last handed to `ray.util.metrics` (see `metrics.RayMetricsExport`)."""
        return self._call("metrics_export_status")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def layout(self) -> dict:
        return self._call("layout")

    def noop(self) -> None:
        self._call("noop")

    def close(self) -> None:
        """Free the dock's shared memory (call before killing the actor; the actor stays usable
        for data that went inline or by reference). If the actor is already dead, a client on its
        node removes the files itself; otherwise the next dock made on that node does."""
        if self.shm_info is None and self.channel_info is None:
            return
        self._pending.clear()  # answers nobody will read: the dock refuses such puts after close
        try:
            self._unwrap(ray.get, self.actor.close.remote(), timeout=10.0)
        except (ray.exceptions.RayError, TimeoutError):
            if self.shm_info and _this_node_id() == self.shm_info["node_id"]:
                shm.remove_dock_files(self.shm_info["tag"])
            if self.channel_info and _this_node_id() == self.channel_info["node_id"]:
                try:
                    os.unlink(self.channel_info["path"])
                except OSError:
                    pass


class ClaimedGet:
    """A get answered by a local claim (`claims.py`): its rows are already here."""

    def __init__(self, client: TransferDockClient, got: tuple[dict, list[int]]) -> None:
        self._client, self._got = client, got

    def result(self) -> tuple[dict[str, list], list[int]]:
        self._client._check_pending()
        return self._got


class PendingGet:
    """A get in flight (`TransferDockClient.get_experience_async`); `result()` waits for its rows."""

    def __init__(self, client: TransferDockClient, sent: tuple[str, Any], timeout: float, copy: bool) -> None:
        self._client, self._sent, self._timeout, self._copy = client, sent, timeout, copy

    def result(self) -> tuple[dict[str, list], list[int]]:
        """`(data, rows)` as `get_experience` returns them; raises the dock's error (a timeout too)."""
        client, (path, handle) = self._client, self._sent
        client._check_pending()
        if path == "channel":
            conn, rid = handle
            reply = conn.result(rid, self._timeout, what="get_experience()")
            if isinstance(reply, HeldReply):  # its rows name Ray objects: fetch it through Ray
                reply = client._unwrap(ray.get, client.actor.take_held.remote(reply.token),
                                       timeout=client.call_timeout)
        else:
            reply = client._unwrap(ray.get, handle, timeout=self._timeout)
        reply, refs = (reply, []) if isinstance(reply, (bytes, bytearray)) else reply
        parts_by_column, rows = pickle.loads(reply)
        return assemble(parts_by_column, len(rows), refs, self._copy), rows


_node_id: str | None = None
_warned: set[str] = set()


def _this_node_id() -> str:
    global _node_id
    if _node_id is None:
        _node_id = ray.get_runtime_context().get_node_id()
    return _node_id


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def assemble(parts_by_column: dict[str, list], n_rows: int, refs: list, copy: bool = True) -> dict[str, list]:
    """Rebuild each column's rows, in the order handed out, from inline blocks and referenced ones."""
    fetched = ray.get(refs) if refs else []
    out: dict[str, list] = {}
    for column, parts in parts_by_column.items():
        if len(parts) == 1 and parts[0][0] == list(range(n_rows)):  # the common case: one source
            out[column] = _source_rows(parts[0][1], parts[0][2], fetched, copy)
            continue
        rows: list = [None] * n_rows
        for out_pos, source, src_pos in parts:
            for p, value in zip(out_pos, _source_rows(source, src_pos, fetched, copy)):
                rows[p] = value
        out[column] = rows
    return out


def _source_rows(source, src_pos, fetched: list, copy: bool) -> list:
    """Rows `src_pos` of one source, in that order, copied at most once."""
    if src_pos is None:  # inline: the reply carries exactly these rows
        return unpack(source, copy)
    if isinstance(source, ShmBlock) and not copy:  # zero-copy views of the segment, cut at once
        views = shm.reader().rows(source)
        return views if list(src_pos) == list(range(len(views))) else [views[p] for p in src_pos]
    block = shm.reader().block(source) if isinstance(source, ShmBlock) else fetched[source[0]][source[1]]
    if list(src_pos) == list(range(len(block))):
        return unpack(block, copy)
    if copy:  # take() gathers the rows into one new private buffer: that is the copy
        return unpack(block.take(src_pos), copy=False)
    views = unpack(block, copy=False)  # zero-copy: pick the row views, whatever their order
    return [views[p] for p in src_pos]


def create_transfer_dock(columns: Sequence[str], consumers: Sequence[str], prompts_num: int,
                         n_samples_per_prompt: int = 1, *, name: str | None = None, num_cpus: float = 0.0,
                         inline_bytes: int = DEFAULT_INLINE_BYTES, data_plane: str = "auto",
                         local_channel: bool = True, local_claims: bool = True,
                         **dock_kwargs: Any) -> TransferDockClient:
    """Start a dock actor (Ray must be initialised) and return a client for it.

    `num_cpus` defaults to 0: the dock moves metadata and waits, it does not compute, and on a
    2-core machine a whole CPU for it would starve the workers.

    `data_plane` says how columns of `inline_bytes` or more travel: `"shm"` through shared memory
    between callers on the dock's node, `"ray"` as Ray object references, `"auto"` (default) shared
    memory where `/dev/shm` is writable. Which path a call takes is decided per call, from where the
    caller runs, so workers may land on any node and a cluster may grow: with shared memory, a
    producer on another node puts Ray objects, and a consumer on another node gets the rows that
    are in shared memory as bytes read by the dock (which runs on the node that wrote them). Call
    `client.close()` when done, to free the shared memory.

    `local_channel` (default True, where `/dev/shm` is writable): callers on the dock's node call
    it over a Unix socket instead of through Ray (`channel.py`); False makes every call a Ray call.

    `local_claims` (default True; only with shared memory and the local channel): consumers on
    the dock's node take ready rows themselves, in shared memory, without a call to the dock
    (`claims.py`); False sends every get to the dock actor.

    `metrics_interval_s` (default 1.0; 0: off), among `dock_kwargs`, is how often the actor hands
    its counters to `ray.util.metrics` for Prometheus (see `metrics.RayMetricsExport`).
    """
    if data_plane not in DATA_PLANES:
        raise DockValueError(f"create_transfer_dock: data_plane={data_plane!r}; use one of {', '.join(DATA_PLANES)}")
    use_shm = shm.available() and data_plane in ("shm", "auto")
    if data_plane == "shm" and not use_shm:
        raise DockValueError(f"create_transfer_dock: data_plane='shm' needs a writable {shm.SHM_DIR}; "
                             "use data_plane='ray' (or 'auto') on this machine")
    use_channel = bool(local_channel) and shm.available()
    tag = None
    if use_shm or use_channel:
        shm.remove_stale_files()
        tag = f"{os.getpid()}x{uuid.uuid4().hex[:10]}"
    cls = remote_actor_class(num_cpus)
    options = {"name": name} if name else {}
    # on the caller's node, never elsewhere: its shared memory and local channel are made for the caller's node
    # (a dock asking for no CPU would otherwise land on any node of a cluster)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                    soft=False)
    actor = cls.options(**options).remote(columns, consumers, prompts_num, n_samples_per_prompt,
                                          shm_tag=tag if use_shm else None,
                                          channel_tag=tag if use_channel else None,
                                          local_claims=bool(local_claims and use_shm and use_channel), **dock_kwargs)
    client = TransferDockClient(actor, default_timeout=float(dock_kwargs.get("default_timeout", 600.0)),
                                inline_bytes=inline_bytes)
    client.layout()  # fail here, with the dock's own error, if its arguments are bad
    info = client._call("local_info")
    client.shm_info, client.channel_info, client.claims_info = info["shm"], info["channel"], info.get("claims")
    return client
