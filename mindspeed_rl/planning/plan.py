"""From config to a checked plan: the one place that reads the whole config and hands each stage its sections.

Everything here runs before any worker starts, so a bad config fails in a second with a message that names the
key, the value and the fix; the plan is also what `trainer.dry_run=true` prints. `make_plan` runs the stages in
order, each deciding from the results before it: the graph (graph.py), the backends (backends.py), the worker
groups and their sizes (groups.py, sizes.py), the groups' deployments (deployments.py), the run's inputs
(models.py, inputs.py) and the memory (memory.py); format.py prints and writes the result, and
trainer/worker_specs.py turns it into each worker's part when the run launches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..config import Config, ConfigError, check_config
from ..dataflow import (MFCDef, dock_columns, dock_consumers, options_from_config, same_step_readers,
                        weight_sync_targets)
from ..parallel import PlacementPlan
from .backends import choose_backends
from .deployments import deploy
from .graph import algorithm_of, build_graph, check_update_options, generates, run_notes
from .groups import GroupPlan, mesh_notes, worker_groups
from .inputs import check_dataset, check_names, check_tokenizer
from .keys import ALGORITHM_KEY, GROUPS_KEY
from .memory import MemoryPlan, plan_memory
from .models import ModelSections, check_model_paths, model_paths_of
from .sizes import check_sizes


@dataclass
class Plan:
    """What the run does and where: the graph's stages and columns, the worker groups with their deployments,
    the models' paths, the notes and the memory estimate."""
    graph: nx.DiGraph
    order: list[MFCDef]
    columns: list[str]
    consumers: list[str]
    dataset_keys: tuple[str, ...]
    groups: dict[str, GroupPlan]
    trained: dict[str, str]                       # model -> train MFC
    sync_targets: dict[str, list[str]]            # model -> MFCs reading it
    same_step_outputs: dict[str, list[str]]       # train MFC -> columns written by same-step readers
    model_paths: dict[str, str]
    rows_per_step: int
    notes: list[str] = field(default_factory=list)
    placement: PlacementPlan | None = None        # placement.mode=mesh: meshes, groups, devices
    size_notes: list[str] = field(default_factory=list)  # row sizes rounded to what they must divide
    ahead: tuple[str, ...] = ()                   # MFCs that may run ahead of their step's training (staleness)
    tokenizer_model: str = "actor"                # whose tokenizer the run tokenizes with (reward modeling: reward)
    memory: MemoryPlan | None = None              # bytes per device and MFC, checked against the devices (memory.py)

    def group_of(self, mfc_name: str) -> str:
        return next(g for g, p in self.groups.items() if any(m.name == mfc_name for m in p.mfcs))

    def resource_totals(self) -> dict[str, float]:
        from ..device import RAY_RESOURCES, group_resources
        tot = dict.fromkeys(RAY_RESOURCES.values(), 0.0)
        for p in self.groups.values():  # per device of the group: an engine-split actor holds tp of them
            n = p.resources.dp * p.tp * p.pp
            for res, amount in group_resources(p.resources).items():
                tot[res] += amount * n
        return tot


def model_sections(cfg: Config) -> ModelSections:
    """The models' own sections of a config."""
    return ModelSections(actor=cfg.actor_config, ref=cfg.ref_config, critic=cfg.critic_config,
                         reward=cfg.reward_model)


