"""Cross-step asynchrony: step time with rl_config.max_weight_staleness k = 0 (blocking and
non-blocking), 1 and 2, side by side in one run, against the ideal of the same cost model.

    python benchmarks/async_speedup.py                  # 3 workloads x 6 modes (~10 min on 2 cores)
    python benchmarks/async_speedup.py --json docs/benchmarks/async_speedup.json
    python benchmarks/async_speedup.py --workloads longtail --modes k0_blocking k2 k2_partial   # ~2 min
    python benchmarks/async_speedup.py --engine real --json docs/benchmarks/async_speedup_real.json  # ~10 min

`--engine real` (the section at the end of this text) runs the real engines instead of the simulated ones.

What runs: the real GRPO driver, dock, stage loops and weight sync (bucketed, with a placeholder
bucket), disaggregated placement (rollout, trainer and rule workers apart); the models are the
`simulate` engine backend (engines/simulate/), which sleeps per row, so the machine's 2 cores do
not limit what is measured. A step is 128 rows (16 prompts x 8 samples), 4 micro-batches of 32.

Workloads (seconds of work per step; rewards and advantages cost nothing):
- 50_50: rollout 0.4 s, train side (old log-probs 0.04 + training 0.36) 0.4 s;
- 80_20: rollout 0.64 s, train side 0.16 s;
- longtail: 50:50 in expected work, but generation is a serving engine with 32 slots (continuous
  batching) and each row's length is long-tailed: a mean-1 lognormal factor (sigma 0.87, max/median
  about 8 over a step's rows) drawn from the row's seed. A micro-batch generated alone lasts as long
  as its longest row (synchronous generation waits for the tail); with k > 0 the rows of the steps
  in flight fill each other's idle slots.
Modes: k=0 blocking (stages one after another), k=0 non-blocking (stages overlap within a step),
k=1 and k=2 (step t+k's rollout runs while step t trains; `guarantee_order: false`, so the weights
move as soon as a step is trained and the rollout picks them up at its next micro-batch: each sync
waits for the micro-batches in flight), and k=1, k=2 with `rl_config.partial_rollout` (a sync
pauses the rollout for one decode step instead: the micro-batches in flight go on with the new
weights).

Ideal (same cost model, no overhead): blocking = rollout + train side (longtail: the sum over
micro-batches of their longest row, computed from the same seeds); k=0 non-blocking = the
micro-batch pipeline's critical path (`ideal_pipeline`); k >= 1 = max(rollout work, train side)
per step in steady state (longtail: rollout work = the rows' total cost over the slots).
Measured: the mean of `timing/step` over the steady steps, those after the first k + 2 (the pipeline
filling) and before the last k (no rollout left to overlap with: they only train); beside it the mean over
all of a run's steps (`run_step_s`: the window holds all the work the run did, so rows generated before a
window cannot make it read above its bound). The mean, not
the median: with k > 0 step times alternate (a step whose rows were generated while the one before
it trained is short), and only the mean is bound by the rollout's work per step.

`--engine real`: the tiny default (configs/grpo_tiny.yaml) with vLLM's CPU build serving the rollout
(`generate_config.vllm.serve`: every row a request, rows of all micro-batches in flight share its slots) and
the torch engine training, disaggregated, the rollout worker and vLLM's engine core bound to core 0, the
trainer and the rule worker (rewards, advantages: light) to core 1 (`placement.groups.<g>.cpu_affinity`, one
torch thread each); the driver, the dock and Ray's own processes are not bound. The learning rate is 1e-9, so that the random model's lengths (a stop token
about one draw in 16) stay the same in every step and mode. Workloads:
- balanced: the wider built-in model (builtin:tiny-qwen2-tool: hidden 128, 4 heads of 32) with gradient
  checkpointing and no stop token (every row 32 tokens), so that the train side costs about what the rollout
  does (on the tiny default vLLM's decode, which costs about the same for 1 row as for 128, is 3x training);
- longtail: stop at <eos>, so lengths are geometric (mean about 18, the longest of a step's 128 rows 80-96),
  64 rows decoded at once (vllm.max_num_seqs): a weight sync without partial rollouts waits for the rows in
  flight, the slots idling through their tail.
Modes k=0 blocking, k=1, k=2 and k=2 with partial rollouts (a sync pauses the server with mode=keep: rows
in flight go on over their KV cache with the new weights). The bound of a mode with k >= 1 is the blocking
step over the longer of the blocking run's rollout and train side (old log-probs + training), each measured
in that run; no measured speedup may exceed it. Beside the steady mean, each run's mean over all its steps
(`run_step_s`: its whole time over its steps, so the window holds all the work it did, the pipeline's fill
and its last steps included) gives a speedup that cannot profit from rows generated before its window.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import ray
import yaml

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import build_graph, get_algorithm, topological_order
from mindspeed_rl.engines.simulate import SimulatedRolloutEngine
from mindspeed_rl.trainer import Trainer
from mindspeed_rl.workers.compute import rollout_seed
from mindspeed_rl.engines.simulate import ideal_pipeline

ROWS, N, MICRO, SLOTS, SIGMA, SEED = 128, 8, 32, 32, 0.87, 1
WORKLOADS = {  # seconds per step of each stage's work
    "50_50": {"actor_rollout": 0.40, "actor_log_prob": 0.04, "actor_train": 0.36},
    "80_20": {"actor_rollout": 0.64, "actor_log_prob": 0.016, "actor_train": 0.144},
    "longtail": {"actor_rollout": 0.40, "actor_log_prob": 0.04, "actor_train": 0.36},
}
MODES = (("k0_blocking", 0, True, False), ("k0_overlap", 0, False, False), ("k1", 1, False, False),
         ("k2", 2, False, False), ("k1_partial", 1, False, True), ("k2_partial", 2, False, True))


def make_config(workload: str, k: int, blocking: bool, steps: int, out: str, partial: bool = False) -> dict:
    costs = {stage: s / ROWS for stage, s in WORKLOADS[workload].items()}
    longtail = workload == "longtail"
    return {
        "trainer": {"total_steps": steps, "output_dir": out, "progress": False, "logger": [], "plot": False,
                    "dashboard": False, "report": False, "save_interval": 0, "stage_timeout_s": 60, "seed": SEED,
                    "simulate_cost_s_per_row": costs, "simulate_generate_slots": SLOTS if longtail else 0,
                    "simulate_generate_sigma": SIGMA if longtail else 0.0},
        "rl_config": {"prompts_per_step": ROWS // N, "n_samples_per_prompt": N, "dock_micro_batch_size": MICRO,
                      "blocking": blocking, "guarantee_order": k == 0, "max_weight_staleness": k,
                      "partial_rollout": partial},
        "generate_config": {"micro_batch_size_per_device": MICRO},
        "actor_config": {"ppo_micro_batch_size_per_device": MICRO, "ppo_mini_batch_size": None,
                         "log_prob_micro_batch_size_per_device": MICRO, "kl_loss_coef": 0.0,
                         "recompute_log_prob": True},   # the workloads' old log-probs stage, in every mode
        "placement": {"mode": "disaggregated"},
    }


def longtail_rollout(steps: int) -> tuple[list[float], list[float]]:
    """Per step: (synchronous rollout time: each micro-batch as long as its longest row; the rows'
    total cost over the slots), from the same row seeds the simulated engine draws from."""
    engine = SimulatedRolloutEngine({}, SLOTS, SIGMA)
    c = WORKLOADS["longtail"]["actor_rollout"] / ROWS
    sync, work = [], []
    for step in range(steps):
        f = [engine.row_factor(rollout_seed(SEED, step, r)) for r in range(ROWS)]
        sync.append(sum(max(f[i:i + MICRO]) * c * SLOTS for i in range(0, ROWS, MICRO)))
        work.append(sum(f) * c)
    return sync, work


def steady(values: list, k: int) -> list:
    """The steady steps' values: after the first k + 2 and before the last k."""
    return values[k + 2:len(values) - k]


