"""What a user sees of a run: one console line per step, metrics.jsonl, TensorBoard, the reward curve."""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

CONSOLE_KEYS = (("reward/mean", "reward", ".3f"), ("reward/rule_mean", "rule", ".3f"), ("reward/model_mean", "model", "+.3f"),
                ("reward/loss", "rm_loss", ".4f"), ("reward/accuracy", "rm_acc", ".3f"), ("eval/accuracy", "eval_acc", ".3f"),
                ("actor/pg_loss", "pg_loss", "+.4f"), ("actor/kl", "kl", ".4f"),
                ("actor/entropy", "entropy", ".3f"), ("response_length/mean", "resp_len", ".2f"),
                ("timing/step", "step_s", ".2f"), ("throughput/tokens_per_s", "tok/s", ".0f"),
                ("val/reward_mean", "val_reward", ".3f"), ("val/pass@1", "val_pass@1", ".3f"))


class MetricsFileError(ValueError):
    """metrics.jsonl is damaged where a crash cannot have done it (not its last line)."""


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, for a resume.

    A driver killed while appending a record leaves a torn last line: it is dropped with a warning
    (that step is re-run anyway, its checkpoint came before it). A bad line anywhere else is not
    what a kill does, so the resume is refused, naming the file and the line.
    """
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                warnings.warn(f"{path}: dropped its last line {number}, cut short ({e.msg}): the run was killed "
                              "while writing it", RuntimeWarning, stacklevel=2)
                break
            raise MetricsFileError(f"{path} line {number} is not JSON ({e.msg} at column {e.colno}) and it is not "
                                   f"the last line, so it was not torn by a killed run; fix or delete that line, or "
                                   "move the file away to resume without the earlier steps' metrics") from None
    return records


class RunLog:
    def __init__(self, output_dir: str, loggers: list[str], resume_step: int | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.loggers = set(loggers)
        self.path = self.dir / "metrics.jsonl"
        self.history: list[dict] = []
        if self.path.exists():
            # a resumed run keeps the steps before its checkpoint; a fresh run starts a new file
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) < resume_step] if resume_step else []
            self.history = kept
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.tensorboard = None
        if "tensorboard" in self.loggers:  # imported only when asked for: it takes seconds
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run drops the events it logged after its checkpoint, as metrics.jsonl does
            self.tensorboard = SummaryWriter(str(self.dir / "tensorboard"), purge_step=resume_step or None)

    def log(self, record: dict) -> str:
        self.history.append(record)
        if "jsonl" in self.loggers:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():  # every number but the step itself (checksums are strings)
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, global_step=record["step"])
            self.tensorboard.flush()
        return format_line(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def format_line(rec: dict) -> str:
    parts = [f"step {rec['step']:>4}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in rec:
            parts.append(f"{label} {format(rec[key], fmt)}")
    return " | ".join(parts)


def plot_curve(history: list[dict], path: str | os.PathLike, title: str = "") -> str | None:
    """reward/mean and actor/pg_loss per step as a PNG (None when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(steps, [r.get("reward/mean", float("nan")) for r in history], color="tab:green")
    axes[0].set_title("reward/mean")
    axes[0].set_xlabel("step")
    axes[0].set_ylim(0, 1.05)
    axes[0].grid(alpha=0.3)
    axes[1].plot(steps, [r.get("timing/step", float("nan")) for r in history], color="tab:blue")
    axes[1].set_title("timing/step (s)")
    axes[1].set_xlabel("step")
    axes[1].grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
