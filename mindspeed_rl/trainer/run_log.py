"""What a user sees of a run: one console line per step, metrics.jsonl, TensorBoard, Weights & Biases,
MLflow, the reward curve.

Every logger gets the same record under the same names (metrics.jsonl's keys); wandb and mlflow are
optional extras (`pip install -e .[wandb]`, `.[mlflow]`), imported only when `trainer.logger` names them
(the config check refuses a missing one before Ray starts).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dataflow.metrics import console_metrics

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


@dataclass
class RunInfo:
    """What an experiment tracker files a run under: trainer.project_name, experiment_name, tags, and the
    run's whole config (wandb's run config, mlflow's params)."""
    project: str = "mindspeed_rl"
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cfg) -> "RunInfo":
        t = cfg.trainer
        name = t.experiment_name or Path(os.path.abspath(t.output_dir)).name
        return cls(project=t.project_name, name=name, tags=[str(x) for x in t.tags], config=dataclasses.asdict(cfg))


def _numbers(record: dict) -> dict[str, float]:
    """The record's finite numbers but the step itself (checksums are strings)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class WandbLogger:
    """A Weights & Biases run in `<output_dir>/wandb/`: every record's keys but `step` (strings too), at
    wandb step = the record's step. `WANDB_MODE=offline` (wandb's own switch) writes it without a network, for
    `wandb sync` later. A resumed run is a new wandb run under the same name. wandb's console capture is off:
    the terminal stays the run's own."""

    def __init__(self, directory: Path, info: RunInfo):
        import wandb
        self.run = wandb.init(project=info.project, name=info.name, tags=info.tags or None, config=info.config,
                              dir=str(directory), settings=wandb.Settings(console="off"))

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def log_samples(self, kind: str, step: int, rows: list[dict]) -> None:
        """A table of what the model answered (`samples/train` or `samples/val`), committed with the next
        record: a step of its own could run ahead of the records' steps, which wandb drops."""
        import wandb
        columns = [c for c in ("step", "weight_version", "prompt", "response", "answer", "reward") if c in rows[0]]
        table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self.run.log({f"samples/{kind}": table}, commit=False)

    def close(self) -> None:
        self.run.finish()


def mlflow_name(key: str) -> str:
    """`key` as MLflow accepts a metric name (letters, digits, `_ - . / : space`): `@` becomes `_at_`
    (`val/pass@1` -> `val/pass_at_1`), any other character it refuses `_`. Names it accepts are unchanged."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


class MlflowLogger:
    """An MLflow run: the experiment `project_name`, the run `experiment_name`, each tag a run tag, the config
    as params (`section.key`), each record's numbers as metrics at its step. The tracking store is
    `MLFLOW_TRACKING_URI` when set, else a local file store in `<output_dir>/mlruns` (`mlflow ui
    --backend-store-uri <output_dir>/mlruns`)."""

    MAX_PARAMS = 100   # per log_batch call (MLflow's limit)

    def __init__(self, directory: Path, info: RunInfo):
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (directory / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):   # MLflow 3 keeps its file store behind this switch; it is what we ask for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(info.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(info.project)
        run = self.client.create_run(experiment_id, run_name=info.name)
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, tags=[RunTag(t, "true") for t in info.tags])
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(info.config).items()]
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS])

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        step = int(record["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), float(v), now, step)
                                                    for k, v in _numbers(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


TRACKERS = {"wandb": WandbLogger, "mlflow": MlflowLogger}


class RunLog:
    def __init__(self, output_dir: str, loggers: list[str], resume_step: int | None = None,
                 info: RunInfo | None = None):
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
        self.trackers = [TRACKERS[name](self.dir, info or RunInfo()) for name in TRACKERS if name in self.loggers]

    def log(self, record: dict) -> str:
        self.history.append(record)
        if "jsonl" in self.loggers:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in _numbers(record).items():
                self.tensorboard.add_scalar(key, value, global_step=record["step"])
            self.tensorboard.flush()
        for tracker in self.trackers:
            tracker.log(record)
        return format_line(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def format_line(rec: dict) -> str:
    """The console line of a record: the step, then each registered metric with a console label
    (dataflow/metrics.py) that the record holds."""
    parts = [f"step {rec['step']:>4}"]
    for key, label, fmt in console_metrics():
        if key in rec:
            parts.append(f"{label} {format(rec[key], fmt)}")
    return " | ".join(parts)


def plot_curve(history: list[dict], path: str | os.PathLike, title: str = "") -> str | None:
    """The step metrics registered with `curve` (dataflow/metrics.py), one panel each, per step, as a PNG
    (None when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from ..dataflow.metrics import curve_metrics
    keys = curve_metrics()
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot(steps, [r.get(key, float("nan")) for r in history])
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
