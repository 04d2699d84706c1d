"""From config to a checked plan: the dataflow graph, the worker groups and their resources.

Everything here runs before any worker starts, so a bad config fails in a second with a message
that names the key, the value and the fix. The plan is also what `trainer.dry_run=true` prints.
`make_plan` takes its decisions in order, each in its own function: the graph, its stages, the
backends, the worker groups (plan_groups.py), the sizes and paths (plan_checks.py), the groups'
deployments (plan_backends.py), the notes and the memory; plan_format.py prints and writes the result.
"""
from __future__ import annotations

import networkx as nx

from ..config import Config, ConfigError, check_config
from ..dataflow import (MFCDef, algorithm_graph, dock_columns, dock_consumers, get_algorithm, options_from_config,
                        same_step_readers, train_time_mfcs, topological_order, trained_models, weight_sync_targets)
from ..dataflow.options import off_policy_correction, on_policy_update
from ..engines.registry import Backend
from ..parallel import PlacementPlan
from .memory import plan_memory
from .plan_backends import (check_group_backends, check_installed, check_own_process, check_partial_rollout,
                            check_rollout_model, check_rollout_refusals, check_rollout_split, choose_backends,
                            deploy_groups)
from .plan_checks import (check_cluster, check_collective_devices, check_dataset, check_dynamic_sampling_groups,
                          check_lora_targets, check_model_paths, check_names, check_sizes, check_stages, check_tokenizer,
                          model_paths_of)
from .plan_format import format_plan, landed_dict, plan_dict, write_plan_json
from .plan_groups import mesh_groups, preset_groups, worker_groups
from .plan_types import MODEL_ENGINES, GroupPlan, Plan, generates, model_mfc

__all__ = ["GroupPlan", "MODEL_ENGINES", "Plan", "check_cluster", "format_plan", "make_plan", "mesh_groups",
           "landed_dict", "plan_dict", "preset_groups", "write_plan_json"]


def make_plan(cfg: Config, check_files: bool = True) -> Plan:
    """Validate `cfg` and derive everything the trainer needs; raises ConfigError.

    The graph comes first: the config decides which stages exist (no KL term, no reference stage:
    `options_from_config`), and only the sections of the graph's models are validated. The backends are
    resolved once into the registry's rows, which the groups keep.
    """
    graph, order, dataset_keys = _algorithm(cfg)
    functions = check_stages(cfg, order)
    rollout, train = choose_backends(cfg)
    placement, groups, fold_notes = worker_groups(cfg, order, rollout, check_files)
    size_notes = check_sizes(cfg, groups, order, functions)
    model_paths = model_paths_of(cfg, order)
    trained = trained_models(graph)
    model_kinds = {m.name: functions[m.name].engine for m in order}
    deploy_notes = _deploy(cfg, groups, model_kinds, model_paths, trained, (rollout, train), check_files)
    notes = ([f"engines: rollout {rollout.name}, training {train.name}"] + fold_notes + deploy_notes
             + _run_notes(cfg, graph, order))
    notes += _check_inputs(cfg, graph, order, functions, model_paths, trained, check_files)
    if placement is not None:
        notes += _mesh_notes(cfg, placement, order, rollout, check_files)
    rows = cfg.rl_config.prompts_per_step * cfg.rl_config.n_samples_per_prompt
    by_name = {m.name: m for m in order}
    late = train_time_mfcs(graph)
    return Plan(graph=graph, order=order, columns=dock_columns(graph), consumers=dock_consumers(graph),
                dataset_keys=tuple(dataset_keys), groups=groups, trained=trained,
                sync_targets=weight_sync_targets(graph),
                same_step_outputs={t: [k for r in same_step_readers(graph, t) for k in by_name[r].output_keys]
                                   for t in trained.values()},
                model_paths=model_paths, rows_per_step=rows, notes=notes, placement=placement,
                size_notes=size_notes, ahead=tuple(m.name for m in order if m.name not in late),
                tokenizer_model="reward" if "reward" in trained else "actor",
                memory=plan_memory(cfg, groups, model_kinds, model_paths, rows))


