"""One config over several seeds: each seed a training run of its own, then the spread of the learning.

    python benchmarks/seed_spread.py --config-name grpo_tiny --seeds 1-5 --steps 300 --at 39,59 \\
        --json benchmarks/results/grpo_tiny.json [key=value ...]

Each seed runs `python cli/train_<algorithm>.py --config-name NAME trainer.seed=N trainer.total_steps=STEPS
trainer.output_dir=<--out>/seed_N ...` (the entry point picked from the config's `rl_config.algorithm`, or
`--cli`), one run at a time, with the dashboard, progress bar and figure off and no checkpoints; extra
arguments are passed on as Hydra overrides. Per seed it reports, from the run's `metrics.jsonl`
(benchmarks/learning_curves.py): `--metric` (default `reward/mean`) over the first and last 10 steps,
the step where its 10-step mean first reaches `--target`, the 10-step mean ending at each `--at` step (what
a run shortened to that many steps + 1 would end at), the run's wall time (Ray's start included) and the
sum of its step times; then min / median / max over the seeds. The JSON names the command, the
commit (`git rev-parse --short HEAD`, `-dirty` when the tree has uncommitted changes) and the machine
(CPUs, CPU model, load average before and after each run). `--also KEY` adds another metric's last-10
mean and its sum over the run (`dynamic_sampling/short`: the steps the cap ended short). Runs are
deterministic per seed with `rl_config.guarantee_order: true`; the times depend on the machine's load.

A seed whose output directory already holds a finished run of this command (`seed_spread.json` written
after the run, with the same command) is read, not run again; `--rerun` runs it anyway.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_curves as lc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI_OF_ALGORITHM = {"grpo": "train_grpo", "ppo": "train_ppo", "remax": "train_remax",
                    "reward_modeling": "train_rm"}
# Off for every seed: what only a person watching needs, and checkpoints (the HF export at the end stays).
QUIET = ("trainer.dashboard=false", "trainer.progress=false", "trainer.plot=false", "trainer.report=false",
         "trainer.save_interval=0", "trainer.overwrite=true")


def parse_seeds(text: str) -> list[int]:
    """`1-5`, `1,3,7`, `1-3,9` -> the seeds in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            rng = range(int(lo), int(hi) + 1) if dash else [int(lo)]
        except ValueError:
            raise SystemExit(f"--seeds {text!r}: give seeds as 1-5, 1,3,7 or 1-3,9") from None
        seeds += [s for s in rng if s not in seeds]
    if not seeds:
        raise SystemExit(f"--seeds {text!r}: no seed")
    return seeds


