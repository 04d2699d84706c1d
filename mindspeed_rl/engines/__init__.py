"""Engines behind two abstract classes (`base.py`), built by name from one registry (`registry.py`).

Workers import only this package's interfaces and `make_rollout_engine` / `make_train_engine`;
backend modules (hf, vllm, torch, fsdp, simulate) are imported when an engine of theirs is built.
docs/engines.md lists the backends, what each supports and what was run where.
"""
from .base import (MicroBatch, ModelOutput, OptimConfig, Rollout, RolloutEngine, RolloutSpec, SamplingParams,
                   TrainEngine, TrainSpec)
from .registry import ROLLOUT_BACKENDS, TRAIN_BACKENDS, make_rollout_engine, make_train_engine

__all__ = ["MicroBatch", "ModelOutput", "OptimConfig", "ROLLOUT_BACKENDS", "Rollout", "RolloutEngine", "RolloutSpec",
           "SamplingParams", "TRAIN_BACKENDS", "TrainEngine", "TrainSpec", "make_rollout_engine",
           "make_train_engine"]
