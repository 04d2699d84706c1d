"""The real tiny GRPO job on CPU, blocking against non-blocking, alternated in one run.

    python benchmarks/e2e_grpo.py                  # 1 warm-up pair + 20 measured pairs (~1 min)
    python benchmarks/e2e_grpo.py --quick          # 8 measured pairs
    python benchmarks/e2e_grpo.py --json out.json

configs/grpo_tiny.yaml as it is (the 75k-parameter Qwen2, 16 prompts x 8 samples = 128 rows a
step, the real models, rewards, optimizer and weight sync), with `placement.mode=disaggregated`:
rollout, actor (log-probs + train) and rule (reward + advantage) each get their own Ray actor
(0.5 CPU each, `torch_threads: 1`), and so does ref when the config has a KL term (grpo_tiny has
none, `kl_loss_coef: 0`, so it runs no reference stage). The groups and stages are the plan's.

One trainer runs every step; `rl_config.blocking` flips per step in ABBA order after one warm-up
pair (`steptrace.py`), with a fixed seed. With `guarantee_order` both modes compute the same
numbers, so this is one ordinary training run whose steps happen to alternate modes, and drift
(the model's responses change as it learns, the machine's load changes) hits both modes alike.

Reported per mode: the median step time (`timing/step`, the driver's own measurement), tokens/s
(prompt + response tokens of the step / step time), and the speedup blocking / non-blocking;
also each stage's busy time (its compute, summed over micro-batches) and the weight sync, medians.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
import yaml

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.planning import make_plan

from steptrace import TracingTrainer, abba_schedule, measured, median

REPO = Path(__file__).resolve().parents[1]


def make_config(steps: int, output_dir: str, seed: int) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update({"total_steps": steps, "output_dir": output_dir, "seed": seed, "progress": False,
                           "logger": [], "plot": False, "dashboard": False, "report": False, "save_interval": 0})
    cfg["placement"].update({"mode": "disaggregated"})
    groups = make_plan(config_from_dict(cfg), check_files=False).groups  # the graph's groups (ref: only with KL)
    cfg["placement"]["groups"] = {g: {"torch_threads": 1, "num_cpus": 0.5} for g in groups}
    return cfg


def stages(plan) -> tuple[str, ...]:
    return tuple(m.name for m in plan.order)


def run(rounds: int, seed: int) -> dict:
    schedule = abba_schedule(rounds)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="e2e_grpo_") as tmp:
            cfg = config_from_dict(make_config(len(schedule), tmp, seed))
            trainer = TracingTrainer(cfg, schedule, warmup_steps=2, read_events=False)
            t = time.time()
            trainer.run()
            wall = time.time() - t
    finally:
        ray.shutdown()
    out: dict = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__, "ray": ray.__version__,
                             "cpus": os.cpu_count(), "platform": platform.platform()},
                 "seed": seed, "rounds": rounds, "rows_per_step": trainer.plan.rows_per_step,
                 "placement": "disaggregated", "wall_s": wall, "modes": {}}
    for blocking in (True, False):
        ts = measured(trainer.traces, blocking)
        recs = [t.record for t in ts]
        out["modes"]["blocking" if blocking else "non-blocking"] = {
            "step_s": [r["timing/step"] for r in recs],
            "median_step_s": median(r["timing/step"] for r in recs),
            "tokens_per_s": median(r["throughput/tokens_per_s"] for r in recs),
            "weight_sync_s": median(r["timing/weight_sync"] for r in recs),
            "busy_s": {s: median(r[f"busy/{s}"] for r in recs) for s in stages(trainer.plan)},
            "reward_mean": [r["reward/mean"] for r in recs],
        }
    b, nb = out["modes"]["blocking"], out["modes"]["non-blocking"]
    out["speedup"] = b["median_step_s"] / nb["median_step_s"]
    out["tokens_per_s_ratio"] = nb["tokens_per_s"] / b["tokens_per_s"]
    out["steps"] = [{"step": t.step, "blocking": t.blocking, "warmup": t.warmup, "step_s": t.step_s,
                     "tokens_per_s": t.record["throughput/tokens_per_s"], "reward_mean": t.record["reward/mean"]}
                    for t in trainer.traces]
    return out


def print_table(res: dict) -> None:
    print(f"\nEnd-to-end GRPO, tiny model on CPU ({res['rows_per_step']} rows/step, disaggregated, torch_threads 1, "
          f"{res['rounds']} alternated pairs after a warm-up pair, seed {res['seed']}; {res['machine']['cpus']} CPUs, "
          f"torch {res['machine']['torch']}, ray {res['machine']['ray']})\n")
    print(f"  {'mode':<13} {'median step s':>13} {'tokens/s':>9} {'weight sync s':>13} {'speedup':>8}")
    for name, m in res["modes"].items():
        sp = f"{res['speedup']:.3f}" if name == "non-blocking" else "1.000"
        print(f"  {name:<13} {m['median_step_s']:>13.3f} {m['tokens_per_s']:>9.0f} {m['weight_sync_s']:>13.3f} "
              f"{sp:>8}")
    print("\n  busy time per stage (median s per step: its compute, summed over micro-batches)")
    names = tuple(next(iter(res["modes"].values()))["busy_s"])
    print("  " + " ".join(f"{s:>17}" for s in ("mode",) + names))
    for name, m in res["modes"].items():
        print("  " + f"{name:>17} " + " ".join(f"{m['busy_s'][s]:>17.3f}" for s in names))
    print(f"\nspeedup (blocking / non-blocking step time): {res['speedup']:.3f}; total wall {res['wall_s']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 measured pairs instead of 20")
    p.add_argument("--rounds", type=int, default=None, help="measured (blocking, non-blocking) pairs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = p.parse_args()
    res = run(args.rounds or (8 if args.quick else 20), args.seed)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