def _algorithm(cfg: Config) -> tuple[nx.DiGraph, list[MFCDef], tuple[str, ...]]:
    """The plugins imported, then the algorithm's graph in stage order and its dataset keys; the config's
    sections validated (only those of the graph's models and the chosen backends' options)."""
    from ..engines.registry import import_plugins, option_sections
    try:  # first: a plugin may register the backends and functions the rest of the config names
        import_plugins(cfg.trainer.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from ..algorithms import OFF_POLICY_CORRECTIONS
    if off_policy_correction(cfg) not in OFF_POLICY_CORRECTIONS:
        raise ConfigError(f"actor_config.off_policy_correction={cfg.actor_config.off_policy_correction!r}: must be one "
                          f"of {list(OFF_POLICY_CORRECTIONS)} or null (docs/async.md)")
    if cfg.actor_config.recompute_log_prob is False and not on_policy_update(cfg):
        raise ConfigError("actor_config.recompute_log_prob=false: this config's rows feed several optimizer steps or "
                          "come from older weights (ppo_mini_batch_size < rl_config.prompts_per_step, "
                          "max_weight_staleness > 0, dynamic sampling or an off-policy correction), so the loss needs "
                          "the log-probs from before the update; set it to null or true")
    rl = cfg.rl_config
    options = options_from_config(cfg)
    try:
        mfcs, dataset_keys = get_algorithm(rl.algorithm, options)
        graph = algorithm_graph(rl.algorithm, options)
    except ValueError as e:
        check_config(cfg)  # value problems first, with every section: a bad algorithm name must not hide them
        raise ConfigError(f"rl_config.algorithm={rl.algorithm!r}: {e}") from None
    check_config(cfg, models={m.model_name for m in mfcs}, option_sections=option_sections(cfg))
    return graph, topological_order(graph), tuple(dataset_keys)


def _deploy(cfg: Config, groups: dict[str, GroupPlan], model_kinds: dict[str, str], model_paths: dict[str, str],
            trained: dict[str, str], backends: tuple[Backend, Backend], check_files: bool) -> list[str]:
    """The groups' deployments on the chosen backends and what those backends must be able to run there;
    a real run also checks the packages and the models. Returns the deployments' notes."""
    rollout, train = backends
    check_own_process(rollout, groups)
    if cfg.rl_config.dynamic_sampling:
        check_dynamic_sampling_groups(cfg, groups, model_kinds)
    notes = deploy_groups(cfg, groups, model_kinds, rollout, train, check_files)
    check_collective_devices(groups)
    check_partial_rollout(cfg, groups)
    check_rollout_refusals(cfg, groups)
    check_group_backends(cfg, groups, model_kinds, model_paths, train, check_files)
    check_lora_targets(cfg, model_paths, trained)
    if check_files:  # a backend's package missing: said once the placement is known good
        check_installed(rollout, train)
        check_rollout_model(cfg, rollout, [p for p in groups.values() if any(generates(m) for m in p.mfcs)])
    return notes


def _run_notes(cfg: Config, graph: nx.DiGraph, order: list[MFCDef]) -> list[str]:
    """What the run does differently from a plain one: stages running ahead (staleness), sleeping compute."""
    rl, notes = cfg.rl_config, []
    if rl.max_weight_staleness:
        late = train_time_mfcs(graph)
        notes.append(f"max_weight_staleness={rl.max_weight_staleness}: {[m.name for m in order if m.name not in late]} "
                     f"run up to {rl.max_weight_staleness} steps ahead of training, {late} at their step's turn")
    if rl.partial_rollout and cfg.actor_config.off_policy_correction == "none":
        notes.append("WARNING: rl_config.partial_rollout=true with actor_config.off_policy_correction=none: rows whose "
                     "tokens came from two weight versions are trained as if one policy sampled them; null (tis) "
                     "weighs each token by its own behaviour log-prob")
    if cfg.trainer.simulate_cost_s_per_row:
        notes.append("sleeping compute (trainer.simulate_cost_s_per_row): the simulate backend's engines and the "
                     "compute stages sleep per row; no models are loaded")
    return notes


def _check_inputs(cfg: Config, graph: nx.DiGraph, order: list[MFCDef], functions: dict, model_paths: dict[str, str],
                  trained: dict[str, str], check_files: bool) -> list[str]:
    """The run's inputs: model paths and data (a real run opens them), the reward function's and tools' names,
    the validation stages. Returns the dry run's note that it opened none."""
    notes = []
    if check_files:
        check_model_paths(cfg, order, model_paths, trained)
        if any(generates(m) for m in order):
            check_tokenizer(cfg, model_paths)
    else:
        notes.append("dry run: model and data paths were not opened")
    check_names(cfg, order, functions, check_files)
    if check_files:
        check_dataset(cfg)
    from .validation import check_validation
    check_validation(cfg, graph, check_files)   # the stages it runs; data.val_dataset's file (trainer/validation.py)
    return notes


def _mesh_notes(cfg: Config, placement: PlacementPlan, order: list[MFCDef], rollout: Backend,
                check_files: bool) -> list[str]:
    """placement.mode=mesh: the splits a real run refuses, said as notes of a dry run's plan."""
    by_name = {m.name: m for m in order}
    split = {n: p for n, p in placement.placements.items() if (p.tp > 1 or p.pp > 1) and n in by_name}
    notes = []
    strategies = {n: p.strategy for n, p in split.items() if not model_mfc(by_name[n])}
    if strategies:
        notes.append(f"placement.mfcs with tp or pp > 1 ({strategies}): planned, not run; a compute MFC runs no "
                     "model, so a real run stops before any worker starts")
    if not check_files:
        try:
            check_rollout_split(cfg, rollout, {n: p for n, p in split.items() if generates(by_name[n])})
        except ConfigError as e:
            notes.append(f"planned, not run: {e}")
    return notes
