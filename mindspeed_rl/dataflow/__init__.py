"""The algorithm as data: MFCs (model function calls) and the dataflow graph built from them.

An RL algorithm is a list of `MFCDef`; `build_graph` turns it into a checked networkx graph, and
the trainer derives the dock's columns and consumers, the stage order, the worker groups and the
weight-sync points from that graph. `draw` renders it (SVG, or PNG with matplotlib). `metrics` lists
the step metrics the stages' reports make, and how each is shown.
"""
from .dataset import DATASET_KEYS
from .graph import (build_graph, data_graph, dataset_readers, describe, dock_columns, dock_consumers,
                    same_step_readers, topological_order, train_time_mfcs, trained_models, version_edges,
                    weight_sync_targets, worker_groups)
from .grpo import DATASET_KEYS as GRPO_DATASET_KEYS
from .grpo import grpo_mfcs
from .mfc import InterfaceType, MFCDef
from .options import AlgorithmOptions, options_from_config, uses_kl_loss
from .registry import ALGORITHMS, algorithm_graph, get_algorithm, known_algorithms, register_algorithm

__all__ = [
    "InterfaceType", "MFCDef",
    "build_graph", "data_graph", "topological_order", "dock_columns", "dock_consumers",
    "dataset_readers", "version_edges", "trained_models", "weight_sync_targets", "same_step_readers", "train_time_mfcs",
    "worker_groups", "describe",
    "DATASET_KEYS", "grpo_mfcs", "GRPO_DATASET_KEYS",
    "ALGORITHMS", "register_algorithm", "known_algorithms", "get_algorithm", "algorithm_graph",
    "AlgorithmOptions", "options_from_config", "uses_kl_loss",
]
