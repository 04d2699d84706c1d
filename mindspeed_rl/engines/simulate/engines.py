"""The simulate backend's engines: they sleep a configured time per row instead of running a model.

`spec.options["costs"]` maps what an engine is asked to do to seconds per row: `generate`,
`generate_greedy` (rollout); `log_probs`, `values`, `train` (train engines). Their outputs are
one-token placeholders; `stand_in.declare` fills the costs from trainer.simulate_cost_s_per_row.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator, Sequence

import torch

from ..base import Bucket, LossFn, MicroBatch, NamedTensors, Rollout, RolloutEngine, RolloutSpec, SamplingParams
from ..base import TrainEngine, TrainSpec

PLACEHOLDER_TOKEN = torch.tensor([2], dtype=torch.long)
PLACEHOLDER_LOGP = torch.zeros(1, dtype=torch.float32)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class SimulatedRolloutEngine(RolloutEngine):
    """Without slots a call sleeps rows x cost, one call at a time (a server that decodes one row after
    another, whatever step the rows are of). With
    `slots` S it is a serving engine with continuous batching: S rows decode at once, each for
    cost x S x its own factor (a mean-1 lognormal of spread `sigma`, drawn from the row's seed:
    long-tailed response lengths), a row starting when a slot frees up, whichever call it came in;
    a call returns when its last row ends. One call alone then lasts as long as its longest row (a
    synchronous batch waits for it); calls of several steps at once fill each other's idle slots."""
    concurrent_generate = True  # sleeping calls overlap, as requests do in a serving engine
    partial_rollout = True      # its weights are a version number: rows in flight go on at once on the new one

    def __init__(self, costs: dict[str, float], slots: int = 0, sigma: float = 0.0):
        import threading
        self.costs = dict(costs)
        self.slots, self.sigma = int(slots), float(sigma)
        self.weight_version = 0
        self._free = [0.0] * self.slots   # when each slot is next free (time.monotonic)
        self._lock = threading.Lock()

    @classmethod
    def build(cls, spec: RolloutSpec) -> "SimulatedRolloutEngine":
        o = spec.options
        return cls(o.get("costs", {}), o.get("slots", 0), o.get("sigma", 0.0))

    def row_factor(self, seed: int) -> float:
        """The row's cost factor: exp(sigma z - sigma^2 / 2), z ~ N(0, 1) from its seed (mean 1)."""
        if not self.sigma:
            return 1.0
        import numpy as np
        z = float(np.random.default_rng(int(seed)).standard_normal())
        return float(np.exp(self.sigma * z - self.sigma ** 2 / 2))

    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> Rollout:
        import heapq
        cost = self.costs.get("generate_greedy" if params.greedy else "generate", 0.0)
        if not self.slots:  # one server: calls of several steps in flight queue for it
            with self._lock:
                _sleep(sum(cost * self.row_factor(s) for s in seeds))
        else:
            with self._lock:
                now, end = time.monotonic(), 0.0
                for s in seeds:
                    start = max(now, heapq.heappop(self._free))
                    finish = start + cost * self.slots * self.row_factor(s)
                    heapq.heappush(self._free, finish)
                    end = max(end, finish)
            _sleep(end - time.monotonic())
        return Rollout([PLACEHOLDER_TOKEN] * len(prompts), [PLACEHOLDER_LOGP] * len(prompts))

    def paused(self):
        """A serving engine's pause for a weight update lasts one decode step, which the cost model leaves out."""
        return contextlib.nullcontext()

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        for _ in named_tensors:
            pass
        self.weight_version = int(version)


class SimulatedTrainEngine(TrainEngine):
    """A train step sleeps per row of each micro-batch and counts as an optimizer step (`version`
    goes up), so weight versions and staleness behave as in a real run."""

    def __init__(self, costs: dict[str, float]):
        self.costs = dict(costs)
        self.version = 0

    @classmethod
    def build(cls, spec: TrainSpec) -> "SimulatedTrainEngine":
        return cls(spec.options.get("costs", {}))

    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        _sleep(len(prompts) * self.costs.get("log_probs", 0.0))
        return [PLACEHOLDER_LOGP] * len(prompts)

    def values(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        _sleep(len(prompts) * self.costs.get("values", 0.0))
        return [PLACEHOLDER_LOGP] * len(prompts)

    def train_step(self, micro_batches: Iterable[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        count = 0
        for mb in micro_batches:
            _sleep(len(mb.data["prompts"]) * self.costs.get("train", 0.0))
            count += 1
        self.version += 1
        return {"micro_batches": float(count), "grad_norm": 0.0}

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """One placeholder bucket: the sync's real path (groups, broadcast, readers' versions) still runs."""
        yield [("simulated.version", torch.tensor([self.version], dtype=torch.int64))]

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        for _ in named_tensors:
            pass
        self.version = int(version)

    def save_checkpoint(self, directory: str) -> list[str]:
        import os
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "engine.pt")
        torch.save({"version": self.version}, path)
        return [path]

    def load_checkpoint(self, directory: str) -> None:
        import os
        self.version = int(torch.load(os.path.join(directory, "engine.pt"))["version"])
