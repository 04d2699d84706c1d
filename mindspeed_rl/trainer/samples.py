"""What the model answers, where a person reads it: each validation's prompts, responses, answers and
rewards, and a few of each training step's, as JSON lines under `<output_dir>/samples/`, in the dashboard and
report, and as a W&B table when `trainer.logger` has wandb (verl's `log_val_generations`, TRL's
`log_completions`).

The rule reward decodes every row it scores anyway (workers/steps/rule_reward.py `rule_reward`), so it hands the text
back with its stage report; nothing is decoded twice. With a reward model and no rule there is no text.
"""
from __future__ import annotations

import json
from pathlib import Path

SAMPLES_DIR = "samples"
TRAIN_FILE = "train.jsonl"


def report_samples(reports: list[dict]) -> list[dict]:
    """The samples the stage reports carry, in row order."""
    rows = [s for r in reports for s in r.get("samples", ())]
    return sorted(rows, key=lambda s: s["row"])


def _append(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


class SampleLog:
    """Writes the samples of training steps (`per_step` of each, the first rows) and of validations (all)."""

    def __init__(self, output_dir: str, per_step: int, dashboard=None, trackers=(), resume_step: int = 0):
        self.dir = Path(output_dir) / SAMPLES_DIR
        self.per_step = int(per_step)
        self.dashboard = dashboard
        self.trackers = list(trackers)
        train = self.dir / TRAIN_FILE
        if train.exists():  # a resumed run keeps the steps before its checkpoint; a fresh run starts anew
            kept = [line for line in train.read_text(encoding="utf-8").splitlines()
                    if resume_step and line.strip() and json.loads(line).get("step", 0) < resume_step]
            train.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def training(self, step: int, reports: list[dict]) -> list[dict]:
        if self.per_step <= 0:
            return []
        rows = [{"step": step, **s} for s in report_samples(reports)[:self.per_step]]
        self._publish("train", step, rows, self.dir / TRAIN_FILE)
        return rows

    def validation(self, step: int, weight_version: int, reports: list[dict]) -> list[dict]:
        rows = [{"weight_version": weight_version, **s} for s in report_samples(reports)]
        path = self.dir / f"val_v{weight_version:05d}.jsonl"
        path.unlink(missing_ok=True)   # the same weights validated again (a resumed run) replace the file
        self._publish("val", step, rows, path)
        return rows

    def _publish(self, kind: str, step: int, rows: list[dict], path: Path) -> None:
        if not rows:
            return
        _append(path, rows)
        if self.dashboard is not None:
            self.dashboard.add_samples(kind, rows)
        for tracker in self.trackers:
            log = getattr(tracker, "log_samples", None)
            if log is not None:
                log(kind, step, rows)
