"""Pipeline efficiency: measured step time against the ideal overlap of a cost model.

    python benchmarks/pipeline_efficiency.py                 # 4, 8, 16, 32 micro-batches (~2.5 min)
    python benchmarks/pipeline_efficiency.py --quick         # fewer rounds (~1.5 min)
    python benchmarks/pipeline_efficiency.py --json out.json

What runs: the real GRPO job through the real `Trainer` (driver), the real dataflow graph (stage
names, dock columns, consumers), the real TransferDock and every stage's real pull-compute-push
loop (`run_stage_loop`); only the compute is replaced, by `trainer.simulate_cost_s_per_row`
(the simulate backend, `mindspeed_rl/engines/simulate/`): each stage sleeps a fixed time per row and pushes a small
placeholder per row, no models are loaded and weight sync is skipped. Sleeping stages do not
compete for the machine's 2 cores, so what is measured is the pipeline, not the CPU.

Cost model (`COSTS`, seconds per row): rollout is 80% of the sequential sum, as in real RL jobs.
A step is 256 rows (32 prompts x 8 samples). The micro-batch count M (4, 8, 16, 32) sets every
stage's rows per get to 256 / M (generate, both log-probs, reward, advantage and the train step).

Ideal step times (`simulate.ideal_pipeline`; assumptions: rows handed out in index order, each
stage its own server, since colocated stages are threads and sleeping ones do not contend;
handoffs free; columns the dataset puts ready at t=0). With m_s rows per micro-batch, c_s seconds
per row and F_u(r) the time row r leaves stage u:
    start_s(k) = max(F_s of micro-batch k-1, max over inputs c and rows r of k: F_producer(c)(r))
    F_s(r)     = start_s(k) + m_s * c_s
    ideal non-blocking = max F (the critical path of the micro-batch pipeline)
    ideal blocking     = sum over stages of rows * c_s
For this graph that is about rows * c_rollout + m * (c_log_prob + c_train): the slowest stage plus
one micro-batch of the stages after it.

Each micro-batch count gets one trainer (workers, dock) whose steps alternate blocking and
non-blocking (ABBA order after one warm-up pair, `steptrace.py`), so both modes share the machine's
noise. Reported per M: median step time per mode (`timing/step`, the driver's own measurement),
the ideal, efficiency = ideal / measured (non-blocking), speedup = blocking / non-blocking.

handoff_ms: the median, over every micro-batch of every stage in the blocking steps, of the stage
loop's get wall time plus its put wall time (`StageReport.mb_get_s`, `mb_put_s`). In blocking mode
a stage starts after its inputs are all written, so no get waits for rows and this is overhead
only, as the loop sees it: collecting the answer of the get it sent before computing the previous
micro-batch (`run_stage_loop` prefetches), unpickling it (rows are read zero-copy), sending the
next get, and packing, pickling and sending the put (`wait=False`: the dock stores it while the
stage computes). The stage's final `flush()` and empty get are not per micro-batch and not in it.
Also reported: the same in the non-blocking steps, with the time each get spent waiting inside the
dock for its rows (the dock's event log) taken out (rough: with the prefetch, part of that wait
overlapped the previous compute); and the rollout's loop alone (`LoopProbe`),
inputs ready, with and without the prefetch, alternated: without it, get + put is the raw cost of
a handoff (two actor calls).

Where the non-blocking step's time beyond the ideal goes (median ms per step), along the rollout
stage, the critical one: driver (the step outside `StepPipeline.run`: prompts loaded and put, dock
cleared, metrics), dispatch (from the driver's stage calls to the rollout loop's start), rollout
handoffs (its gets and puts), sleep overshoot (its compute beyond rows * cost), tail (from the last
rollout micro-batch to the last stage's end, beyond the ideal tail) and collect (from the last
stage's end until the driver has every report). The parts add up to measured - ideal.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import ray
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.engines.simulate import ideal_pipeline

from steptrace import TracingTrainer, abba_schedule, measured, median

ROWS_PER_STEP = 256          # 32 prompts x 8 samples
N_SAMPLES = 8
MICROBATCH_COUNTS = (4, 8, 16, 32)
# seconds per row; rollout = 6.0 / 7.5 = 80% of the sequential sum
COSTS = {"actor_rollout": 0.0060, "rule_reward": 0.00015, "ref_log_prob": 0.0003, "actor_log_prob": 0.0003,
         "compute_advantage": 0.00005, "actor_train": 0.0007}
CRITICAL = "actor_rollout"


def make_config(microbatches: int, steps: int, output_dir: str, placement: str) -> dict:
    m = ROWS_PER_STEP // microbatches
    return {
        "trainer": {"total_steps": steps, "output_dir": output_dir, "progress": False, "logger": [], "plot": False,
                    "dashboard": False, "report": False, "save_interval": 0, "stage_timeout_s": 60,
                    "simulate_cost_s_per_row": dict(COSTS)},
        "rl_config": {"prompts_per_step": ROWS_PER_STEP // N_SAMPLES, "n_samples_per_prompt": N_SAMPLES,
                      "dock_micro_batch_size": m, "guarantee_order": True},
        "generate_config": {"micro_batch_size_per_device": m},
        "actor_config": {"ppo_micro_batch_size_per_device": m, "ppo_mini_batch_size": None,
                         "log_prob_micro_batch_size_per_device": m},
        "ref_config": {"log_prob_micro_batch_size_per_device": m},
        "placement": {"mode": placement},
    }


def handoffs_ms(trace, plan) -> list[float]:
    """Per micro-batch get + put overhead (ms) of every stage in one step.

    Blocking steps: the loop's get and put times as they are (every get found its rows ready).
    Non-blocking steps: each get's time waiting inside the dock (its event: answered - arrived) is
    taken out, at most down to 0 (a prefetched get may have waited while the loop still computed);
    the k-th logged get of a (stage, worker) is the loop's k-th micro-batch."""
    waits: dict[tuple[str, str], list[float]] = {}
    if not trace.blocking:
        for e in trace.events:
            if e["op"] == "get" and e["rows"] > 0:
                waits.setdefault((e["stage"], e["worker"]), []).append(e["t_end"] - e["t_start"])
    out = []
    for r in trace.reports:
        w = waits.get((r["stage"], f"{plan.group_of(r['stage'])}/{r['rank']}"), [])
        for k, (g, p) in enumerate(zip(r["mb_get_s"], r["mb_put_s"])):
            wait = w[k] if (not trace.blocking and k < len(w)) else 0.0
            out.append(1e3 * (max(0.0, g - wait) + p))
    return out


