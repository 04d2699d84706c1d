"""Algorithms by name: name -> (function of `AlgorithmOptions` returning its MFCs, its dataset keys).

A new algorithm is one module with its MFC list and one `register_algorithm` line: here for a
built-in, in a module named in `trainer.plugins` for a user's (the plan imports plugins before it
looks the name up). Without options (a name alone, as `cli/visualize_dfg.py grpo` asks) the full
graph is built; a config's graph is `algorithm_graph(name, options_from_config(cfg))`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import networkx as nx

from .dataset import DATASET_KEYS
from .graph import build_graph
from .grpo import grpo_mfcs
from .mfc import MFCDef
from .options import FULL, AlgorithmOptions
from .ppo import ppo_mfcs
from .remax import remax_mfcs
from .rollout_options import gate_keys, with_gate, with_loss_mask
from .reward_modeling import DATASET_KEYS as REWARD_MODELING_DATASET_KEYS
from .reward_modeling import reward_modeling_mfcs

MakeMFCs = Callable[[AlgorithmOptions], list[MFCDef]]
ALGORITHMS: dict[str, tuple[MakeMFCs, tuple[str, ...]]] = {}


def register_algorithm(name: str, make_mfcs: MakeMFCs, dataset_keys: Sequence[str] = DATASET_KEYS) -> None:
    """Add (or replace) the algorithm `name` (`rl_config.algorithm`, case-insensitive): `make_mfcs(options)`
    returns its MFC list, `dataset_keys` are the columns the dataset puts into the dock (the prompt
    datasets' by default). The graph is checked when an algorithm is built, not here."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_algorithm: name={name!r} must be a non-empty string such as 'grpo'")
    if not callable(make_mfcs):
        raise TypeError(f"register_algorithm({name!r}): make_mfcs={make_mfcs!r} must be a function of "
                        "AlgorithmOptions returning a list of MFCDef")
    if isinstance(dataset_keys, str) or not all(isinstance(k, str) and k for k in dataset_keys):
        raise ValueError(f"register_algorithm({name!r}): dataset_keys={dataset_keys!r} must be a sequence of "
                         "column names, e.g. ('prompts', 'prompt_length', 'labels')")
    ALGORITHMS[name.strip().lower()] = (make_mfcs, tuple(dataset_keys))


register_algorithm("grpo", grpo_mfcs)
register_algorithm("ppo", ppo_mfcs)
register_algorithm("remax", remax_mfcs)
register_algorithm("reward_modeling", reward_modeling_mfcs, REWARD_MODELING_DATASET_KEYS)


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