def ideal(workload: str, k: int, blocking: bool, steps: int) -> float:
    w = WORKLOADS[workload]
    train_side = w["actor_log_prob"] + w["actor_train"]
    if workload == "longtail":
        sync, work = longtail_rollout(steps)
        if k == 0:  # generation waits for each micro-batch's longest row; overlap hides only the train side's tail
            per = [s + (train_side if blocking else train_side * MICRO / ROWS) for s in sync]
        else:
            per = [max(x, train_side) for x in work]
        return statistics.mean(steady(per, k))
    if k == 0:
        mfcs, keys = get_algorithm("grpo")
        order = topological_order(build_graph(mfcs, keys))
        costs = {s: v / ROWS for s, v in w.items()}
        p = ideal_pipeline(order, costs, {m.name: MICRO for m in order}, ROWS)
        return p.blocking_s if blocking else p.overlapped_s
    return max(w["actor_rollout"], train_side)


def measure(workload: str, k: int, blocking: bool, partial: bool, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        history = Trainer(config_from_dict(make_config(workload, k, blocking, steps, tmp, partial))).run()
        wall = time.perf_counter() - t0
    times = steady([r["timing/step"] for r in history], k)
    return {"step_s": statistics.mean(times), "step_median_s": statistics.median(times),
            "run_step_s": sum(r["timing/step"] for r in history) / len(history),
            "step_min_s": min(times), "step_max_s": max(times), "steady_steps": len(times), "wall_s": wall,
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in history),
            "partial_fraction": statistics.mean(r.get("async/partial_fraction", 0.0) for r in history)}


