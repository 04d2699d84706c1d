"""Engines behind small interfaces: `hf` rollout and `torch` training run on any device here.

vLLM rollout and Megatron training are to come behind the same interfaces (`base.py`)."""
from .base import RolloutEngine, SamplingParams, TrainEngine
from .hf_rollout import HFRolloutEngine
from .torch_train import OptimConfig, TorchTrainEngine

__all__ = ["HFRolloutEngine", "OptimConfig", "RolloutEngine", "SamplingParams", "TorchTrainEngine", "TrainEngine"]
