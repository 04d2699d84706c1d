"""The algorithm's dataflow graph, built from its list of MFCs, and everything derived from it.

`build_graph` turns a list of `MFCDef` into a `networkx.DiGraph`:

* **nodes** are MFC names; node attribute ``mfc`` holds the `MFCDef`;
* **data edges** (``kind="data"``, ``keys=(...)``) go from the MFC that produces a key to every MFC
  that reads it. They say what must exist before a stage can run on a row, and they must form a DAG.
  Keys that come from the dataset have no producer MFC and make no edge;
* **version edges** (``kind="version"``, ``model=X``) go from the last MFC of a trained model X to
  its first MFC, in data-topological order: the first call to X in step i+1 must see the weights
  that the last call to X left in step i. A model with no ``train_step`` MFC (e.g. a frozen
  reference model) never changes, so it gets no version edge. A model whose only MFC is its train
  step gets a self-loop.

Graph attributes: ``dataset_keys`` (tuple) and ``mfcs`` (list in the given order).

The functions below the builder are pure views of the graph. The trainer reads the dock's columns
and consumers, the blocking order, the weight-sync points and the worker groups from them, so an
algorithm is written once, as its list of MFCs.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import networkx as nx

from .mfc import InterfaceType, MFCDef

__all__ = [
    "build_graph", "data_graph", "topological_order", "dock_columns", "dock_consumers",
    "dataset_readers", "version_edges", "trained_models", "weight_sync_targets",
    "same_step_readers", "worker_groups", "describe",
]


def _names(items: Iterable[str]) -> str:
    return ", ".join(repr(x) for x in items)


def build_graph(mfcs: Sequence[MFCDef], dataset_keys: Sequence[str] = ("prompts",)) -> nx.DiGraph:
    """Build and check the dataflow graph of an algorithm given as a list of MFCs.

    `dataset_keys` are the columns the dataset puts into the dock before any MFC runs.
    Raises ValueError (naming the MFCs and keys involved) for: an empty list, duplicate MFC names, an
    MFC with no inputs, a key produced twice (by two MFCs, or by an MFC and the dataset), a key that
    nothing produces, a cycle in the data edges, a model with more than one train_step MFC, or MFCs
    in one worker group with different dp_size.
    """
    mfcs, dataset_keys = _check_lists(mfcs, dataset_keys)
    producer = _producers(mfcs, dataset_keys)
    _check_inputs(mfcs, producer, dataset_keys)
    g = nx.DiGraph(dataset_keys=dataset_keys, mfcs=mfcs)
    for mfc in mfcs:
        g.add_node(mfc.name, mfc=mfc)
    edge_keys: dict[tuple[str, str], set[str]] = {}
    for mfc in mfcs:
        for key in mfc.input_keys:
            if key in producer:
                edge_keys.setdefault((producer[key], mfc.name), set()).add(key)
    for (src, dst), keys in edge_keys.items():
        g.add_edge(src, dst, kind="data", keys=tuple(sorted(keys)))
    _check_acyclic(g)
    trained = trained_models(g)
    order = topological_order(g)
    for model in trained:
        calls = [m.name for m in order if m.model_name == model]
        g.add_edge(calls[-1], calls[0], kind="version", model=model)
    worker_groups(g)  # checks that colocated MFCs agree on dp_size
    return g


def _check_lists(mfcs: Sequence[MFCDef], dataset_keys: Sequence[str]) -> tuple[list[MFCDef], tuple[str, ...]]:
    """The MFCs as a non-empty list of uniquely named MFCDefs that each read something, the dataset keys as a
    tuple of distinct names."""
    mfcs = list(mfcs)
    if not mfcs:
        raise ValueError("build_graph: the list of MFCs is empty; an algorithm needs at least one MFC")
    for i, mfc in enumerate(mfcs):
        if not isinstance(mfc, MFCDef):
            raise TypeError(f"build_graph: item {i} is {type(mfc).__name__} {mfc!r}, not an MFCDef")
    if isinstance(dataset_keys, str):
        raise ValueError(f"build_graph: dataset_keys={dataset_keys!r} is a single string; "
                         f"write dataset_keys=({dataset_keys!r},)")
    dataset_keys = tuple(dataset_keys)
    dup_dataset = sorted({k for k in dataset_keys if dataset_keys.count(k) > 1})
    if dup_dataset:
        raise ValueError(f"build_graph: dataset_keys={dataset_keys!r} lists {_names(dup_dataset)} more "
                         f"than once; list each key once")
    positions: dict[str, int] = {}
    for i, mfc in enumerate(mfcs):
        if mfc.name in positions:
            raise ValueError(f"build_graph: two MFCs are named {mfc.name!r} (positions "
                             f"{positions[mfc.name]} and {i}); MFC names must be unique")
        positions[mfc.name] = i
    no_inputs = [m.name for m in mfcs if not m.input_keys]
    if no_inputs:
        raise ValueError(f"build_graph: MFC(s) {_names(no_inputs)} have no input_keys; every MFC must "
                         f"read at least one key (e.g. 'prompts' from the dataset), otherwise it has "
                         f"no rows to run on")
    return mfcs, dataset_keys


def _producers(mfcs: list[MFCDef], dataset_keys: tuple[str, ...]) -> dict[str, str]:
    """column -> the one MFC that writes it (a column has one producer: an MFC or the dataset)."""
    producer: dict[str, str] = {}
    for mfc in mfcs:
        for key in mfc.output_keys:
            if key in dataset_keys:
                raise ValueError(f"build_graph: key {key!r} is produced by MFC {mfc.name!r} and is also a "
                                 f"dataset key; a column has one producer: rename the MFC's output or "
                                 f"drop {key!r} from dataset_keys")
            if key in producer:
                raise ValueError(f"build_graph: key {key!r} is produced by both MFC {producer[key]!r} and "
                                 f"MFC {mfc.name!r}; a column has one producer: rename one of the outputs")
            producer[key] = mfc.name
    return producer


def _check_inputs(mfcs: list[MFCDef], producer: dict[str, str], dataset_keys: tuple[str, ...]) -> None:
    """Everything an MFC reads is produced by an MFC or the dataset."""
    missing: dict[str, list[str]] = {}
    for mfc in mfcs:
        for key in mfc.input_keys:
            if key not in producer and key not in dataset_keys:
                missing.setdefault(key, []).append(mfc.name)
    if missing:
        lines = "; ".join(f"key {key!r} read by MFC(s) {_names(readers)}" for key, readers in missing.items())
        raise ValueError(f"build_graph: {lines}: no MFC produces it and it is not a dataset key "
                         f"(dataset keys: {_names(dataset_keys) or 'none'}); add it to the output_keys of "
                         f"the MFC that computes it or to dataset_keys")


def _check_acyclic(g: nx.DiGraph) -> None:
    """The data edges form no cycle: each MFC reads only what earlier ones wrote."""
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    path = " -> ".join([cycle[0][0]] + [dst for _, dst in cycle])
    detail = "; ".join(f"{src} -> {dst} via {_names(g.edges[src, dst]['keys'])}" for src, dst in cycle)
    raise ValueError(f"build_graph: the data edges form a cycle {path} ({detail}); each MFC must only "
                     f"read keys produced earlier in the step: break the cycle by reading the value "
                     f"from the dataset or from an earlier MFC")


def data_graph(g: nx.DiGraph) -> nx.DiGraph:
    """A read-only view of `g` with the data edges only (a DAG).

    Why: the version edges close cycles across steps; within a step, only data edges order MFCs.
    """
    return nx.subgraph_view(g, filter_edge=lambda u, v: g.edges[u, v]["kind"] == "data")


def _position(g: nx.DiGraph) -> dict[str, int]:
    return {m.name: i for i, m in enumerate(g.graph["mfcs"])}


def topological_order(g: nx.DiGraph) -> list[MFCDef]:
    """The MFCs in data-topological order, ties broken by the order they were listed.

    Why: with ``blocking: true`` the driver runs the stages one after another in this order; it is
    also the order that defines "first" and "last" call of a model within a step.
    """
    pos = _position(g)
    names = nx.lexicographical_topological_sort(data_graph(g), key=pos.__getitem__)
    return [g.nodes[n]["mfc"] for n in names]


def dock_columns(g: nx.DiGraph) -> list[str]:
    """The dock's columns: the dataset keys, then each MFC's output keys in topological order.

    Why: every value that moves between stages lives in exactly one dock column, and the graph
    guarantees that each column has one producer, so this list has no duplicates.
    """
    columns = list(g.graph["dataset_keys"])
    for mfc in topological_order(g):
        columns.extend(k for k in mfc.output_keys if k not in columns)
    return columns


def dock_consumers(g: nx.DiGraph) -> list[str]:
    """The dock's consumers: one per MFC (its name), in topological order.

    Why: each stage pulls rows from the dock independently, so the dock tracks per MFC which rows
    it has taken; an MFC's name is its consumer name.
    """
    return [m.name for m in topological_order(g)]


def dataset_readers(g: nx.DiGraph) -> dict[str, tuple[str, ...]]:
    """MFC name -> the dataset keys it reads (MFCs reading none are left out), in topological order.

    Why: dataset keys have no producer MFC and so no data edge; pictures and listings show them as
    edges from a "dataset" source.
    """
    ds = set(g.graph["dataset_keys"])
    out = {}
    for mfc in topological_order(g):
        keys = tuple(sorted(k for k in mfc.input_keys if k in ds))
        if keys:
            out[mfc.name] = keys
    return out


def version_edges(g: nx.DiGraph) -> list[tuple[str, str, str]]:
    """(last MFC, first MFC, model) for every trained model, in order of the model's train MFC.

    Why: these are the cross-step dependencies: before step i+1's first call to a trained model,
    the weights that step i's last call left must be in place (a weight sync when the calls run in
    different worker groups). A frozen model (no train_step MFC) has none.
    """
    edges = [(u, v, d["model"]) for u, v, d in g.edges(data=True) if d["kind"] == "version"]
    train_pos = {model: i for i, model in enumerate(trained_models(g))}
    return sorted(edges, key=lambda e: train_pos[e[2]])


def trained_models(g: nx.DiGraph) -> dict[str, str]:
    """model_name -> name of its train_step MFC, in topological order.

    Why: a trained model's weights change every step, which makes its version edge, its weight
    sync and its checkpoint. One model has at most one train_step MFC (ValueError otherwise).
    """
    out: dict[str, str] = {}
    for mfc in topological_order(g):
        if mfc.is_trainable:
            if mfc.model_name in out:
                raise ValueError(f"model {mfc.model_name!r} has two train_step MFCs, "
                                 f"{out[mfc.model_name]!r} and {mfc.name!r}; a model is trained by one "
                                 f"MFC: merge the two losses into one train_step MFC")
            out[mfc.model_name] = mfc.name
    return out


def weight_sync_targets(g: nx.DiGraph) -> dict[str, list[str]]:
    """model_name -> the other MFCs (topological order) that call that trained model.

    Why: after the train MFC's optimizer steps, each of these must get the new weights before it
    next runs (e.g. the rollout engine of the actor). Models that are never trained are left out;
    a trained model with no other MFC maps to an empty list.
    """
    order = topological_order(g)
    return {model: [m.name for m in order if m.model_name == model and m.name != train]
            for model, train in trained_models(g).items()}


def same_step_readers(g: nx.DiGraph, train_mfc_name: str) -> list[str]:
    """The MFCs of the train MFC's model that come before it in the step (topological order).

    Why: they read the weights the step started with (e.g. ``actor_rollout`` generates and
    ``actor_log_prob`` computes old log-probs with them), so the train MFC must not apply an
    optimizer update until they have finished the step's rows; otherwise a late micro-batch would be
    computed with new weights. MFCs of the model after the train MFC read the updated weights and
    are not listed.
    """
    if train_mfc_name not in g:
        raise ValueError(f"same_step_readers: no MFC named {train_mfc_name!r}; MFCs: {_names(g.nodes)}")
    train = g.nodes[train_mfc_name]["mfc"]
    if not train.is_trainable:
        raise ValueError(f"same_step_readers: MFC {train_mfc_name!r} is {train.interface_type.value!r}, not "
                         f"train_step; trained MFCs: {_names(trained_models(g).values()) or 'none'}")
    readers = []
    for mfc in topological_order(g):
        if mfc.name == train_mfc_name:
            break
        if mfc.model_name == train.model_name:
            readers.append(mfc.name)
    return readers


def train_time_mfcs(g: nx.DiGraph) -> list[str]:
    """The MFCs that must run when their step is trained, not ahead of it (in topological order).

    Why: with `rl_config.max_weight_staleness` k > 0, the stages of step t+k run while step t trains.
    Generation may use weights up to k versions old (the loss corrects for that from
    `rollout_log_prob`); so may rewards, a frozen reference and anything else that reads no trained
    model. But an inference MFC of a trained model (old log-probs: the proximal policy; a critic's
    values) must read the weights the step is trained from, and so must everything downstream of it
    in the step (PPO's advantages read the values), and the train MFCs themselves.
    """
    trained = set(trained_models(g))
    seeds = [m.name for m in topological_order(g) if m.model_name in trained
             and m.interface_type in (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
    later = set(seeds)
    data = data_graph(g)
    for name in seeds:
        later |= nx.descendants(data, name)
    return [m.name for m in topological_order(g) if m.name in later]


def worker_groups(g: nx.DiGraph) -> dict[str, list[str]]:
    """worker group name -> the MFCs it runs (topological order), groups in order of first MFC.

    Why: the trainer starts one group of workers per entry; MFCs sharing a group are colocated and
    must agree on dp_size (ValueError otherwise).
    """
    groups: dict[str, list[MFCDef]] = {}
    for mfc in topological_order(g):
        groups.setdefault(mfc.worker_group_name, []).append(mfc)
    for group, members in groups.items():
        sizes = {m.dp_size for m in members}
        if len(sizes) > 1:
            detail = ", ".join(f"{m.name!r} dp_size={m.dp_size}" for m in members)
            raise ValueError(f"worker group {group!r} runs MFCs with different dp_size ({detail}); "
                             f"MFCs in one group share its workers: give them the same dp_size")
    return {group: [m.name for m in members] for group, members in groups.items()}


def describe(g: nx.DiGraph) -> str:
    """A readable text listing of the graph (printed by dry runs and the visualize CLI)."""
    order = topological_order(g)
    title = g.graph.get("name")
    lines = [f"dataflow graph{' ' + repr(title) if title else ''}: {len(order)} MFCs; "
             f"dataset keys: {', '.join(g.graph['dataset_keys'])}"]
    lines.append("MFCs in order (blocking mode):")
    width = max(len(m.name) for m in order)
    mwidth = max(len(m.model_name) for m in order)
    for i, m in enumerate(order, 1):
        extra = []
        if m.worker_group is not None:
            extra.append(f"group={m.worker_group}")
        if m.dp_size != 1:
            extra.append(f"dp={m.dp_size}")
        if m.get_n_samples:
            extra.append("whole prompt groups")
        if m.micro_batch_size is not None:
            extra.append(f"mbs={m.micro_batch_size}")
        lines.append(f"  {i}. {m.name:<{width}}  {m.model_name:<{mwidth}}  {m.interface_type.value:<10}  "
                     f"in: {', '.join(m.input_keys)}  -> out: {', '.join(m.output_keys) or '-'}"
                     + (f"  [{'; '.join(extra)}]" if extra else ""))
    lines.append("data edges:")
    for name, keys in dataset_readers(g).items():
        lines.append(f"  dataset -> {name}: {', '.join(keys)}")
    pos = {m.name: i for i, m in enumerate(order)}
    data = sorted(((u, v, d["keys"]) for u, v, d in g.edges(data=True) if d["kind"] == "data"),
                  key=lambda e: (pos[e[0]], pos[e[1]]))
    for u, v, keys in data:
        lines.append(f"  {u} -> {v}: {', '.join(keys)}")
    lines.append("version edges (weights left by step i -> first call in step i+1):")
    vedges = version_edges(g)
    for u, v, model in vedges:
        lines.append(f"  {u} -> {v}: weights of {model}{' (self-loop)' if u == v else ''}")
    if not vedges:
        lines.append("  none (no model is trained)")
    lines.append(f"dock columns: {', '.join(dock_columns(g))}")
    lines.append(f"dock consumers: {', '.join(dock_consumers(g))}")
    for model, targets in weight_sync_targets(g).items():
        train = trained_models(g)[model]
        lines.append(f"weight sync after {train}: {', '.join(targets) or 'none'}; "
                     f"same-step readers: {', '.join(same_step_readers(g, train)) or 'none'}")
    return "\n".join(lines)