def run(steps: int, workloads=tuple(WORKLOADS), modes=tuple(m[0] for m in MODES)) -> dict:
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
           "steps": steps, "rows_per_step": ROWS, "micro_batch": MICRO, "workloads": {}, "ratios": {}}
    for workload in workloads:
        res = {}
        for name, k, blocking, partial in MODES:
            if name not in modes:
                continue
            m = measure(workload, k, blocking, partial, steps)
            m["ideal_s"] = ideal(workload, k, blocking, steps)
            res[name] = m
            print(f"{workload:9s} {name:12s} step {m['step_s']:.3f} s (ideal {m['ideal_s']:.3f}; steady steps "
                  f"{m['step_min_s']:.3f}-{m['step_max_s']:.3f}), staleness max {m['staleness_max']:.0f}",
                  file=sys.stderr, flush=True)
        base = res.get("k0_blocking")
        for name in [m[0] for m in MODES[1:]]:
            if base is not None and name in res:
                res[name]["speedup"] = base["step_s"] / res[name]["step_s"]
                res[name]["run_speedup"] = base["run_step_s"] / res[name]["run_step_s"]
                res[name]["ideal_speedup"] = base["ideal_s"] / res[name]["ideal_s"]
        out["workloads"][workload] = res
    out["machine"]["load_after"] = os.getloadavg()
    w = out["workloads"]
    targets = {"speedup_k1_over_blocking_50_50": ("50_50", "k1", 1.8),
               "speedup_k1_over_blocking_80_20": ("80_20", "k1", 1.2),
               "speedup_k2_over_blocking_longtail": ("longtail", "k2", 2.5),
               "speedup_k2_partial_over_blocking_longtail": ("longtail", "k2_partial", 2.9)}
    out["ratios"] = {"targets": {}}
    for key, (workload, mode, target) in targets.items():  # the ratios this run measured
        if "speedup" in w.get(workload, {}).get(mode, {}):
            out["ratios"][key] = w[workload][mode]["speedup"]
            out["ratios"][key.replace("speedup", "ideal")] = w[workload][mode]["ideal_speedup"]
            out["ratios"]["targets"][key] = target
    return out


def print_table(res: dict) -> None:
    print(f"\nCross-step asynchrony: simulated GRPO through the real driver, dock, stage loops and sync "
          f"({res['rows_per_step']} rows/step, micro-batch {res['micro_batch']}, mean time of the steady steps)\n")
    print(f"{'workload':10s} {'mode':12s} {'step s':>8s} {'run s':>7s} {'ideal s':>8s} {'speedup':>8s} {'run':>6s} "
          f"{'ideal':>7s}")
    for workload, modes in res["workloads"].items():
        for name, m in modes.items():
            none = "1.00x" if name == "k0_blocking" else "-"
            sp, rs, isp = (f"{m[k]:.2f}x" if k in m else none for k in ("speedup", "run_speedup", "ideal_speedup"))
            print(f"{workload:10s} {name:12s} {m['step_s']:8.3f} {m['run_step_s']:7.3f} {m['ideal_s']:8.3f} {sp:>8s} "
                  f"{rs:>6s} {isp:>7s}")
    r = res["ratios"]
    load = res["machine"]
    print(f"\nload average (1, 5, 15 min) before: {' '.join(f'{x:.1f}' for x in load['load'])}, after: "
          f"{' '.join(f'{x:.1f}' for x in load['load_after'])} on {load['cpus']} CPUs")
    for key, target in r["targets"].items():
        print(f"{key}: {r[key]:.2f} (ideal {r[key.replace('speedup', 'ideal')]:.2f}, target >= {target})")


