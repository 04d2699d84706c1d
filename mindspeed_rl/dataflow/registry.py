"""Algorithms by name: name -> (function of `AlgorithmOptions` returning its MFCs, its dataset keys).

A new algorithm is one module with its MFC list and one entry here. Without options (a name
alone, as `cli/visualize_dfg.py grpo` asks) the full graph is built; a config's graph is
`algorithm_graph(name, options_from_config(cfg))`.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from .graph import build_graph
from .grpo import DATASET_KEYS as GRPO_DATASET_KEYS
from .grpo import grpo_mfcs
from .mfc import MFCDef
from .options import FULL, AlgorithmOptions
from .ppo import DATASET_KEYS as PPO_DATASET_KEYS
from .ppo import ppo_mfcs
from .remax import DATASET_KEYS as REMAX_DATASET_KEYS
from .remax import remax_mfcs
from .rollout_options import gate_keys, with_gate, with_loss_mask
from .reward_modeling import DATASET_KEYS as REWARD_MODELING_DATASET_KEYS
from .reward_modeling import reward_modeling_mfcs

ALGORITHMS: dict[str, tuple[Callable[[AlgorithmOptions], list[MFCDef]], tuple[str, ...]]] = {
    "grpo": (grpo_mfcs, GRPO_DATASET_KEYS),
    "ppo": (ppo_mfcs, PPO_DATASET_KEYS),
    "remax": (remax_mfcs, REMAX_DATASET_KEYS),
    "reward_modeling": (reward_modeling_mfcs, REWARD_MODELING_DATASET_KEYS),
}


def known_algorithms() -> list[str]:
    """Names of the registered algorithms, sorted."""
    return sorted(ALGORITHMS)


def get_algorithm(name: str, options: AlgorithmOptions = FULL) -> tuple[list[MFCDef], tuple[str, ...]]:
    """(a fresh list of the algorithm's MFCs under `options`, its dataset keys). Names are case-insensitive."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known algorithms: {', '.join(known_algorithms())}")
    make_mfcs, dataset_keys = ALGORITHMS[key]
    mfcs = make_mfcs(options)
    if options.loss_mask or options.agent:  # the agent rollout and dynamic sampling (rollout_options.py)
        mfcs = with_loss_mask(mfcs, options.agent)
    if options.dynamic_sampling:
        mfcs = with_gate(mfcs)
    return mfcs, tuple(dataset_keys) + gate_keys(options.dynamic_sampling)


def algorithm_graph(name: str, options: AlgorithmOptions = FULL) -> nx.DiGraph:
    """The checked dataflow graph of a registered algorithm (graph attribute ``name`` is set)."""
    mfcs, dataset_keys = get_algorithm(name, options)
    g = build_graph(mfcs, dataset_keys)
    g.graph["name"] = name.strip().lower()
    return g