def make_plan(cfg: Config, check_files: bool = True) -> Plan:
    """Validate `cfg` and derive everything the trainer needs; raises ConfigError.

    The graph comes first: the config decides which stages exist (no KL term, no reference stage:
    `options_from_config`), and only the sections of the graph's models are checked. The backends are
    resolved once into the registry's rows, which the groups keep.
    """
    from ..engines.registry import backend_options, import_plugins, option_sections
    from ..trainer.validation import check_validation, validation_on
    try:  # first: a plugin may register the backends and functions the rest of the config names
        import_plugins(cfg.trainer.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rl, models = cfg.rl_config, model_sections(cfg)

    # the graph: the config's options switch its stages on, then only its models' sections are checked
    check_update_options(cfg.actor_config, rl)
    options = options_from_config(cfg)
    try:
        mfcs, dataset_keys, graph = algorithm_of(rl.algorithm, options)
    except ValueError as e:
        check_config(cfg)  # value problems first, with every section: a bad algorithm name must not hide them
        raise ConfigError(f"{ALGORITHM_KEY}={rl.algorithm!r}: {e}") from None
    check_config(cfg, models={m.model_name for m in mfcs}, option_sections=option_sections(cfg))
    algo = build_graph(graph, dataset_keys, rl, cfg.trainer)

    # the backends, the worker groups with their row sizes, the groups' deployments
    backends = choose_backends(cfg.generate_config, cfg.actor_config, cfg.trainer,
                               options_of=lambda row: backend_options(cfg, row))
    workers = worker_groups(cfg.placement, rl, models, cfg.trainer, algo.order, backends.rollout, check_files)
    groups = workers.groups
    size_notes = check_sizes(rl, models, cfg.generate_config, cfg.placement, groups, algo.order, algo.functions)
    model_paths = model_paths_of(models, algo.order)
    deployments = deploy(groups, algo, backends, model_paths, models, rl, cfg.trainer, check_files)
    notes = ([f"engines: rollout {backends.rollout.name}, training {backends.train.name}"] + workers.notes
             + deployments.notes + run_notes(rl, cfg.actor_config, cfg.trainer, algo))

    # the run's inputs: a real run opens the models and the data; the names the config gives exist
    if check_files:
        check_model_paths(models, algo.order, model_paths, algo.trained)
        if any(generates(m) for m in algo.order):
            check_tokenizer(cfg.actor_config, cfg.generate_config, cfg.data, model_paths)
    else:
        notes.append("dry run: model and data paths were not opened")
    check_names(rl, cfg.generate_config, algo.order, algo.functions, check_files)
    if check_files:
        check_dataset(cfg.data, rl, cfg.trainer)
    check_validation(cfg, graph, check_files)   # the stages it runs; data.val_dataset's file (trainer/validation.py)
    if workers.placement is not None:
        notes += mesh_notes(rl, workers.placement, algo.order, backends.rollout, check_files)

    # the memory each device holds, then the plan
    rows = rl.prompts_per_step * rl.n_samples_per_prompt
    memory = plan_memory(models, cfg.generate_config, rl, cfg.data, cfg.placement, validation_on(cfg), groups,
                         algo.model_kinds, model_paths, rows)
    by_name = algo.by_name
    return Plan(graph=graph, order=algo.order, columns=dock_columns(graph), consumers=dock_consumers(graph),
                dataset_keys=algo.dataset_keys, groups=groups, trained=algo.trained,
                sync_targets=weight_sync_targets(graph),
                same_step_outputs={t: [k for r in same_step_readers(graph, t) for k in by_name[r].output_keys]
                                   for t in algo.trained.values()},
                model_paths=model_paths, rows_per_step=rows, notes=notes, placement=workers.placement,
                size_notes=size_notes, ahead=algo.ahead(),
                tokenizer_model="reward" if "reward" in algo.trained else "actor", memory=memory)


def check_cluster(plan: Plan, available: dict[str, float]) -> None:
    """Fail fast, naming the groups and the numbers, when the plan does not fit the Ray cluster."""
    from ..device import RAY_RESOURCES
    need = plan.resource_totals()
    for res, amount in need.items():
        have = float(available.get(res, 0.0))
        if amount > have + 1e-9:
            field_ = {r_: f_ for f_, r_ in RAY_RESOURCES.items()}[res]
            detail = ", ".join(f"{g}: {getattr(p.resources, field_)} x "
                               + (f"dp {p.resources.dp}" if p.tp * p.pp == 1 else
                                  f"{p.resources.dp * p.tp * p.pp} ranks (dp*tp*pp {p.resources.dp}*{p.tp}*{p.pp})")
                               for g, p in plan.groups.items()
                               if getattr(p.resources, field_) > 0)
            more = ("give Ray more (placement.ray_num_cpus)" if res == "CPU" else
                    f"add {res}s or nodes to the Ray cluster")
            raise ConfigError(f"placement needs {amount:g} {res} ({detail}) but the Ray cluster has {have:g}; "
                              f"lower {GROUPS_KEY}.<name>.{field_} (fractions are fine), or {more}")