REAL_WORKLOADS = {  # the tiny default's overrides of each real workload
    "balanced": {"actor_config": {"model_path": "builtin:tiny-qwen2-tool", "gradient_checkpointing": True},
                 "generate_config": {"max_new_tokens": 32, "stop_tokens": []}},
    "longtail": {"generate_config": {"max_new_tokens": 96, "stop_tokens": ["<eos>"], "vllm": {"max_num_seqs": 64}}},
}
REAL_MODES = ("k0_blocking", "k2", "k1", "k2_partial")
REAL_CORES = {"rollout": [0], "actor": [1], "rule": [1]}   # worker group -> the cores it is bound to
REAL_TARGETS = {"speedup_k1_over_blocking_balanced_real": ("balanced", "k1", "k0_blocking", 1.6),
                "speedup_k2_partial_over_k2_longtail_real": ("longtail", "k2_partial", "k2", 1.25)}


def _merge(into: dict, over: dict) -> dict:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def make_real_config(workload: str, mode: str, steps: int, out: str) -> dict:
    """configs/grpo_tiny.yaml with the workload's and the mode's overrides (module docstring)."""
    _, k, blocking, partial = next(m for m in MODES if m[0] == mode)
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_tiny.yaml")) as f:
        base = yaml.safe_load(f)
    groups = {g: {"num_cpus": 0.5, "torch_threads": 1, "cpu_affinity": cores} for g, cores in REAL_CORES.items()}
    return _merge(_merge(base, copy.deepcopy(REAL_WORKLOADS[workload])), {
        "trainer": {"total_steps": steps, "output_dir": out, "progress": False, "logger": [], "plot": False,
                    "dashboard": False, "report": False, "save_interval": 0, "save_hf": "never", "seed": SEED},
        "actor_config": {"lr": 1e-9},
        "rl_config": {"blocking": blocking, "guarantee_order": k == 0, "max_weight_staleness": k,
                      "partial_rollout": partial},
        "generate_config": {"backend": "vllm", "vllm": {"serve": True}},
        "placement": {"mode": "disaggregated", "groups": groups}})


def measure_real(workload: str, mode: str, steps: int) -> dict:
    k = next(m[1] for m in MODES if m[0] == mode)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        history = Trainer(config_from_dict(make_real_config(workload, mode, steps, tmp))).run()
        wall = time.perf_counter() - t0
    rows = steady(history, k)

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in rows)
    times = [r["timing/step"] for r in rows]
    return {"step_s": statistics.mean(times), "step_min_s": min(times), "step_max_s": max(times),
            "run_step_s": sum(r["timing/step"] for r in history) / len(history),
            "steady_steps": len(times), "wall_s": wall, "rollout_s": mean("timing/actor_rollout"),
            "train_side_s": mean("timing/actor_log_prob") + mean("timing/actor_train"),
            "response_length_mean": mean("response_length/mean"), "response_length_max": mean("response_length/max"),
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in history),
            "partial_fraction": statistics.mean(r.get("async/partial_fraction", 0.0) for r in history)}


