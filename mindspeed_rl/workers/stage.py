"""The pull-compute-push loop every MFC runs against the dock.

A stage keeps no rows between pulls: it takes a micro-batch whose input columns are ready, computes,
pushes the outputs back (pipelined: the next get does not wait for the put's reply), and stops
when the dock says it has taken every row of the step. Each wait is bounded by the stage timeout
and a timeout names the stage, its columns and what is missing (the dock's own message).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..transfer_dock.errors import DockTimeoutError


class StageError(RuntimeError):
    """A stage failed; the message starts with the stage name."""


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
    metrics: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_stage_loop(dock, *, stage: str, rank: int, step: int, input_keys, count: int, get_n_samples: bool,
                   timeout_s: float, compute: Callable, report: StageReport | None = None,
                   max_rows: int | None = None, on_rows: Callable | None = None) -> StageReport:
    """Pull micro-batches of `count` rows for consumer `stage` until the step is consumed.

    `compute(batch, rows) -> Output | None` returns the columns to push (None: nothing to push,
    as for a train step). `max_rows` stops early (a DP rank that owns a fixed share of rows).
    """
    rep = report or StageReport(stage=stage, rank=rank, step=step)
    rep.t_start = rep.t_start or time.time()
    while max_rows is None or rep.rows < max_rows:
        want = count if max_rows is None else min(count, max_rows - rep.rows)
        t0 = time.perf_counter()
        try:
            batch, rows = dock.get_experience(stage, list(input_keys), want, get_n_samples=get_n_samples,
                                              blocking=True, timeout=timeout_s, copy=False)
        except DockTimeoutError as e:
            raise StageError(f"stage '{stage}' (rank {rank}, step {step}) timed out after {timeout_s:.0f} s "
                             f"waiting for its inputs {list(input_keys)}: {e}") from None
        t1 = time.perf_counter()
        rep.get_s += t1 - t0
        if not rows:
            break
        out = compute(batch, rows)
        t2 = time.perf_counter()
        rep.compute_s += t2 - t1
        if out is not None:
            if out.columns:
                dock.put_experience(out.columns, rows, producer=stage, wait=False)
            for k, v in out.metrics.items():  # sums, except maxima
                rep.metrics[k] = (max(rep.metrics.get(k, 0.0), float(v)) if k.endswith("_max")
                                  else rep.metrics.get(k, 0.0) + float(v))
        rep.put_s += time.perf_counter() - t2
        rep.rows += len(rows)
        rep.micro_batches += 1
        if on_rows is not None:
            on_rows(rep)
    t3 = time.perf_counter()
    dock.flush()
    rep.put_s += time.perf_counter() - t3
    rep.t_end = time.time()
    return rep