def gap_parts(trace, ideal) -> dict[str, float]:
    """Where a non-blocking step's time beyond the ideal goes (ms), along the critical stage."""
    reps = {r["stage"]: r for r in trace.reports}
    c = reps[CRITICAL]
    last_end = max(r["t_end"] for r in trace.reports)
    stages_s = trace.stages_end - trace.stages_start
    ideal_tail = ideal.overlapped_s - ideal.finish_s[CRITICAL]
    parts = {
        "driver": trace.step_s - stages_s,
        "dispatch": c["t_start"] - trace.stages_start,
        "rollout_handoffs": c["get_s"] + c["put_s"],
        "sleep_overshoot": c["compute_s"] - ideal.busy_s[CRITICAL],
        "tail": (last_end - c["t_end"]) - ideal_tail,
        "collect": trace.stages_end - last_end,
    }
    parts = {k: 1e3 * v for k, v in parts.items()}
    parts["total"] = 1e3 * (trace.step_s - ideal.overlapped_s)
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return parts


def blocking_parts(trace, ideal) -> dict[str, float]:
    """Where a blocking step's time beyond the ideal goes (ms): per-stage loop overhead (gets, puts,
    flush), sleep overshoot, the gaps between one stage's end and the next one's start (the driver
    waits for a stage's report, then calls the next), and the driver outside the stages."""
    reps = sorted(trace.reports, key=lambda r: r["t_start"])
    loop = sum(r["get_s"] + r["put_s"] for r in reps)
    overshoot = sum(r["compute_s"] for r in reps) - ideal.blocking_s
    stages_s = trace.stages_end - trace.stages_start
    span = sum(r["t_end"] - r["t_start"] for r in reps)
    parts = {"driver": trace.step_s - stages_s, "stage_loops": loop, "sleep_overshoot": overshoot,
             "between_stages": stages_s - span}
    parts = {k: 1e3 * v for k, v in parts.items()}
    parts["total"] = 1e3 * (trace.step_s - ideal.blocking_s)
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return parts