def run_real(steps: int, workloads=tuple(REAL_WORKLOADS), modes=REAL_MODES) -> dict:
    from seed_spread import commit   # benchmarks/ is on sys.path when this runs as a script
    out = {"engine": "real", "commit": commit(), "argv": sys.argv[1:],
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
           "placement": {g: {"cores": c, "torch_threads": 1} for g, c in REAL_CORES.items()},
           "overrides": {w: REAL_WORKLOADS[w] for w in workloads},
           "steps": steps, "rows_per_step": ROWS, "micro_batch": MICRO, "workloads": {}, "ratios": {"targets": {}}}
    for workload in workloads:
        res = {}
        for mode in [m for m in REAL_MODES if m in modes]:
            res[mode] = m = measure_real(workload, mode, steps)
            print(f"{workload:9s} {mode:12s} step {m['step_s']:.3f} s (rollout {m['rollout_s']:.3f}, train side "
                  f"{m['train_side_s']:.3f}; steady steps {m['step_min_s']:.3f}-{m['step_max_s']:.3f}), response "
                  f"length {m['response_length_mean']:.1f} (max {m['response_length_max']:.0f}), partial "
                  f"{m['partial_fraction']:.2f}", file=sys.stderr, flush=True)
        base = res.get("k0_blocking")
        if base is not None:
            bound = base["step_s"] / max(base["rollout_s"], base["train_side_s"])
            for mode, m in res.items():
                m["speedup"] = base["step_s"] / m["step_s"]
                m["run_speedup"] = base["run_step_s"] / m["run_step_s"]
                m["bound"] = 1.0 if mode == "k0_blocking" else bound
        out["workloads"][workload] = res
    out["machine"]["load_after"] = os.getloadavg()
    for key, (workload, mode, over, target) in REAL_TARGETS.items():
        w = out["workloads"].get(workload, {})
        if mode in w and over in w:
            out["ratios"][key] = w[over]["step_s"] / w[mode]["step_s"]
            out["ratios"][key + "_whole_run"] = w[over]["run_step_s"] / w[mode]["run_step_s"]
            out["ratios"]["targets"][key] = target
    return out


def print_real_table(res: dict) -> None:
    cores = ", ".join(f"{g} on core {c}" for g, c in ((g, p["cores"]) for g, p in res["placement"].items()))
    print(f"\nCross-step asynchrony on real engines: the tiny default, vLLM serving, torch training ({cores}; "
          f"{res['rows_per_step']} rows/step, mean time of the steady steps)\n")
    print(f"{'workload':10s} {'mode':12s} {'step s':>8s} {'run s':>7s} {'rollout s':>9s} {'train s':>8s} "
          f"{'speedup':>8s} {'run':>6s} {'bound':>6s} {'partial':>7s}")
    for workload, modes in res["workloads"].items():
        for name, m in modes.items():
            sp, rs, bd = (f"{m[k]:.2f}x" if k in m else "-" for k in ("speedup", "run_speedup", "bound"))
            print(f"{workload:10s} {name:12s} {m['step_s']:8.3f} {m['run_step_s']:7.3f} {m['rollout_s']:9.3f} "
                  f"{m['train_side_s']:8.3f} {sp:>8s} {rs:>6s} {bd:>6s} {m['partial_fraction']:7.2f}")
    load = res["machine"]
    print(f"\nload average (1, 5, 15 min) before: {' '.join(f'{x:.1f}' for x in load['load'])}, after: "
          f"{' '.join(f'{x:.1f}' for x in load['load_after'])} on {load['cpus']} CPUs")
    for key, target in res["ratios"]["targets"].items():
        print(f"{key}: {res['ratios'][key]:.2f} (whole runs {res['ratios'][key + '_whole_run']:.2f}; "
              f"target >= {target})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=14,
                   help="steps per run (the first k + 2 and the last k are not measured)")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    p.add_argument("--engine", choices=["simulated", "real"], default="simulated",
                   help="real: vLLM serving and torch training on disjoint cores (the docstring's last section)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS) + list(REAL_WORKLOADS),
                   help=f"simulated: {list(WORKLOADS)}; real: {list(REAL_WORKLOADS)} (default: all of the engine's)")
    p.add_argument("--modes", nargs="+", choices=[m[0] for m in MODES], default=[m[0] for m in MODES],
                   help="speedups need k0_blocking among them")
    args = p.parse_args()
    real = args.engine == "real"
    known = REAL_WORKLOADS if real else WORKLOADS
    workloads = args.workloads or list(known)
    if set(workloads) - set(known):
        p.error(f"--workloads {sorted(set(workloads) - set(known))}: not a workload of --engine {args.engine}; "
                f"those are {list(known)}")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        res = (run_real(args.steps, workloads, args.modes) if real else run(args.steps, workloads, args.modes))
    finally:
        ray.shutdown()
    (print_real_table if real else print_table)(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
