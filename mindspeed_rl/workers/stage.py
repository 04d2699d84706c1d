"""The pull-compute-push loop every MFC runs against the dock.

A stage keeps no rows between pulls: it takes a micro-batch whose input columns are ready, computes,
pushes the outputs back, and stops when the dock says it has taken every row of the step. The
dock's round trips stay off the compute's path where they can: the next micro-batch's get is sent
before the current one is computed, and a put does not wait for the dock's answer. Each wait is
bounded by the stage timeout and a timeout names the stage, its columns and what is missing (the
dock's own message).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..device.host_memory import peak_resident_bytes
from ..transfer_dock.errors import DockTimeoutError
from .cores import CoreShare


class StageError(RuntimeError):
    """A stage failed; the message starts with the stage name."""


class StageTimeout(StageError):
    """A stage waited `timeout_s` for its inputs. It is only the stage that noticed: the driver reads
    `stage` and `input_keys` to find, from the graph and the dock, the stage that is late."""

    def __init__(self, message: str, *, stage: str = "", rank: int = 0, step: int = 0,
                 input_keys: tuple[str, ...] = ()):
        super().__init__(message)
        # kept through Ray's pickling: BaseException pickles its args and its __dict__
        self.stage, self.rank, self.step, self.input_keys = stage, rank, step, tuple(input_keys)


MAX_SAMPLES = 512  # rows of text a stage report carries at most (a validation's; a step keeps a few)


@dataclass
class StageReport:
    stage: str
    rank: int
    step: int
    rows: int = 0
    micro_batches: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    get_s: float = 0.0
    compute_s: float = 0.0
    put_s: float = 0.0
    peak_rss_bytes: int = 0   # the worker process's peak resident memory at the stage's end
    rss_bytes: int = 0        # its resident memory after the stage, once freed memory went back to the kernel
    metrics: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)   # rows as text (a rule reward's), at most MAX_SAMPLES
    # per micro-batch, in order: the get's wall time (waiting for inputs included) and the put's (sending it;
    # the final flush is only in put_s). benchmarks/pipeline_efficiency.py reads the handoff overhead here.
    mb_get_s: list = field(default_factory=list)
    mb_put_s: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def micro_batches(dock, *, stage: str, rank: int, step: int, input_keys, count: int, get_n_samples: bool,
                  timeout_s: float, report: StageReport, max_rows: int | None = None,
                  prefetch: bool = True) -> Iterator[tuple[dict, list[int]]]:
    """The micro-batches consumer `stage` takes from the dock, `count` rows each, until the step is
    consumed (or `max_rows` are taken: a DP rank that owns a fixed share of rows).

    A generator, so a stage loop and a train engine's `train_step` consume it alike. It counts the
    get time into `report` and, when resumed, the rows and micro-batch just handed out (so
    `report.rows` counts rows whose compute is done).

    `prefetch` (with a dock client, which has `get_experience_async`): the get of the next
    micro-batch is sent before the current one is computed, so its round trip to the dock (0.1-0.5
    ms over the local channel, 1.5-5 ms as a Ray call from another node, on a loaded 2-core
    machine) overlaps the compute. It holds at most one micro-batch ahead. No thread does it: the
    answer waits in the socket (or in Ray) until the loop asks for it, so nothing competes with the
    compute for the GIL (helper threads did, and slowed CPU-bound stages; docs/benchmarks.md). A
    prefetched get that timed out while the loop computed is sent again with what is left of
    `timeout_s`, so the stage times out only once it has itself waited that long for its inputs.
    """
    rep = report
    rep.t_start = rep.t_start or time.time()
    keys = list(input_keys)
    send = getattr(dock, "get_experience_async", None) if prefetch else None

    def get(want: int, timeout: float):
        try:
            return dock.get_experience(stage, keys, want, get_n_samples=get_n_samples, blocking=True,
                                       timeout=max(0.0, timeout), copy=False)
        except DockTimeoutError as e:
            raise StageTimeout(f"stage '{stage}' (rank {rank}, step {step}) timed out after {timeout_s:.0f} s "
                               f"waiting for its inputs {keys}: {e}", stage=stage, rank=rank, step=step,
                               input_keys=tuple(keys)) from None

    def wanted(taken: int) -> int:
        return count if max_rows is None else min(count, max_rows - taken)

    pending, pending_want = None, 0  # the next micro-batch's get, in flight
    while max_rows is None or rep.rows < max_rows:
        t0 = time.perf_counter()
        if pending is None:
            batch, rows = get(wanted(rep.rows), timeout_s)
        else:
            try:
                batch, rows = pending.result()
            except DockTimeoutError:  # it timed out while we computed: ask again for the time left
                batch, rows = get(pending_want, timeout_s - (time.perf_counter() - t0))
            pending = None
        if rows and send is not None and (max_rows is None or rep.rows + len(rows) < max_rows):
            pending_want = wanted(rep.rows + len(rows))
            pending = send(stage, keys, pending_want, get_n_samples=get_n_samples, blocking=True,
                           timeout=timeout_s, copy=False)
        t1 = time.perf_counter()
        rep.get_s += t1 - t0
        rep.mb_get_s.append(t1 - t0)
        if not rows:
            rep.mb_get_s.pop()  # the closing empty get is no micro-batch
            break
        yield batch, rows
        rep.rows += len(rows)
        rep.micro_batches += 1


@dataclass
class LoopRoles:
    """What this rank does in one MFC's loop, from its role in the group's deployment (engines/deployment.py
    `RankRole`: who reads, who writes, who broadcasts) and what its engine's calls need: the only things the
    loop needs to know of how the model is spread."""
    reads: bool = True                   # pulls micro-batches from the dock
    writes: bool = True                  # pushes outputs (and, for training, reports the replica's metrics)
    share_group: Any = None              # hand each micro-batch from `share_src` to this group before the call
    share_src: int = 0
    collective_stop: bool = False        # the readers say (MAX all-reduce over `stop_group`) whether any has more
    stop_group: Any = None
    fixed_units: bool = False            # train: every rank runs all the mini-batches (a split model's ranks step
                                         # together); else a rank stops when the dock has nothing left for it
    max_rows: int | None = None          # rows this rank takes (an equal share, for collective forwards)
    device: Any = None                   # where the collectives' tensors live (None: the CPU)

    @classmethod
    def of(cls, role: Any, kind: Any, engine: Any, rows: int) -> "LoopRoles":
        """The loop of an MFC of interface `kind` (dataflow InterfaceType) calling `engine` (None: a compute
        MFC) on a rank with `role` (deployment.RankRole); `rows`: the dock's rows (a step's, or the validation
        set's)."""
        from ..dataflow.mfc import InterfaceType
        if engine is None or not role.split:
            # a forward collective over the DP ranks (sharded weights): an equal share of the rows each, so every
            # rank makes as many calls
            collective = (engine is not None and kind is InterfaceType.INFERENCE and role.dp > 1
                          and engine.collective_forward)
            return cls(max_rows=rows // role.dp if collective else None)
        if kind is InterfaceType.TRAIN_STEP:  # every rank steps; the reader reads and reports the replica's metrics
            return cls(reads=role.reads, writes=role.reads, fixed_units=True)
        device = engine.device if getattr(engine, "device", None) is not None and engine.device.type != "cpu" else None
        # every rank of the replica goes on while its reader has a micro-batch; where the forwards are collective
        # over the replicas too (sharded weights), while any reader has one
        return cls(reads=role.reads, writes=role.writes, share_group=engine.replica_group if engine.shares_batches
                   else None, share_src=role.reader, collective_stop=True,
                   stop_group=None if engine.collective_forward else engine.replica_group, device=device)


def run_stage(dock, impl, roles: LoopRoles, *, stage: str, rank: int, step: int, input_keys, get_n_samples: bool,
              timeout_s: float, before_optimizer_step: Callable[[], None] | None = None,
              cores: CoreShare | None = None) -> StageReport:
    """The one loop every MFC runs, training included: read (if this rank reads), share within the replica,
    the implementation's engine call, write (if this rank writes). A unit is a micro-batch for a forward
    MFC and a mini-batch (the micro-batches of one optimizer step, read as the engine consumes them) for a
    train MFC. Each micro-batch computes on the stage's share of the worker's threads (`cores`)."""
    rep = StageReport(stage=stage, rank=rank, step=step)
    rep.t_start = time.time()
    reading = dict(stage=stage, rank=rank, step=step, input_keys=input_keys, timeout_s=timeout_s, report=rep)
    train = getattr(impl, "kind", "forward") == "train"
    cores = cores or CoreShare.of_calling_thread()
    units = (_mini_batches(dock, impl, roles, reading, before_optimizer_step, cores) if train else
             _micro_batches(dock, impl, roles, reading, get_n_samples))
    in_flight = getattr(getattr(impl, "engine", None), "micro_batches_in_flight", 1)
    if not train and in_flight > 1 and roles.share_group is None and not roles.collective_stop:
        return _run_in_flight(dock, impl, roles, units, rep, in_flight)
    try:
        with _on_device(impl, train):   # the engine's state on the device for the stage
            for unit, rows in units:
                t1, get_before = time.perf_counter(), rep.get_s
                if roles.share_group is not None and not train:
                    from ..parallel import broadcast_micro_batch
                    unit, rows = broadcast_micro_batch(unit if roles.reads else None, rows if roles.reads else None,
                                                       src=roles.share_src, group=roles.share_group,
                                                       device=roles.device)
                if not train:
                    cores.computing()
                out = impl.run(unit, rows)
                cores.waiting()
                t2 = time.perf_counter()
                rep.compute_s += t2 - t1 - (rep.get_s - get_before)   # a train unit reads while it computes
                if roles.writes and out is not None:
                    if out.columns and rows:
                        dock.put_experience(out.columns, rows, producer=stage, wait=False)
                    add_metrics(rep.metrics, out.metrics)
                    rep.samples.extend(getattr(out, "samples", [])[:max(0, MAX_SAMPLES - len(rep.samples))])
                t3 = time.perf_counter()
                rep.put_s += t3 - t2
                if not train:
                    rep.mb_put_s.append(t3 - t2)
    finally:
        cores.waiting()
    t4 = time.perf_counter()
    if roles.reads or roles.writes:
        dock.flush()
    rep.put_s += time.perf_counter() - t4
    rep.t_end = time.time()
    rep.peak_rss_bytes = peak_resident_bytes()
    return rep


def _run_in_flight(dock, impl, roles: LoopRoles, units, rep: StageReport, in_flight: int) -> StageReport:
    """A forward stage whose engine batches across calls elsewhere (a rollout server): `in_flight` threads each
    take the next micro-batch, call the engine and push its outputs, so the rows of several micro-batches share
    the engine's slots. The dock's micro-batches are handed out and the outputs pushed under one lock (the
    dock client is one connection); the engine calls run outside it. `compute_s` is the stage's wall time
    less its gets and puts (the calls overlap)."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not errors:
                with lock:
                    item = next(units, None)
                if item is None:
                    return
                unit, rows = item
                out = impl.run(unit, rows)
                t0 = time.perf_counter()
                with lock:
                    if roles.writes and out is not None:
                        if out.columns and rows:
                            dock.put_experience(out.columns, rows, producer=rep.stage, wait=False)
                        add_metrics(rep.metrics, out.metrics)
                        rep.samples.extend(getattr(out, "samples", [])[:max(0, MAX_SAMPLES - len(rep.samples))])
                    rep.put_s += time.perf_counter() - t0
                    rep.mb_put_s.append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - raised by the stage's own thread below
            errors.append(e)

    t_start = time.perf_counter()
    with _on_device(impl, False):
        threads = [threading.Thread(target=loop, name=f"{rep.stage}-in-flight-{i}", daemon=True)
                   for i in range(in_flight)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    t4 = time.perf_counter()
    if roles.reads or roles.writes:
        dock.flush()
    rep.put_s += time.perf_counter() - t4
    rep.compute_s += max(0.0, time.perf_counter() - t_start - rep.get_s - rep.put_s)
    rep.t_end = time.time()
    rep.peak_rss_bytes = peak_resident_bytes()
    return rep


def _on_device(impl, train: bool):
    """The one place every MFC's engine calls go through: its engine's state on the device while the stage
    runs, the optimizer state too for training (an engine that offloads between stages brings it back
    here and puts it away after: engines/train/offload.py, `EngineSet.holding`)."""
    return impl.ctx.host.holding(impl.ctx.mfc, train)


def _micro_batches(dock, impl, roles: LoopRoles, reading: dict, get_n_samples: bool):
    """A forward MFC's units: the micro-batches this rank reads; with a collective stop, every rank of the
    stop group goes on while any reader has one (a rank without rows then calls with none)."""
    batches = (micro_batches(dock, count=impl.count, get_n_samples=get_n_samples, max_rows=roles.max_rows, **reading)
               if roles.reads else iter(()))
    if not roles.collective_stop:
        yield from batches
        return
    import torch
    import torch.distributed as dist
    more = torch.zeros(1, dtype=torch.long, device=roles.device)
    while True:
        item = next(batches, None) if roles.reads else None
        more.fill_(int(item is not None))
        dist.all_reduce(more, op=dist.ReduceOp.MAX, group=roles.stop_group)
        if not int(more.item()):
            return
        yield item if item is not None else ({}, [])


def _mini_batches(dock, impl, roles: LoopRoles, reading: dict, before_optimizer_step, cores: CoreShare):
    """A train MFC's units: per optimizer step, the iterator of its micro-batches as the dock hands them out
    (None on a rank that does not read: its engine gets them from the reader). Before the step's first
    optimizer step the step's other readers of these weights must be done (`before_optimizer_step`)."""
    from ..engines import MicroBatch
    per_rank, mini = impl.args["rows_per_device"], impl.args["mini_rows_per_device"]
    waited = [False]

    def mini_batch(end: int):
        taken = 0
        for batch, rows in micro_batches(dock, count=impl.count, get_n_samples=False, max_rows=end, **reading):
            taken += len(rows)
            cores.computing()
            yield MicroBatch(batch, len(rows) / mini, last=taken >= mini)
            cores.waiting()   # the engine asks for the next one: the dock's wait computes nothing
        if taken and not waited[0] and before_optimizer_step is not None:
            before_optimizer_step()
            waited[0] = True

    for start in range(0, per_rank, mini):
        if not roles.reads:
            yield None, []
            continue
        it = mini_batch(min(per_rank, start + mini))
        if roles.fixed_units:
            yield it, []
            continue
        first = next(it, None)
        if first is None:  # the step's rows are all taken (by other DP ranks)
            return
        yield itertools.chain([first], it), []


def run_stage_loop(dock, *, stage: str, rank: int, step: int, input_keys, count: int, get_n_samples: bool,
                   timeout_s: float, compute: Callable, report: StageReport | None = None,
                   max_rows: int | None = None, prefetch: bool = True) -> StageReport:
    """Pull micro-batches of `count` rows for consumer `stage` until the step is consumed, compute,
    push the outputs back (without waiting for the dock's answer), flush at the end.

    `compute(batch, rows) -> Output | None` returns the columns to push (None: nothing to push).
    """
    rep = report or StageReport(stage=stage, rank=rank, step=step)
    for batch, rows in micro_batches(dock, stage=stage, rank=rank, step=step, input_keys=input_keys, count=count,
                                     get_n_samples=get_n_samples, timeout_s=timeout_s, report=rep,
                                     max_rows=max_rows, prefetch=prefetch):
        t1 = time.perf_counter()
        out = compute(batch, rows)
        t2 = time.perf_counter()
        rep.compute_s += t2 - t1
        if out is not None:
            if out.columns:
                dock.put_experience(out.columns, rows, producer=stage, wait=False)
            add_metrics(rep.metrics, out.metrics)
            rep.samples.extend(getattr(out, "samples", [])[:max(0, MAX_SAMPLES - len(rep.samples))])
        t3 = time.perf_counter()
        rep.put_s += t3 - t2
        rep.mb_put_s.append(t3 - t2)
    t4 = time.perf_counter()
    dock.flush()
    rep.put_s += time.perf_counter() - t4
    rep.t_end = time.time()
    rep.peak_rss_bytes = peak_resident_bytes()
    return rep


def add_metrics(into: dict, more: dict) -> dict:
    """Metric sums across micro-batches, by the one naming rule (algorithms/metrics.py: `_max` maxed, `_min`
    minned, the rest summed)."""
    from ..algorithms.metrics import merge_metrics
    return merge_metrics(into, more)
