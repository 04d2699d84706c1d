"""The ideal step times a per-row cost model allows: what the simulate backend's runs are measured against.

`benchmarks/pipeline_efficiency.py` and `benchmarks/async_speedup.py` run a GRPO step with sleeping
stages (the simulate backend) and divide the measured step time by `ideal_pipeline`'s, which is the
pipeline's efficiency: what the dock, the stage loops and the driver cost on top of the overlap the
cost model allows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ...dataflow import MFCDef


# ---------------------------------------------------------------------------------------------- the ideal
@dataclass
class IdealPipeline:
    """What the cost model allows for one step, without any overhead.

    overlapped_s: non-blocking step time, the critical path of the micro-batch pipeline.
    blocking_s:   blocking step time, the stages one after another.
    finish_s:     per stage, when its last micro-batch ends in the overlapped schedule.
    busy_s:       per stage, its compute time (rows * cost / servers).
    """
    overlapped_s: float
    blocking_s: float
    finish_s: dict[str, float] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)


def ideal_pipeline(order: Sequence[MFCDef], costs: Mapping[str, float], micro_batch: Mapping[str, int],
                   rows: int, servers: Mapping[str, int] | None = None) -> IdealPipeline:
    """The ideal step times of a graph under a per-row cost model.

    Model (the assumptions, stated): rows are handed out in index order (`guarantee_order`), so
    micro-batch k of stage s holds rows [k*m_s, (k+1)*m_s); a stage is `servers[s]` independent
    servers (its DP ranks, default 1), each taking the next micro-batch when free, whatever other
    stages share its worker (colocated stages are threads, and sleeping ones do not contend);
    a micro-batch costs rows * cost_s; columns the dataset puts are ready at t=0; handoffs are
    free. Then, with F_u(r) the time row r's output leaves stage u:

        start_s(k) = max(free server of s, max over s's input columns c and rows r of k: F_producer(c)(r))
        F_s(r)     = start_s(k) + m_s * cost_s     for every row r of micro-batch k

    overlapped_s = max over s, r of F_s(r) (the critical path through the micro-batch pipeline);
    blocking_s = the sum over stages, in topological order, of each stage's time with all inputs
    ready. A train step is modelled as its plain micro-batch loop: the real one also waits, before
    its first optimizer step, until the step's other readers of its weights are done.
    """
    servers = dict(servers or {})
    producer = {c: m.name for m in order for c in m.output_keys}
    finish: dict[str, list[float]] = {}
    out = IdealPipeline(overlapped_s=0.0, blocking_s=0.0)
    for m in order:
        cost, mb, n_srv = float(costs.get(m.name, 0.0)), int(micro_batch[m.name]), int(servers.get(m.name, 1))
        free = [0.0] * n_srv
        free_blocking = [0.0] * n_srv
        f = [0.0] * rows
        for start in range(0, rows, mb):
            batch = range(start, min(rows, start + mb))
            ready = max((finish[producer[c]][r] for c in m.input_keys if c in producer for r in batch), default=0.0)
            k = min(range(n_srv), key=free.__getitem__)
            end = max(ready, free[k]) + len(batch) * cost
            free[k] = end
            for r in batch:
                f[r] = end
            j = min(range(n_srv), key=free_blocking.__getitem__)
            free_blocking[j] += len(batch) * cost
        finish[m.name] = f
        out.finish_s[m.name] = max(f, default=0.0)
        out.busy_s[m.name] = rows * cost / n_srv
        out.blocking_s += max(free_blocking)
    out.overlapped_s = max(out.finish_s.values(), default=0.0)
    return out
