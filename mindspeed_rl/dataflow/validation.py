"""Validation's graph: the part of an algorithm's graph that turns prompts into rewards.

Validation runs held-out prompts through the same MFCs that score training's rows (the rollout and
the reward stages), and nothing else: no log-probs, advantages or training. Those MFCs are the
producer of `rm_scores` and every MFC it depends on through data edges; `validation_graph` builds them
into a graph of their own with `build_graph`, so the validation dock's columns, consumers and order
come from it exactly as the step's do from the whole graph.
"""
from __future__ import annotations

import networkx as nx

from .graph import build_graph, data_graph, topological_order
from .mfc import InterfaceType

REWARD_COLUMN = "rm_scores"
READER = "validation"        # the driver's consumer of the validation dock: it reads the rewards per row
READ_COLUMNS = (REWARD_COLUMN, "response_length")


def validation_graph(g: nx.DiGraph) -> nx.DiGraph:
    """The graph of the MFCs that produce `rm_scores` from the dataset's columns in `g`.

    Raises ValueError when `g` has no `rm_scores` producer, or when one of those MFCs trains a model
    or reads no `responses` from a generate MFC (validation must change no weights and must sample).
    """
    order = topological_order(g)
    producer = next((m for m in order if REWARD_COLUMN in m.output_keys), None)
    if producer is None:
        raise ValueError(f"the graph has no MFC that writes {REWARD_COLUMN!r}; validation scores rollouts with the "
                         "run's reward, so it needs one")
    names = nx.ancestors(data_graph(g), producer.name) | {producer.name}
    mfcs = [m for m in order if m.name in names]
    kinds = {m.name: InterfaceType(m.interface_type) for m in mfcs}
    trains = [n for n, k in kinds.items() if k is InterfaceType.TRAIN_STEP]
    if trains:
        raise ValueError(f"the rewards depend on train MFCs {trains}; validation changes no weights")
    if not any(k is InterfaceType.GENERATE for k in kinds.values()):
        raise ValueError(f"no generate MFC feeds {producer.name!r}; validation samples responses to score")
    return build_graph(mfcs, g.graph["dataset_keys"])