def run_one(microbatches: int, rounds: int, placement: str) -> dict:
    m = ROWS_PER_STEP // microbatches
    schedule = abba_schedule(rounds)
    with tempfile.TemporaryDirectory(prefix="pipeline_eff_") as tmp:
        cfg = config_from_dict(make_config(microbatches, len(schedule), tmp, placement))
        trainer = TracingTrainer(cfg, schedule, warmup_steps=2)
        trainer.run()
    plan = trainer.plan
    for t in trainer.traces:  # the stages pulled the micro-batches the cost model assumes
        for r in t.reports:
            assert r["rows"] == ROWS_PER_STEP and r["micro_batches"] == microbatches, (r["stage"], r["rows"],
                                                                                       r["micro_batches"])
    ideal = ideal_pipeline(plan.order, COSTS, {s.name: m for s in plan.order}, ROWS_PER_STEP)
    blk, nb = measured(trainer.traces, True), measured(trainer.traces, False)
    b_s, nb_s = median(t.step_s for t in blk), median(t.step_s for t in nb)
    h_blk = [x for t in blk for x in handoffs_ms(t, plan)]
    h_nb = [x for t in nb for x in handoffs_ms(t, plan)]
    gaps = [gap_parts(t, ideal) for t in nb]
    bgaps = [blocking_parts(t, ideal) for t in blk]
    return {
        "microbatches": microbatches, "rows_per_microbatch": m, "rounds": rounds,
        "blocking_s": [t.step_s for t in blk], "nonblocking_s": [t.step_s for t in nb],
        "blocking_median_s": b_s, "nonblocking_median_s": nb_s,
        "ideal_blocking_s": ideal.blocking_s, "ideal_nonblocking_s": ideal.overlapped_s,
        "efficiency": ideal.overlapped_s / nb_s, "efficiency_blocking": ideal.blocking_s / b_s,
        "speedup": b_s / nb_s, "ideal_speedup": ideal.blocking_s / ideal.overlapped_s,
        "ideal_finish_s": ideal.finish_s,
        "handoff_ms": median(h_blk), "handoff_p90_ms": _pct(h_blk, 0.9),
        "handoff_nonblocking_ms": median(h_nb),
        "handoffs_per_step": len(h_blk) // max(1, len(blk)),
        "gap_ms": {k: median(g[k] for g in gaps) for k in gaps[0]},
        "blocking_gap_ms": {k: median(g[k] for g in bgaps) for k in bgaps[0]},
        "_handoffs_blocking_ms": h_blk,
    }


@ray.remote(num_cpus=0.5, max_concurrency=4)
class LoopProbe:
    """A worker-like actor running the real stage loop as the rollout stage, inputs all ready."""

    def run(self, dock, microbatches: int, overlap: bool) -> list[float]:
        from mindspeed_rl.engines.simulate import simulated_compute
        from mindspeed_rl.workers.stage import run_stage_loop
        from mindspeed_rl.dataflow import get_algorithm
        dock.worker = "probe/0"
        mfc = next(m for m in get_algorithm("grpo")[0] if m.name == CRITICAL)
        rep = run_stage_loop(dock, stage=mfc.name, rank=0, step=0, input_keys=mfc.input_keys,
                             count=ROWS_PER_STEP // microbatches, get_n_samples=False, timeout_s=60,
                             compute=simulated_compute(mfc, COSTS[CRITICAL]), prefetch=overlap)
        return [1e3 * (g + p) for g, p in zip(rep.mb_get_s, rep.mb_put_s)]


