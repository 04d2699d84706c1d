"""Learning curves of finished runs, side by side: a table, a JSON summary and a figure.

    python benchmarks/learning_curves.py with-calc=outputs/grpo_tiny_tool \\
        no-tool=outputs/grpo_tiny_tool_notool --out docs/images/agent_tool_curves.png --json curves.json

Each argument is `label=output_dir` (a run's `trainer.output_dir`, read from its `metrics.jsonl`).
Reported per run: steps, the time the steps took (the sum of `timing/step`: without the start of
Ray and the workers, which the run's wall time adds), median step time,
`reward/mean` over the first and the last 10 steps, the step where its 10-step mean first reaches
`--target` (default 0.8), and the same for every `reward/<part>_mean` the reward logs (the tool
task's `call` and `answer`). This measures learning, not speed: runs compared for wall time must
have run alone on the machine (docs/agent.md says which did).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median


def load(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl there; give label=<a run's trainer.output_dir>")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rolling(values: list[float], window: int = 10) -> list[float]:
    """The mean of each value and the up to window-1 before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def first_reaching(values: list[float], target: float) -> int | None:
    curve = rolling(values)
    return next((i for i, v in enumerate(curve) if v >= target), None)


def mean_at(values: list[float], step: int, window: int = 10) -> float | None:
    """The mean of the window of values ending at index `step` (what a run stopped after step+1 values
    reports as its last-10 mean); None when the run is shorter."""
    return round(rolling(values, window)[step], 3) if 0 <= step < len(values) else None


def mean_at_step(rows: list[dict], metric: str, step: int, window: int = 10) -> float | None:
    """The mean of `metric` over the records of the `window` steps ending at step `step`: for a metric that
    only some steps record (reward modeling's eval/accuracy, every trainer.eval_interval steps), its value at
    that step; None when no record in the window holds it."""
    vals = [r[metric] for r in rows if metric in r and step - window < r["step"] <= step]
    return round(sum(vals) / len(vals), 3) if vals else None


def summarize(rows: list[dict], target: float, metric: str = "reward/mean") -> dict:
    """Per run: steps, step times, `metric` over the first and last 10 records that hold it and the record
    where its 10-record mean first reaches `target`, and the last-10 mean of every other reward part."""
    rewards = [r[metric] for r in rows if metric in r]
    if not rewards:
        raise SystemExit(f"no record holds {metric!r}; keys of the last one: {sorted(rows[-1]) if rows else []}")
    parts = sorted(k for k in rows[-1] if k.startswith("reward/") and k.endswith("_mean") and k != metric
                   and k != "reward/mean" and "penalty" not in k)
    steps_s = [r["timing/step"] for r in rows if "timing/step" in r]
    out = {"steps": len(rows), "steps_s": round(sum(steps_s), 1),
           "median_step_s": round(median(steps_s), 3) if steps_s else None,
           "reward_first10": round(sum(rewards[:10]) / len(rewards[:10]), 3),
           "reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
           "reaches_target_at_step": first_reaching(rewards, target)}
    for key in parts:
        vals = [r.get(key, 0.0) for r in rows]
        out[f"{key.split('/')[1]}_last10"] = round(sum(vals[-10:]) / len(vals[-10:]), 3)
    return out


def plot(runs: dict[str, list[dict]], out: Path, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, rows in runs.items():
        line, = ax.plot(rolling([r["reward/mean"] for r in rows]), label=f"{label}: reward")
        if "reward/answer_mean" in rows[-1] and "reward/call_mean" in rows[-1]:
            ax.plot(rolling([r["reward/answer_mean"] for r in rows]), ls="--", color=line.get_color(),
                    label=f"{label}: answer right (digits)")
    ax.axhline(target, color="k", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_title("reward, 10-step mean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="label=output_dir")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", help="the figure (png)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, eq, path = spec.partition("=")
        if not eq or not label:
            raise SystemExit(f"{spec!r}: give label=output_dir")
        runs[label] = load(path)
    summary = {label: summarize(rows, args.target) for label, rows in runs.items()}
    keys = list(dict.fromkeys(k for s in summary.values() for k in s))  # first seen first
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, s in summary.items():
        print(f"| {label} | " + " | ".join(str(s.get(k, "-")) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.out:
        plot(runs, Path(args.out), args.target)


if __name__ == "__main__":
    main()
