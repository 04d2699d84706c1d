"""Engines behind two abstract classes (`base.py`), built from one registry (`registry.py`).

The plan resolves each backend name once into the registry's row; a worker builds its engines from the
rows it is handed (`row.load().build(spec)`), and `make_rollout_engine` / `make_train_engine` build one
by name. Backend modules (hf, vllm, torch, fsdp, megatron, simulate) are imported when an engine of
theirs is built. The built-in engine classes are importable from here too (lazily, so importing the package
costs no backend), for a plugin that extends one and registers it under a name of its own:

    from mindspeed_rl.engines import TorchTrainEngine, register_train_backend

docs/engines.md lists the backends, what each supports and what was run where.
"""
from .base import (MicroBatch, ModelOutput, OptimConfig, Rollout, RolloutEngine, RolloutSpec, SamplingParams,
                   TrainEngine, TrainSpec)
from .deployment import Deployment, RankRole, Slice
from .registry import (ROLLOUT_BACKENDS, TRAIN_BACKENDS, make_rollout_engine, make_train_engine,
                       register_rollout_backend, register_train_backend)

# the built-in engine classes, by the name a plugin imports them under
_LAZY = {"HFRolloutEngine": "mindspeed_rl.engines.rollout.hf_rollout", "VLLMRolloutEngine": "mindspeed_rl.engines.rollout.vllm_rollout",
         "TorchTrainEngine": "mindspeed_rl.engines.train.torch_train", "FSDPTrainEngine": "mindspeed_rl.engines.train.fsdp_train",
         "MegatronTrainEngine": "mindspeed_rl.engines.train.megatron.engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mindspeed_rl.engines' has no attribute {name!r}")


__all__ = ["Deployment", "MicroBatch", "ModelOutput", "OptimConfig", "ROLLOUT_BACKENDS", "RankRole", "Rollout",
           "RolloutEngine", "RolloutSpec", "SamplingParams", "Slice", "TRAIN_BACKENDS", "TrainEngine", "TrainSpec",
           "make_rollout_engine", "make_train_engine", "register_rollout_backend", "register_train_backend",
           *_LAZY]
