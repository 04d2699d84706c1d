"""A `Trainer` that alternates blocking and non-blocking steps in one run and keeps each step's trace.

Shared by `pipeline_efficiency.py` and `e2e_grpo.py`. Why alternate inside one run: the two modes
then share the workers, the dock, the warm caches and the machine's noise, so their ratio is
fair; with `guarantee_order` both modes compute the same numbers, so the run is one training run.
The step pipeline reads its `blocking` at every step (`StepPipeline.run`), so flipping it per step
runs the real driver in either mode. Nothing here changes what a step does: the trace is taken
around the driver's own calls, and the dock's event log is read after the step's time was taken.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from mindspeed_rl.trainer import Trainer


def abba_schedule(rounds: int, warmup: int = 1) -> list[bool]:
    """blocking flag per step: `warmup` pairs (B, NB), then rounds alternating (B, NB), (NB, B), ...

    ABBA order cancels a linear drift of the machine between the two modes."""
    out = [True, False] * warmup
    for r in range(rounds):
        out += [True, False] if r % 2 == 0 else [False, True]
    return out


@dataclass
class StepTrace:
    """What one step did: its mode, the driver's record, each stage's report, and wall-clock marks."""
    step: int
    blocking: bool
    record: dict
    reports: list[dict]
    stages_start: float          # time.time() around StepPipeline.run
    stages_end: float
    events: list[dict] = field(default_factory=list)  # the dock's event log entries of this step
    warmup: bool = False

    @property
    def step_s(self) -> float:
        return float(self.record["timing/step"])


class TracingTrainer(Trainer):
    """The real `Trainer`; step k runs in mode `schedule[k]` and leaves a `StepTrace`."""

    def __init__(self, cfg, schedule: list[bool], warmup_steps: int, read_events: bool = True):
        if len(schedule) != cfg.trainer.total_steps:
            raise ValueError(f"schedule has {len(schedule)} steps, trainer.total_steps={cfg.trainer.total_steps}")
        super().__init__(cfg)
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.read_events = read_events
        self.traces: list[StepTrace] = []
        self._pending: dict = {}
        self._seq = 0

    def train_step(self, step: int, bar=None) -> dict:
        self.pipeline.blocking = self.schedule[step]
        record = super().train_step(step, bar)
        events = []
        if self.read_events:  # after the step's time was taken: not in timing/step
            events = self.dock.get_event_log(self._seq)
            if events:
                self._seq = events[-1]["seq"]
        p = self._pending
        self.traces.append(StepTrace(step=step, blocking=self.schedule[step], record=record, reports=p["reports"],
                                     stages_start=p["start"], stages_end=p["end"], events=events,
                                     warmup=step < self.warmup_steps))
        return record

    def _start(self) -> None:
        super()._start()
        run = self.pipeline.run

        def traced(step: int, *args, **kwargs) -> list[dict]:  # the stages' span: around the pipeline's run
            t0 = time.time()
            reports = run(step, *args, **kwargs)
            self._pending = {"start": t0, "end": time.time(), "reports": reports}
            return reports
        self.pipeline.run = traced


def measured(traces: list[StepTrace], blocking: bool) -> list[StepTrace]:
    return [t for t in traces if t.blocking == blocking and not t.warmup]


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")
