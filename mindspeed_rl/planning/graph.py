"""The plan's first stage: the algorithm's dataflow graph as the config switches it on, in stage order, each
MFC's compute function checked against its declaration. Every later stage (backends, worker groups, memory)
decides per MFC of this graph, so a stage the config turns off (no KL term: no reference) is neither placed
nor loaded, and its model's section is not read."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import networkx as nx

from ..config import ActorConfig, ConfigError, RLConfig, TrainerConfig
from ..dataflow import MFCDef, algorithm_graph, get_algorithm, topological_order, train_time_mfcs, trained_models
from ..dataflow.mfc import InterfaceType
from ..dataflow.options import AlgorithmOptions, off_policy_correction, on_policy_update
from .keys import ALGORITHM_KEY, OFF_POLICY_KEY, PARTIAL_ROLLOUT_KEY, PROMPTS_PER_STEP_KEY, SIMULATE_KEY

MODEL_ENGINES = ("policy", "value", "reward")   # compute.FUNCTIONS' engine kinds that run on the train backend


def model_mfc(m: MFCDef) -> bool:
    """An MFC that runs a model (compute MFCs run none, so there is nothing to split)."""
    return InterfaceType(m.interface_type) is not InterfaceType.COMPUTE


def generates(m: MFCDef) -> bool:
    return InterfaceType(m.interface_type) is InterfaceType.GENERATE


@dataclass(frozen=True)
class AlgorithmGraph:
    """The graph stage's result: the graph, its MFCs in stage order, what each computes with and which
    models it trains."""
    graph: nx.DiGraph
    order: list[MFCDef]                 # topological: the blocking mode's stage order
    dataset_keys: tuple[str, ...]
    functions: dict                     # MFC -> its compute function (workers/compute.py), checked
    trained: dict[str, str]             # model -> its train MFC
    model_kinds: dict[str, str]         # MFC -> its function's engine kind (policy, value, reward, rollout or "")

    @property
    def by_name(self) -> dict[str, MFCDef]:
        return {m.name: m for m in self.order}

    def ahead(self) -> tuple[str, ...]:
        """The MFCs that may run ahead of their step's training (rl_config.max_weight_staleness)."""
        late = train_time_mfcs(self.graph)
        return tuple(m.name for m in self.order if m.name not in late)


def check_update_options(actor: ActorConfig, rl: RLConfig) -> None:
    """The update's options that decide the log-prob stages: a known off-policy correction, and the old
    log-probs recomputed wherever the loss needs them from before the update."""
    from ..algorithms import OFF_POLICY_CORRECTIONS
    update = SimpleNamespace(actor_config=actor, rl_config=rl)   # the two sections dataflow.options reads
    if off_policy_correction(update) not in OFF_POLICY_CORRECTIONS:
        raise ConfigError(f"{OFF_POLICY_KEY}={actor.off_policy_correction!r}: must be one "
                          f"of {list(OFF_POLICY_CORRECTIONS)} or null (docs/async.md)")
    if actor.recompute_log_prob is False and not on_policy_update(update):
        raise ConfigError("actor_config.recompute_log_prob=false: this config's rows feed several optimizer steps or "
                          f"come from older weights (ppo_mini_batch_size < {PROMPTS_PER_STEP_KEY}, "
                          "max_weight_staleness > 0, dynamic sampling or an off-policy correction), so the loss needs "
                          "the log-probs from before the update; set it to null or true")


def algorithm_of(algorithm: str, options: AlgorithmOptions) -> tuple[list[MFCDef], tuple[str, ...], nx.DiGraph]:
    """The registered algorithm's MFCs, dataset keys and graph under these options; ValueError for a name
    the registry lacks."""
    mfcs, dataset_keys = get_algorithm(algorithm, options)
    return mfcs, tuple(dataset_keys), algorithm_graph(algorithm, options)


def build_graph(graph: nx.DiGraph, dataset_keys: tuple[str, ...], rl: RLConfig,
                trainer: TrainerConfig) -> AlgorithmGraph:
    """The graph in stage order with its stages checked (`check_stages`)."""
    order = topological_order(graph)
    functions = check_stages(rl, trainer, order)
    return AlgorithmGraph(graph=graph, order=order, dataset_keys=dataset_keys, functions=functions,
                          trained=trained_models(graph), model_kinds={m.name: functions[m.name].engine for m in order})


def check_stages(rl: RLConfig, trainer: TrainerConfig, order: list[MFCDef]) -> dict:
    """Each MFC's compute function (workers/compute.py), checked against its declaration; the prompt groups a
    grouped algorithm compares; the stages trainer.simulate_cost_s_per_row names. Returns MFC -> function."""
    from ..workers.compute import check_mfc
    functions = {}
    for m in order:
        try:
            functions[m.name] = check_mfc(m)
        except ValueError as e:
            raise ConfigError(f"{ALGORITHM_KEY}={rl.algorithm!r}: {e}") from None
    grouped = [m.name for m in order if m.get_n_samples]
    if grouped and rl.n_samples_per_prompt < 2:
        raise ConfigError(f"rl_config.n_samples_per_prompt={rl.n_samples_per_prompt}: {rl.algorithm} compares the "
                          f"responses within a prompt's group (MFCs {grouped}), so it needs at least 2; set it to 2 "
                          "or more (8 is common)")
    names = [m.name for m in order]
    for stage, cost in trainer.simulate_cost_s_per_row.items():
        if stage not in names:
            raise ConfigError(f"{SIMULATE_KEY}.{stage}={cost!r}: no stage {stage!r} in the "
                              f"{rl.algorithm} graph; give seconds per row for stages among {names} "
                              "(a stage left out costs 0)")
    return functions


def run_notes(rl: RLConfig, actor: ActorConfig, trainer: TrainerConfig, graph: AlgorithmGraph) -> list[str]:
    """What the run does differently from a plain one: stages running ahead (staleness), sleeping compute."""
    notes = []
    if rl.max_weight_staleness:
        late = train_time_mfcs(graph.graph)
        notes.append(f"max_weight_staleness={rl.max_weight_staleness}: "
                     f"{[m.name for m in graph.order if m.name not in late]} "
                     f"run up to {rl.max_weight_staleness} steps ahead of training, {late} at their step's turn")
    if rl.partial_rollout and actor.off_policy_correction == "none":
        notes.append(f"WARNING: {PARTIAL_ROLLOUT_KEY}=true with {OFF_POLICY_KEY}=none: rows whose "
                     "tokens came from two weight versions are trained as if one policy sampled them; null (tis) "
                     "weighs each token by its own behaviour log-prob")
    if trainer.simulate_cost_s_per_row:
        notes.append(f"sleeping compute ({SIMULATE_KEY}): the simulate backend's engines and the "
                     "compute stages sleep per row; no models are loaded")
    return notes
