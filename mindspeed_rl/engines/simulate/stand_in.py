"""What the simulate backend stands in for (`Backend.stand_in`): the run's engines and compute MFCs.

The trainer asks this module, through the registry (`registry.stand_in`), how to declare each engine
(`declare`: no model, no model features, the costs of its calls) and what each compute MFC without an
engine runs instead of its function (`compute_args`: `simulated_compute` with the stage's cost). A
worker builds what it is told and never learns that it simulates.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, NamedTuple

import torch

from ...dataflow import MFCDef

BACKEND = "simulate"   # the registry rows whose stand-in this module is

# One small cell per row and output column: what a downstream stage waits for, not what it reads.
PLACEHOLDER = torch.zeros(1, dtype=torch.float32)


class Placeholders(NamedTuple):
    """A micro-batch's outputs under the cost model (the columns and metric sums a compute function returns)."""
    columns: dict[str, list]
    metrics: dict[str, float]


def simulated_compute(mfc: MFCDef, cost_s_per_row: float, metrics: Mapping[str, float] | None = None
                      ) -> Callable[[dict, list[int]], Placeholders]:
    """The MFC's compute under the cost model: sleep `len(rows) * cost`, push placeholders."""
    outputs = list(mfc.output_keys)
    extra = dict(metrics or {})

    def compute(batch: dict, rows: list[int]) -> Placeholders:
        if cost_s_per_row > 0:
            time.sleep(len(rows) * cost_s_per_row)
        return Placeholders({c: [PLACEHOLDER] * len(rows) for c in outputs}, dict(extra))
    return compute


def _costs(cfg: Any) -> Mapping[str, float]:
    return cfg.trainer.simulate_cost_s_per_row


def declare(cfg: Any, role: str, calls: Mapping[str, str]) -> dict[str, Any]:
    """The fields of an engine's declaration that simulation sets: the simulate backend, no model (so no
    tokenizer or model features either), and options with the seconds per row of each of its `calls`
    (call -> the MFC making it: `generate`, `log_probs`, `train`, ...); a rollout engine also gets
    trainer.simulate_generate_slots and _sigma (a serving engine's continuous batching)."""
    from ..registry import ROLLOUT_BACKENDS, TRAIN_BACKENDS
    t = cfg.trainer
    options: dict[str, Any] = {"costs": {call: float(_costs(cfg).get(mfc, 0.0)) for call, mfc in calls.items()}}
    if role == "rollout":
        options.update(slots=t.simulate_generate_slots, sigma=t.simulate_generate_sigma)
    row = (ROLLOUT_BACKENDS if role == "rollout" else TRAIN_BACKENDS)[BACKEND]
    return {"backend": row, "model_path": "", "features": {}, "options": options}


def compute_args(cfg: Any, mfc: MFCDef, args: Mapping[str, Any]) -> dict[str, Any]:
    """A compute MFC's arguments under simulation: its micro-batch size (`count`, from its own arguments) and
    `simulated_compute` with its stage's cost in place of its function (workers/impls.py `StandIn`)."""
    return {"count": args.get("count", 1), "stand_in": f"{__name__}:simulated_compute",
            "stand_in_args": {"cost_s_per_row": float(_costs(cfg).get(mfc.name, 0.0))}}