def parse_steps(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def cli_for(config_name: str, configs: Path = REPO / "configs") -> str:
    """The entry point of the config's `rl_config.algorithm` (grpo when it sets none)."""
    import yaml
    path = configs / f"{config_name}.yaml"
    if not path.is_file():
        raise SystemExit(f"--config-name {config_name}: no {path}")
    algorithm = ((yaml.safe_load(path.read_text()) or {}).get("rl_config") or {}).get("algorithm", "grpo")
    if algorithm not in CLI_OF_ALGORITHM:
        raise SystemExit(f"{path}: rl_config.algorithm={algorithm!r} has no entry point here; give --cli")
    return CLI_OF_ALGORITHM[algorithm]


def seed_command(cli: str, config_name: str, seed: int, steps: int, out_dir: Path, overrides: list[str]) -> list[str]:
    """The argv of one seed's run. The overrides come last, so they win over the quiet defaults."""
    return ([sys.executable, f"cli/{cli}.py", "--config-name", config_name, f"trainer.seed={seed}",
             f"trainer.total_steps={steps}", f"trainer.output_dir={out_dir}", *QUIET, *overrides])


def spread(values: list) -> dict:
    """min / median / max; None counts as larger than any number (a run that never reached the target)."""
    key = lambda v: (v is None, v if v is not None else 0)  # noqa: E731
    vals = sorted(values, key=key)
    n = len(vals)
    if n == 0:
        return {"min": None, "median": None, "max": None}
    if n % 2:
        mid = vals[n // 2]
    else:
        a, b = vals[n // 2 - 1], vals[n // 2]
        mid = None if a is None or b is None else round((a + b) / 2, 3)
    return {"min": vals[0], "median": mid, "max": vals[-1]}


def seed_row(seed: int, rows: list[dict], metric: str, target: float, at: list[int], wall_s: float | None,
             also: list[str] = ()) -> dict:
    s = lc.summarize(rows, target, metric)
    values = [r[metric] for r in rows if metric in r]
    row = {"seed": seed, "first10": s["reward_first10"], "last10": s["reward_last10"],
           "reaches_target_at": s["reaches_target_at_step"]}
    dense = len(values) == len(rows)  # every step records it (a reward), or only some (an evaluation)
    for step in at:
        row[f"mean10_at_{step}"] = lc.mean_at(values, step) if dense else lc.mean_at_step(rows, metric, step)
    for key in also:  # another metric: its last-10 mean and its sum over the run (a count, for a 0/1 flag)
        vals = [r[key] for r in rows if key in r]
        row[f"{key}_last10"] = round(sum(vals[-10:]) / len(vals[-10:]), 3) if vals else None
        row[f"{key}_sum"] = round(sum(vals), 3) if vals else None
    row.update({"steps": s["steps"], "wall_s": wall_s, "steps_s": s["steps_s"]})
    return row


def summary_rows(rows: list[dict]) -> dict[str, dict]:
    """Per numeric column (not the seed): its spread over the seeds."""
    cols = [k for k in rows[0] if k != "seed"]
    return {c: spread([r.get(c) for r in rows]) for c in cols}


def fmt(v) -> str:
    return "never" if v is None else str(v)


def table(rows: list[dict], spreads: dict[str, dict]) -> list[str]:
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    for stat in ("min", "median", "max"):
        out.append(f"| {stat} | " + " | ".join(fmt(spreads[c][stat]) for c in cols[1:]) + " |")
    return out


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "host": platform.node()}


def run_seed(cmd: list[str], out_dir: Path, rerun: bool, log) -> dict:
    """Run one seed (or read its earlier run of the same command) -> its record: command, commit, times, load."""
    record_path = out_dir / "seed_spread.json"
    command = shlex.join(cmd[1:])  # without the interpreter's path
    if not rerun and record_path.is_file():
        rec = json.loads(record_path.read_text())
        if rec.get("command") == command and (out_dir / "metrics.jsonl").is_file():
            log(f"{out_dir}: finished run of this command at {rec.get('commit')}: read, not run again")
            return rec
    load_before, at_commit = os.getloadavg()[0], commit()  # the code the run starts with
    log(f"$ {command}")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = round(time.time() - t0, 1)
    if proc.returncode != 0:
        raise SystemExit(f"seed run failed (exit {proc.returncode}): {command}\n{proc.stderr[-3000:]}")
    rec = {"command": command, "commit": at_commit, "wall_s": wall, "load_before": round(load_before, 2),
           "load_after": round(os.getloadavg()[0], 2), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record_path.write_text(json.dumps(rec, indent=1))
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="extra arguments: Hydra overrides passed to every seed's run")
    ap.add_argument("--config-name", required=True)
    ap.add_argument("--seeds", default="1-5")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--cli", help="train_grpo, train_ppo, train_remax or train_rm (default: by rl_config.algorithm)")
    ap.add_argument("--metric", default="reward/mean", help="the metrics.jsonl key to summarise")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--at", help="steps (0-based, comma-separated) at which to report the 10-step mean")
    ap.add_argument("--also", action="append", default=[], help="another metrics.jsonl key: its last-10 mean and sum")
    ap.add_argument("--out", help="the seeds' output directories go under here (default outputs/seed_spread/NAME)")
    ap.add_argument("--json", help="write the table, the spread, the commit and the machine here")
    ap.add_argument("--rerun", action="store_true", help="run seeds whose finished runs are there again")
    args, overrides = ap.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        raise SystemExit(f"unknown options {unknown}; Hydra overrides are key=value")
    seeds, at = parse_seeds(args.seeds), parse_steps(args.at)
    cli = args.cli or cli_for(args.config_name)
    root = Path(args.out or REPO / "outputs" / "seed_spread" / args.config_name).resolve()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows, runs = [], {}
    for seed in seeds:
        out_dir = root / f"seed_{seed}"
        rec = run_seed(seed_command(cli, args.config_name, seed, args.steps, out_dir, overrides), out_dir,
                       args.rerun, log)
        runs[seed] = rec
        rows.append(seed_row(seed, lc.load(out_dir), args.metric, args.target, at, rec["wall_s"], args.also))
    spreads = summary_rows(rows)
    commits = sorted({r["commit"] for r in runs.values()})
    head = (f"{args.config_name}, {len(seeds)} seeds, {args.steps} steps, {args.metric} (10-step means; "
            f"target {args.target}); commit {', '.join(commits)}; {machine()['nproc']} CPUs")
    print(head)
    print("\n".join(table(rows, spreads)))
    result = {"config_name": args.config_name, "cli": cli, "overrides": overrides, "steps": args.steps,
              "metric": args.metric, "target": args.target, "seeds": seeds, "commits": commits,
              "command": shlex.join(["python", "benchmarks/seed_spread.py", *(argv if argv is not None
                                                                             else sys.argv[1:])]),
              "machine": machine(), "runs": {str(k): v for k, v in runs.items()}, "rows": rows, "spread": spreads}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