def measure_loop_handoff(rounds: int, microbatches: int = 16) -> dict[str, float]:
    """The stage loop alone, with and without its overlap (alternated): the rollout's loop, all
    inputs ready, the same sleep per micro-batch as in the pipeline. Without overlap, get + put is
    the raw cost of a handoff (two actor calls); with it, what is left on the loop's path."""
    from mindspeed_rl.transfer_dock.client import create_transfer_dock
    from mindspeed_rl.planning import make_plan
    plan = make_plan(config_from_dict(make_config(microbatches, 1, "unused", "disaggregated")), check_files=False)
    dock = create_transfer_dock(plan.columns, plan.consumers, ROWS_PER_STEP // N_SAMPLES, N_SAMPLES,
                                guarantee_order=True, default_timeout=60)
    probe = LoopProbe.remote()
    prompts = [torch.arange(12) for _ in range(ROWS_PER_STEP)]
    out: dict[str, list[float]] = {"sync": [], "overlapped": []}
    try:
        for r in range(rounds + 1):
            for overlap in ((False, True) if r % 2 == 0 else (True, False)):
                dock.put_experience({"prompts": prompts, "prompt_length": [torch.tensor([12])] * ROWS_PER_STEP},
                                    list(range(ROWS_PER_STEP)), producer="dataset")
                ms = ray.get(probe.run.remote(dock, microbatches, overlap))
                dock.clear()
                if r > 0:  # the first round warms the actor and the connections
                    out["overlapped" if overlap else "sync"] += ms
    finally:
        dock.close()
        ray.kill(dock.actor)
        ray.kill(probe)
    return {"sync_ms": median(out["sync"]), "overlapped_ms": median(out["overlapped"]),
            "sync_p90_ms": _pct(out["sync"], 0.9), "overlapped_p90_ms": _pct(out["overlapped"], 0.9)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(rounds: int, placement: str, counts=MICROBATCH_COUNTS) -> dict:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for mb in counts:
            t = time.time()
            rows.append(run_one(mb, rounds, placement))
            print(f"  measured {mb} micro-batches ({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
        loop = measure_loop_handoff(max(2, rounds // 2))
    finally:
        ray.shutdown()
    pooled = [x for r in rows for x in r.pop("_handoffs_blocking_ms")]
    by_m = {r["microbatches"]: r for r in rows}
    out = {
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "ray": ray.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "placement": placement, "rows_per_step": ROWS_PER_STEP, "costs_s_per_row": COSTS, "rounds": rounds,
        "rollout_fraction": COSTS[CRITICAL] / sum(COSTS.values()),
        "results": rows,
        "efficiency": {str(m): r["efficiency"] for m, r in by_m.items()},
        "speedup": {str(m): r["speedup"] for m, r in by_m.items()},
        "handoff_ms": median(pooled), "handoff_p90_ms": _pct(pooled, 0.9),
        "loop_handoff": loop,
    }
    if 16 in by_m:
        out["efficiency_16"] = by_m[16]["efficiency"]
        out["speedup_16"] = by_m[16]["speedup"]
    return out


def print_table(res: dict) -> None:
    costs = res["costs_s_per_row"]
    print(f"\nPipeline efficiency: simulated GRPO through the real driver, dock and stage loops "
          f"({res['placement']}, {res['rows_per_step']} rows/step, {res['rounds']} rounds, "
          f"{res['machine']['cpus']} CPUs, ray {res['machine']['ray']})")
    print("cost model, ms per row: " + ", ".join(f"{k} {1e3 * v:g}" for k, v in costs.items())
          + f"  (rollout {100 * res['rollout_fraction']:.0f}% of the sequential sum)\n")
    print(f"  {'micro-':>6} {'rows':>5} | {'blocking s':>10} {'ideal':>6} | {'non-blocking s':>14} {'ideal':>6} "
          f"{'efficiency':>10} | {'speedup':>7} {'ideal':>6}")
    print(f"  {'batches':>6} {'/mb':>5} |")
    for r in res["results"]:
        print(f"  {r['microbatches']:>6} {r['rows_per_microbatch']:>5} | {r['blocking_median_s']:>10.3f} "
              f"{r['ideal_blocking_s']:>6.3f} | {r['nonblocking_median_s']:>14.3f} {r['ideal_nonblocking_s']:>6.3f} "
              f"{r['efficiency']:>10.3f} | {r['speedup']:>7.3f} {r['ideal_speedup']:>6.3f}")
    print(f"\nhandoff (one get that found its rows ready + one put, per micro-batch, blocking steps): median "
          f"{res['handoff_ms']:.2f} ms, p90 {res['handoff_p90_ms']:.2f} ms")
    print("  per micro-batch count: " + ", ".join(
        f"{r['microbatches']}: {r['handoff_ms']:.2f} ms (non-blocking, dock wait taken out: "
        f"{r['handoff_nonblocking_ms']:.2f})" for r in res["results"]))
    lp = res["loop_handoff"]
    print(f"the rollout's stage loop alone, inputs ready, 16 micro-batches (median ms per micro-batch, get + put): "
          f"without overlap {lp['sync_ms']:.2f} (p90 {lp['sync_p90_ms']:.2f}), with the loop's overlap "
          f"{lp['overlapped_ms']:.2f} (p90 {lp['overlapped_p90_ms']:.2f})")
    keys = ["driver", "dispatch", "rollout_handoffs", "sleep_overshoot", "tail", "collect", "other", "total"]
    print("\nnon-blocking: where the step's time beyond the ideal goes (median ms per step)")
    print("  " + f"{'M':>3} " + " ".join(f"{k:>16}" for k in keys))
    for r in res["results"]:
        print("  " + f"{r['microbatches']:>3} " + " ".join(f"{r['gap_ms'][k]:>16.1f}" for k in keys))
    bkeys = ["driver", "stage_loops", "sleep_overshoot", "between_stages", "other", "total"]
    print("\nblocking: where the step's time beyond the ideal goes (median ms per step)")
    print("  " + f"{'M':>3} " + " ".join(f"{k:>16}" for k in bkeys))
    for r in res["results"]:
        print("  " + f"{r['microbatches']:>3} " + " ".join(f"{r['blocking_gap_ms'][k]:>16.1f}" for k in bkeys))
    if "efficiency_16" in res:
        print(f"\ntargets\n  efficiency_16  {res['efficiency_16']:.3f}  (target >= 0.9; non-blocking, 16 micro-batches)"
              f"\n  handoff_ms     {res['handoff_ms']:.2f}  (target <= 2; one get + one put)"
              f"\n  speedup_16     {res['speedup_16']:.3f}  (blocking / non-blocking step time; the cost model "
              f"allows {next(r['ideal_speedup'] for r in res['results'] if r['microbatches'] == 16):.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds instead of 6")
    p.add_argument("--rounds", type=int, default=None, help="measured (blocking, non-blocking) pairs per count")
    p.add_argument("--placement", default="disaggregated", choices=["colocated", "disaggregated"])
    p.add_argument("--counts", default=",".join(map(str, MICROBATCH_COUNTS)),
                   help="micro-batch counts per step, comma-separated (each divides 256 into multiples of 8)")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 6)
    counts = tuple(int(x) for x in args.counts.split(","))
    res = run(rounds, args.placement, counts)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
