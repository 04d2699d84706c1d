"""From config to a checked plan: the dataflow graph, the worker groups and their resources.

Everything here runs before any worker starts, so a bad config fails in a second with a message
that names the key, the value and the fix. The plan is also what `trainer.dry_run=true` prints.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import networkx as nx

from ..config import Config, ConfigError, GroupConfig, validate_config
from ..config.sizes import group_size_note, train_size_note
from ..dataflow import (MFCDef, algorithm_graph, dock_columns, dock_consumers, get_algorithm, options_from_config,
                        same_step_readers, train_time_mfcs, topological_order, trained_models, weight_sync_targets)
from ..dataflow.mfc import InterfaceType
from ..engines.deployment import Deployment, DeployError, Slice
from .memory import MemoryPlan, plan_memory
from .model_features import check_features
from ..parallel import ClusterSpec, PlacementPlan, plan_placement


@dataclass
class GroupPlan:
    name: str
    mfcs: list[MFCDef]
    resources: GroupConfig                  # resources.dp: the data-parallel replicas
    devices: list[int] = field(default_factory=list)  # placement.mode=mesh: the group's devices, topology order
    tp: int = 1                             # placement.mode=mesh: the tensor- and pipeline-parallel sizes of
    pp: int = 1                             # the group's slice (its backend's deployment decides the actors)
    deployment: Deployment | None = None    # what the backends make of the slice (engines/deployment.py)
    rollout_backend: str = ""               # the backend whose rollout engine generates here ("": none)
    train_backend: str = ""                 # the backend whose engines run the group's other models ("": none)
    rollout_options: dict = field(default_factory=dict)  # their options, checked by their dataclasses
    train_options: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        """The group's actors (ranks) as its deployment starts them."""
        return self.deployment.actors if self.deployment is not None else self.resources.dp

    def actor_devices(self, k: int) -> list[int]:
        """The mesh devices actor k holds ([] outside placement.mode=mesh)."""
        return list(self.deployment.actor_devices(k)) if self.deployment is not None else []

    def as_dict(self) -> dict:
        """The group as plan.json gives it."""
        r = self.resources
        dep = self.deployment.as_dict() if self.deployment is not None else {}
        return {"mfcs": [m.name for m in self.mfcs],
                "roles": sorted({f"{m.model_name}/{InterfaceType(m.interface_type).value}" for m in self.mfcs}),
                "rollout_backend": self.rollout_backend or None, "train_backend": self.train_backend or None,
                "rollout_options": self.rollout_options, "train_options": self.train_options,
                "dp": r.dp, "tp": self.tp, "pp": self.pp, "devices": list(self.devices), "device": r.device,
                "num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "num_npus": r.num_npus,
                "actors": self.world, "deployment": dep}


@dataclass
class Plan:
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


def preset_groups(mode: str, mfcs: list[MFCDef], rollout_own_process: bool = False) -> dict[str, list[str]]:
    """The worker groups a placement mode implies, derived from the MFCs' roles and types.

    colocated: every MFC that runs a model shares one integrated worker; CPU functions
    (reward, advantage) share a light one. disaggregated: generation alone, each model's other
    calls together (the trainer serves its own log-probs), CPU functions together. A rollout
    backend that must have its process to itself (vLLM) takes generation out of the integrated
    worker in colocated mode too.
    """
    groups: dict[str, list[str]] = {}
    for m in mfcs:
        kind = InterfaceType(m.interface_type)
        if kind is InterfaceType.COMPUTE:
            g = "rule"
        elif kind is InterfaceType.GENERATE and rollout_own_process:
            g = "rollout"
        elif mode == "colocated":
            g = "integrated"
        elif kind is InterfaceType.GENERATE:
            g = "rollout"
        else:
            g = m.model_name
        groups.setdefault(g, []).append(m.name)
    return groups


def engine_backends(cfg: Config, check_files: bool):
    """The registry's entries of the rollout and train backends a config runs; refuses a name the
    registry lacks, and (for a real run) a backend whose package is not installed, with the install
    command, before any worker starts."""
    from ..config.validate import installed
    from ..engines import registry
    for key, table, name in (("generate_config.backend", registry.ROLLOUT_BACKENDS, cfg.generate_config.backend),
                             ("actor_config.backend", registry.TRAIN_BACKENDS, cfg.actor_config.backend)):
        if name not in registry.user_backends(table):
            raise ConfigError(f"{key}={name!r}: must be one of {registry.user_backends(table)} (docs/engines.md)")
    rollout, train = registry.chosen_backends(cfg)
    for key, backend in (("generate_config.backend", registry.ROLLOUT_BACKENDS[rollout]),
                         ("actor_config.backend", registry.TRAIN_BACKENDS[train])):
        if check_files and backend.needs and not installed(backend.needs):
            raise ConfigError(f"{key}={backend.name}: the {backend.needs} package is not installed here; "
                              f"{backend.install}")
    return registry.ROLLOUT_BACKENDS[rollout], registry.TRAIN_BACKENDS[train]


def make_plan(cfg: Config, check_files: bool = True) -> Plan:
    """Validate `cfg` and derive everything the trainer needs; raises ConfigError.

    The graph comes first: the config decides which stages exist (no KL term, no reference stage:
    `options_from_config`), and only the sections of the graph's models are validated.
    """
    rl = cfg.rl_config
    from ..engines.registry import import_plugins
    try:  # first: a plugin may register the backends and functions the rest of the config names
        import_plugins(cfg.trainer.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from ..algorithms import OFF_POLICY_CORRECTIONS
    if cfg.actor_config.off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ConfigError(f"actor_config.off_policy_correction={cfg.actor_config.off_policy_correction!r}: must be one "
                          f"of {list(OFF_POLICY_CORRECTIONS)} (docs/async.md)")
    options = options_from_config(cfg)
    try:
        mfcs, dataset_keys = get_algorithm(rl.algorithm, options)
        graph = algorithm_graph(rl.algorithm, options)
    except ValueError as e:
        validate_config(cfg)  # value problems first, with every section: a bad algorithm name must not hide them
        raise ConfigError(f"rl_config.algorithm={rl.algorithm!r}: {e}") from None
    from ..engines.registry import option_sections
    validate_config(cfg, models={m.model_name for m in mfcs}, option_sections=option_sections(cfg))
    order = topological_order(graph)
    trained = trained_models(graph)
    by_name = {m.name: m for m in order}
    from ..workers.compute import check_mfc
    functions = {}
    for m in order:
        try:
            functions[m.name] = check_mfc(m)
        except ValueError as e:
            raise ConfigError(f"rl_config.algorithm={rl.algorithm!r}: {e}") from None
    grouped = [m.name for m in order if m.get_n_samples]
    if grouped and rl.n_samples_per_prompt < 2:
        raise ConfigError(f"rl_config.n_samples_per_prompt={rl.n_samples_per_prompt}: {rl.algorithm} compares the "
                          f"responses within a prompt's group (MFCs {grouped}), so it needs at least 2; set it to 2 "
                          "or more (8 is common)")
    for stage, cost in cfg.trainer.simulate_cost_s_per_row.items():
        if stage not in by_name:
            raise ConfigError(f"trainer.simulate_cost_s_per_row.{stage}={cost!r}: no stage {stage!r} in the "
                              f"{rl.algorithm} graph; give seconds per row for stages among {list(by_name)} "
                              "(a stage left out costs 0)")

    rollout_spec, train_spec = engine_backends(cfg, check_files=False)

    # worker groups: the mode's preset, then the config's groups (which may move MFCs or add resources)
    assign: dict[str, str] = {}
    placement, mesh_resources, mesh_devices, mesh_splits = None, {}, {}, {}
    if cfg.placement.mode == "mesh":
        placement, assign, mesh_resources, mesh_devices, mesh_splits = mesh_groups(cfg, order, check_files)
    elif cfg.placement.mode != "custom":
        for g, names in preset_groups(cfg.placement.mode, order, rollout_spec.own_process).items():
            for n in names:
                assign[n] = g
    resources: dict[str, GroupConfig] = dict(mesh_resources)
    claimed: dict[str, str] = {}
    for g, gc in cfg.placement.groups.items():
        for n in gc.mfcs:
            if n not in by_name:
                raise ConfigError(f"placement.groups.{g}.mfcs: unknown MFC {n!r}; the {rl.algorithm} graph has "
                                  f"{list(by_name)}")
            if n in claimed:
                raise ConfigError(f"placement.groups.{g}.mfcs: {n!r} is already in placement.groups.{claimed[n]}.mfcs;"
                                  " list each MFC in one group")
            claimed[n] = g
            assign[n] = g
        resources[g] = gc
    missing = [n for n in by_name if n not in assign]
    if missing:
        raise ConfigError(f"placement: MFCs {missing} are in no worker group; with placement.mode=custom list "
                          f"every MFC under placement.groups.<name>.mfcs")
    groups: dict[str, GroupPlan] = {}
    for m in order:
        g = assign[m.name]
        if g not in groups:
            res = dataclasses.replace(resources.get(g, GroupConfig()), mfcs=[])
            tp, pp = mesh_splits.get(g, (1, 1))
            groups[g] = GroupPlan(name=g, mfcs=[], resources=res, devices=list(mesh_devices.get(g, [])), tp=tp, pp=pp)
        groups[g].mfcs.append(m)
        groups[g].resources.mfcs.append(m.name)
    folded, fold_notes = _fold_own_process_group(cfg, order, rollout_spec, assign, groups)
    for g, gc in cfg.placement.groups.items():
        if g not in groups and not gc.mfcs and g not in folded:
            raise ConfigError(f"placement.groups.{g}: no such worker group in placement.mode="
                              f"{cfg.placement.mode!r} (groups: {list(groups)}); give it mfcs: [...] to create it")

    rows = rl.prompts_per_step * rl.n_samples_per_prompt
    n = rl.n_samples_per_prompt
    size_notes: list[str] = []
    for g, p in groups.items():
        dp = p.resources.dp
        for m in p.mfcs:
            if InterfaceType(m.interface_type) is not InterfaceType.TRAIN_STEP:
                continue
            if functions[m.name].engine == "reward":   # pairs, not prompt groups
                mini = cfg.reward_model.mini_batch_size or rl.prompts_per_step
                if mini % dp:
                    raise ConfigError(f"{_dp_key(cfg, g)}={dp}: {mini} preference pairs per optimizer step "
                                      f"(reward_model.mini_batch_size, null: rl_config.prompts_per_step) must split into "
                                      f"{dp} equal shares, since DDP ranks step together")
                continue
            section = "critic_config" if functions[m.name].engine == "value" else "actor_config"
            a = getattr(cfg, section)
            mini_rows = a.ppo_mini_batch_size * n if a.ppo_mini_batch_size else rows
            if mini_rows % dp:
                what = (f"{section}.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts x n_samples_per_prompt={n} "
                        f"= {mini_rows} rows" if a.ppo_mini_batch_size else
                        f"the step's {rows} rows ({section}.ppo_mini_batch_size=null)")
                fits = [d for d in range(1, rl.prompts_per_step + 1)
                        if rl.prompts_per_step % d == 0 and (d * n) % dp == 0]
                divisors = [d for d in range(1, mini_rows + 1) if mini_rows % d == 0]
                fix = (f"set {section}.ppo_mini_batch_size to one of {fits} (prompts), or the dp to one of "
                       f"{divisors}" if fits else f"set the dp to one of {divisors}")
                raise ConfigError(f"{_dp_key(cfg, g)}={dp}: {what} must split into {dp} equal shares, since DDP "
                                  f"ranks step together; {fix}")
            note = train_size_note(section, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_device,
                                   rl.prompts_per_step, n, dp)
            if note and note not in size_notes:
                size_notes.append(note)
    if any(InterfaceType(m.interface_type) is InterfaceType.GENERATE for m in order):
        size_notes.append(group_size_note("generate_config.micro_batch_size_per_device",
                                          cfg.generate_config.micro_batch_size_per_device, n,
                                          "a rollout micro-batch holds whole prompt groups"))
    grouped_default = [m.name for m in order if m.get_n_samples and not m.micro_batch_size]
    if grouped_default:
        size_notes.append(group_size_note("rl_config.dock_micro_batch_size", rl.dock_micro_batch_size, n,
                                          f"for {', '.join(grouped_default)}, which takes whole prompt groups"))
    size_notes = [s for s in size_notes if s]
    used = {m.model_name for m in order}
    model_paths = {role: path for role, path in (
        ("actor", cfg.actor_config.model_path),
        ("ref", cfg.ref_config.model_path or cfg.actor_config.model_path),
        ("critic", cfg.critic_config.model_path or cfg.actor_config.model_path)) if role in used or role == "actor"}
    if any(m.model_name == "reward" and InterfaceType(m.interface_type) is not InterfaceType.COMPUTE for m in order):
        model_paths["reward"] = cfg.reward_model.model_path or ""   # validate_config refused an empty one
    for m in order:
        if InterfaceType(m.interface_type) is not InterfaceType.COMPUTE and m.model_name not in model_paths:
            raise ConfigError(f"MFC {m.name!r} runs model {m.model_name!r}, which has no model_path in the config "
                              f"(known: {sorted(model_paths)})")
    if rollout_spec.own_process:
        for g, p in groups.items():
            gens = [m.name for m in p.mfcs if InterfaceType(m.interface_type) is InterfaceType.GENERATE]
            others = [m.name for m in p.mfcs if InterfaceType(m.interface_type) in
                      (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
            if gens and others:
                raise ConfigError(f"generate_config.backend={rollout_spec.name}: worker group '{g}' hosts {gens} and "
                                  f"{others}, but {rollout_spec.name} must have its process to itself (it takes torch's "
                                  "default process group, re-seeds the RNGs and patches torch.set_num_threads); move "
                                  "the generate MFCs to a group of their own")
    model_kinds = {m.name: functions[m.name].engine for m in order}
    if rl.dynamic_sampling:
        _check_dynamic_sampling_groups(cfg, groups, model_kinds)
    deploy_notes = _deploy_groups(cfg, groups, model_kinds, rollout_spec, train_spec, check_files)
    for g, p in groups.items():  # the train backend runs every model engine but rollout: can it run here?
        if not p.train_backend:
            continue
        from ..engines.registry import train_backend as train_row
        spec = train_row(p.train_backend)
        engines = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES]
        if engines and p.resources.device != "auto" and p.resources.device not in spec.devices:
            raise ConfigError(f"actor_config.backend={spec.name}: runs on {list(spec.devices)}, but worker "
                              f"group '{g}' ({engines}) has device={p.resources.device!r}; pick a backend that runs "
                              f"there (docs/engines.md) or put the group on {spec.devices[0]}")
        if check_files and engines:
            _check_train_model(spec, p, [m for m in p.mfcs if model_kinds[m.name] in ("policy", "value")],
                               model_paths)
        trained_in_group: dict[str, bool] = {}
        for m in p.mfcs:
            if model_kinds[m.name] in MODEL_ENGINES:
                trained_in_group[m.model_name] = (trained_in_group.get(m.model_name, False)
                                                  or InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP)
        check_features(cfg, g, spec, trained_in_group, p.resources.device)
        rewards = [m.name for m in p.mfcs if model_kinds[m.name] == "reward"]
        if rewards:
            _check_reward_backend(cfg, g, p, rewards)
        values = [m.name for m in p.mfcs if model_kinds[m.name] == "value"]
        if values and not spec.value_models:
            raise ConfigError(f"actor_config.backend={train_spec.name}: cannot run a critic ({values}: a value head); "
                              "use torch or fsdp for algorithms with a critic")
    _check_lora_targets(cfg, model_paths, trained)
    engine_backends(cfg, check_files)  # a backend's package missing: said once the placement is known good
    if check_files:
        _check_rollout_model(cfg, rollout_spec, [p for p in groups.values() if any(_generates(m) for m in p.mfcs)])
    notes = [f"engines: rollout {rollout_spec.name}, training {train_spec.name}"] + fold_notes + deploy_notes
    if rl.max_weight_staleness:
        late = train_time_mfcs(graph)
        notes.append(f"max_weight_staleness={rl.max_weight_staleness}: {[m.name for m in order if m.name not in late]} "
                     f"run up to {rl.max_weight_staleness} steps ahead of training, {late} at their step's turn")
    if cfg.trainer.simulate_cost_s_per_row:
        notes.append("sleeping compute (trainer.simulate_cost_s_per_row): the simulate backend's engines and the "
                     "compute stages sleep per row; no models are loaded")
    if check_files:
        from ..models import check_model_path
        try:
            check_model_path("actor_config.model_path", cfg.actor_config.model_path)
            if cfg.ref_config.model_path and "ref" in used:
                check_model_path("ref_config.model_path", cfg.ref_config.model_path)
            if cfg.critic_config.model_path and "critic" in {m.model_name for m in order}:
                check_model_path("critic_config.model_path", cfg.critic_config.model_path)
            if "reward" in model_paths:   # a one-label classifier (reward modeling may start from a causal LM)
                from ..models.reward import check_reward_model
                check_reward_model("reward_model.model_path", model_paths["reward"],
                                   trainable_from_lm="reward" in trained)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        notes.append("dry run: model and data paths were not opened")
    try:
        from ..rewards import validate_reward_name
        if rl.reward_fn and any(functions[m.name].name == "rule_reward" for m in order):
            validate_reward_name(rl.reward_fn, import_module=check_files)
    except ValueError as e:
        raise ConfigError(f"rl_config.reward_fn: {e}") from None
    if cfg.generate_config.agent.enable:
        from ..agent.tools import check_tools
        try:
            check_tools(cfg.generate_config.agent.tools, import_module=check_files)
        except ValueError as e:
            raise ConfigError(f"generate_config.agent.tools: {e}") from None
    if check_files:
        _check_dataset(cfg)
    from .validation import check_validation
    check_validation(cfg, graph, check_files)   # the stages it runs; data.val_dataset's file (trainer/validation.py)
    same_step = {t: [k for r in same_step_readers(graph, t) for k in by_name[r].output_keys]
                 for t in trained.values()}
    if placement is not None:
        strategies = {n: p.strategy for n, p in placement.placements.items()
                      if (p.tp > 1 or p.pp > 1) and n in by_name and not _model_mfc(by_name[n])}
        if strategies:
            notes.append(f"placement.mfcs with tp or pp > 1 ({strategies}): planned, not run; a compute MFC runs no "
                         "model, so a real run stops before any worker starts")
        if not check_files:
            try:
                _check_rollout_split(cfg, {n: p for n, p in placement.placements.items()
                                           if (p.tp > 1 or p.pp > 1) and n in by_name and _generates(by_name[n])})
            except ConfigError as e:
                notes.append(f"planned, not run: {e}")
    memory = plan_memory(cfg, groups, model_kinds, model_paths, rows)
    return Plan(graph=graph, order=order, columns=dock_columns(graph), consumers=dock_consumers(graph),
                dataset_keys=tuple(dataset_keys), groups=groups, trained=trained,
                sync_targets=weight_sync_targets(graph), same_step_outputs=same_step, model_paths=model_paths,
                rows_per_step=rows, notes=notes, placement=placement, size_notes=size_notes,
                ahead=tuple(m.name for m in order if m.name not in train_time_mfcs(graph)),
                tokenizer_model="reward" if "reward" in trained else "actor", memory=memory)


def _fold_own_process_group(cfg: Config, order: list[MFCDef], rollout_spec, assign: dict[str, str],
                            groups: dict[str, "GroupPlan"]) -> tuple[list[str], list[str]]:
    """The placement follows the rollout backend: a config written for a backend that needs its own
    process (vLLM: `placement.groups.rollout`, with its share of the GPU) still runs when the user
    switches to one that does not (`generate_config.backend=hf`). The group that backend would have had,
    declared without `mfcs` and absent now, hands its resources to the group that generates instead
    (its CPUs and device share are added), so one override switches the backend. Returns the groups
    folded and a note for each."""
    if cfg.placement.mode not in ("colocated", "disaggregated") or rollout_spec.own_process:
        return [], []
    would_be = preset_groups(cfg.placement.mode, order, rollout_own_process=True)
    generating = {assign[m.name] for m in order if _generates(m)}
    folded, notes = [], []
    for g, gc in cfg.placement.groups.items():
        if g in groups or gc.mfcs or g not in would_be or len(generating) != 1:
            continue
        if not all(_generates(m) for m in order if m.name in would_be[g]):
            continue
        host = groups[next(iter(generating))]
        r = host.resources
        from ..device import RAY_RESOURCES
        host.resources = dataclasses.replace(r, **{f: getattr(r, f) + getattr(gc, f) for f in RAY_RESOURCES})
        folded.append(g)
        notes.append(f"placement.groups.{g} is for a rollout backend with a process of its own; "
                           f"generate_config.backend={rollout_spec.name} generates in worker group '{host.name}', "
                           f"which takes its resources (now {host.resources.num_cpus:g} CPUs, "
                           f"{host.resources.num_gpus:g} GPUs per actor)")
    return folded, notes


def _dp_key(cfg: Config, group: str) -> str:
    """The key that sets a worker group's dp: its placement.groups entry, or (mode mesh) its MFCs' meshes."""
    return "placement.mfcs (dp)" if cfg.placement.mode == "mesh" else f"placement.groups.{group}.dp"


def _model_mfc(m: MFCDef) -> bool:
    """An MFC that runs a model (compute MFCs run none, so there is nothing to split)."""
    return InterfaceType(m.interface_type) is not InterfaceType.COMPUTE


def _generates(m: MFCDef) -> bool:
    return InterfaceType(m.interface_type) is InterfaceType.GENERATE


def _model_config(path: str) -> dict | None:
    """The HF config.json of a model path (a built-in model's from the repo), or None when unreadable."""
    import json
    from pathlib import Path

    from ..models import checkpoint as ck
    try:
        if ck.is_builtin(path):
            name = str(path)[len(ck.BUILTIN_PREFIX):]
            return json.loads((ck._CONFIG_DIR / ck._BUILTIN_CONFIGS[name]).read_text())
        return json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, KeyError, ValueError):
        return None


def _check_lora_targets(cfg: Config, model_paths: dict[str, str], trained) -> None:
    """actor_config.lora.target_modules against the policy's linear layers, before any worker starts, when its
    config.json is readable here (the model is built on the meta device: no weights read)."""
    lora = cfg.actor_config.lora
    if not lora.rank or "actor" not in trained or cfg.trainer.simulate_cost_s_per_row:
        return
    config = _model_config(model_paths.get("actor", cfg.actor_config.model_path))
    if config is None:
        return
    from ..engines.train.lora import check_target_modules_of_config
    try:
        check_target_modules_of_config(config, lora.target_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_split(mfc: str, placement, model_path: str, path_key: str) -> None:
    """Megatron's rules, before any worker starts: each TP rank takes whole heads, KV heads and an equal
    share of the MLP; each pipeline stage at least one decoder layer."""
    cfg = _model_config(model_path)
    if cfg is None:
        return
    tp, pp = placement.tp, placement.pp
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = cfg.get(key)
        if key == "num_key_value_heads" and v is None:
            v = cfg.get("num_attention_heads")
        if isinstance(v, int) and v % tp:
            raise ConfigError(f"placement.mfcs.{mfc}: tp={tp} must divide the model's {key}={v} ({path_key}="
                              f"{model_path!r}; each TP rank takes whole heads); use a tp that divides it")
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and pp > layers:
        raise ConfigError(f"placement.mfcs.{mfc}: pp={pp} stages but the model ({path_key}={model_path!r}) has "
                          f"{layers} decoder layers; use pp <= {layers}")


def mesh_groups(cfg: Config, order: list[MFCDef], check_files: bool):
    """placement.mode=mesh: per-MFC meshes (ReaLHF's allocation) -> worker groups pinned to devices.

    MFCs of one model on the same mesh with the same DP/TP/PP share a worker group (one copy of the
    weights, as `actor_log_prob` and `actor_train` share the trainer's); each rank runs on one device
    of the mesh, so a group has dp * tp * pp ranks. A device that k groups share gives each of their
    actors 1/k of it, so Ray packs them onto the device's placement-group bundle. MFCs without a model
    (rule reward, advantages) that are not listed run in a light CPU group outside the meshes.
    TP/PP > 1 is run for the inference and train MFCs of a model (the mesh train backend); a real run
    refuses it for generation (the rollout engines are data parallel only) and compute MFCs.
    Returns (PlacementPlan, mfc -> group, group -> GroupConfig, group -> devices, group -> (tp, pp)).
    """
    pc = cfg.placement
    by_name = {m.name: m for m in order}
    unknown = [n for n in pc.mfcs if n not in by_name]
    if unknown:
        raise ConfigError(f"placement.mfcs: unknown MFC(s) {unknown}; the {cfg.rl_config.algorithm} graph has "
                          f"{list(by_name)}")
    unplaced = [m.name for m in order if m.name not in pc.mfcs
                and InterfaceType(m.interface_type) is not InterfaceType.COMPUTE]
    if unplaced:
        raise ConfigError(f"placement.mode=mesh: MFC(s) {unplaced} run a model but have no entry in placement.mfcs; "
                          f"give each one {{mesh: ..., dp: ..}} (docs/parallel.md)")
    try:
        cluster = ClusterSpec(pc.n_nodes, pc.n_devices_per_node, pc.device_kind)
        plan = plan_placement({n: pc.mfcs[n] for n in by_name if n in pc.mfcs},
                              {n: by_name[n].model_name for n in pc.mfcs}, cluster)
    except ValueError as e:
        raise ConfigError(f"placement.mfcs: {e}") from None
    model_parallel = {n: p.strategy for n, p in plan.placements.items() if p.tp > 1 or p.pp > 1}
    if check_files and model_parallel:
        if cfg.trainer.simulate_cost_s_per_row:  # first: no backend's split applies to the simulate backend's run
            raise ConfigError(f"placement.mfcs: {model_parallel} (dp/tp/pp) with trainer.simulate_cost_s_per_row: "
                              "the simulate backend splits no model; use tp: 1, pp: 1 with it")
        _check_rollout_split(cfg, {n: plan.placements[n] for n in model_parallel
                                   if InterfaceType(by_name[n].interface_type) is InterfaceType.GENERATE})
        compute = {n: s for n, s in model_parallel.items()
                   if InterfaceType(by_name[n].interface_type) is InterfaceType.COMPUTE}
        if compute:
            raise ConfigError(f"placement.mfcs: {compute} (dp/tp/pp): compute MFCs run no model, so there is "
                              "nothing to split; give them tp: 1, pp: 1")
        paths = {"actor": ("actor_config.model_path", cfg.actor_config.model_path),
                 "ref": ("ref_config.model_path", cfg.ref_config.model_path or cfg.actor_config.model_path),
                 "critic": ("critic_config.model_path", cfg.critic_config.model_path or cfg.actor_config.model_path)}
        for n in model_parallel:
            key, path = paths.get(by_name[n].model_name, (None, None))
            if path:
                _check_split(n, plan.placements[n], path, key)
    assign: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for name, p in plan.placements.items():
        group = f"{by_name[name].model_name}@{p.mesh.spec}" + (f"/{p.strategy}" if p.tp > 1 or p.pp > 1 else "")
        assign[name] = group
        members.setdefault(group, []).append(name)
    for m in order:
        if m.name not in assign:
            assign[m.name] = "rule"
    share: dict[int, int] = {}
    for group, names in members.items():
        for d in plan.placements[names[0]].mesh.devices:
            share[d] = share.get(d, 0) + 1
    from ..device import group_field, torch_device_type
    device = torch_device_type(cluster.device_kind)
    resources: dict[str, GroupConfig] = {}
    devices: dict[str, list[int]] = {}
    splits: dict[str, tuple[int, int]] = {}
    for group, names in members.items():
        p = plan.placements[names[0]]
        k = max(share[d] for d in p.mesh.devices)
        frac = _floor4(1.0 / k)
        res = GroupConfig(dp=p.dp, num_cpus=_floor4(pc.cpus_per_device / k), device=device)
        if cluster.device_kind != "cpu":  # the accelerator's GroupConfig field (device/kinds.py)
            setattr(res, group_field(cluster.device_kind), frac)
        resources[group] = res
        devices[group] = list(p.mesh.devices)
        splits[group] = (p.tp, p.pp)
    return plan, assign, resources, devices, splits


MODEL_ENGINES = ("policy", "value", "reward")   # compute.FUNCTIONS' engine kinds that run on the train backend


def _check_reward_backend(cfg: Config, g: str, p: GroupPlan, mfcs: list[str]) -> None:
    """A reward model runs on a train backend that declares it can (`Backend.reward_models`), whole (no tp or pp)."""
    from ..engines.registry import TRAIN_BACKENDS, user_backends
    name = cfg.reward_model.backend or p.train_backend
    key = "reward_model.backend" if cfg.reward_model.backend else "actor_config.backend"
    row = TRAIN_BACKENDS.get(name)
    if row is None:
        raise ConfigError(f"{key}={name!r}: must be one of {user_backends(TRAIN_BACKENDS)} (docs/engines.md)")
    if not row.reward_models:
        able = [b.name for b in TRAIN_BACKENDS.values() if b.user and b.reward_models]
        split = f" (worker group '{g}' has tp/pp {p.tp}/{p.pp})" if p.tp * p.pp > 1 else ""
        raise ConfigError(f"{key}={name!r}: the {name} train backend{split} cannot run a reward model ({mfcs}: a "
                          f"one-label sequence classifier); use one of {able} with tp: 1, pp: 1")


def _check_rollout_model(cfg: Config, backend, generating: list[GroupPlan]) -> None:
    """The rollout backend's own check of the model on the devices generation runs on (vLLM's CPU
    attention runs only some head sizes), before any worker starts rather than after an engine build."""
    if not backend.check_model or not generating:
        return
    from ..device import resolve_device
    from ..models import resolve_model_path
    path = str(resolve_model_path(cfg.actor_config.model_path))
    devices = set()
    for p in generating:
        try:
            devices.add(resolve_device(p.resources.device).type)
        except ValueError:
            continue  # a device this machine lacks: the worker names it
    for device in sorted(devices):
        try:
            backend.check(path, device)
        except ValueError as e:
            raise ConfigError(f"generate_config.backend={backend.name!r} with actor_config.model_path="
                              f"{cfg.actor_config.model_path!r}: {e}") from None


def _check_train_model(backend, group: GroupPlan, mfcs: list[MFCDef], model_paths: dict[str, str]) -> None:
    """The train backend's own check of each model a group runs (the mesh backend builds Qwen2/Llama-style
    decoders only), before any worker starts rather than 49 s in, inside a worker."""
    if not backend.check_model:
        return
    from ..device import resolve_device
    from ..models import resolve_model_path
    try:
        device = resolve_device(group.resources.device).type
    except ValueError:
        return  # a device this machine lacks: the worker names it
    for model in sorted({m.model_name for m in mfcs}):
        path = model_paths[model]
        try:
            backend.check(str(resolve_model_path(path)), device)
        except ValueError as e:
            raise ConfigError(f"worker group '{group.name}' runs {model!r} ({path!r}) on the {backend.name} train "
                              f"backend: {e}") from None


def _check_rollout_split(cfg: Config, rollout: dict) -> None:
    """A rollout MFC with tp or pp > 1 runs only where its backend's deployment splits that way."""
    from ..engines import registry
    from ..engines.deployment import MESH
    name = registry.chosen_backends(cfg)[0]
    backend = registry.ROLLOUT_BACKENDS.get(name)
    if backend is None:
        return  # an unknown name is refused by engine_backends, naming the key
    for n, p in rollout.items():
        try:
            dep = backend.deploy(Slice(p.dp, p.tp, p.pp))
        except DeployError as e:
            what = f"pp={p.pp}" if p.tp == 1 or backend.shape != "data_parallel" else f"dp/tp/pp {p.strategy}"
            raise ConfigError(f"placement.mfcs.{n}: {what} with generate_config.backend={name!r}: {e}") from None
        if dep.shape == MESH and cfg.rl_config.max_weight_staleness:
            raise ConfigError(f"placement.mfcs.{n}: dp/tp/pp {p.strategy} generation on the mesh with "
                              f"rl_config.max_weight_staleness={cfg.rl_config.max_weight_staleness}: a weight sync "
                              f"would land on some ranks of a replica between two of their collective forwards and "
                              f"not on others; use max_weight_staleness: 0 with a split generation, or tp: 1, pp: 1")


def _deploy_groups(cfg: Config, groups: dict[str, GroupPlan], model_kinds: dict[str, str], rollout_spec, train_spec,
                   check_files: bool) -> list[str]:
    """Each worker group's deployment, as its backends declare it (engines/deployment.py): which backend's
    engines run there, with which options, as how many actors, and which of them read the dock and write.
    A dry run plans what a real run refuses (a split the backend cannot make) and says so in a note."""
    from ..engines.registry import backend_options, deploy_group
    notes: list[str] = []
    options: dict[str, dict] = {}

    def options_of(backend, key: str) -> dict:
        if backend.name not in options:
            try:
                opts = backend_options(cfg, backend)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            options[backend.name] = opts
        return options[backend.name]

    for g, p in groups.items():
        gens = any(_generates(m) for m in p.mfcs)
        models = any(model_kinds[m.name] in MODEL_ENGINES for m in p.mfcs)
        slice_ = Slice(p.resources.dp, p.tp, p.pp, tuple(p.devices))
        try:
            p.deployment = deploy_group(rollout_spec if gens else None, train_spec if models else None, slice_)
            if gens:
                p.rollout_backend = rollout_spec.deploy(slice_).backend
            if models:
                p.train_backend = train_spec.deploy(slice_).backend
        except DeployError as e:
            if check_files:
                raise ConfigError(f"worker group '{g}' ({', '.join(m.name for m in p.mfcs)}): {e}") from None
            notes.append(f"planned, not run: worker group '{g}': {e}")
            p.deployment = Deployment(backend="-", shape="mesh" if p.tp * p.pp > 1 else "data_parallel",
                                      dp=p.resources.dp, tp=p.tp, pp=p.pp, devices=tuple(p.devices))
            continue
        from ..engines.registry import rollout_backend as rollout_row, train_backend as train_row
        if p.rollout_backend:
            p.rollout_options = {**options_of(rollout_spec, "rollout"),
                                 **rollout_row(p.rollout_backend).engine_options(p.deployment)}
        if p.train_backend:
            p.train_options = {**(options_of(train_spec, "train") if p.train_backend == train_spec.name else {}),
                               **train_row(p.train_backend).engine_options(p.deployment)}
        split = [b for b in (p.rollout_backend, p.train_backend)
                 if b and b not in (rollout_spec.name, train_spec.name)]
        if split:
            notes.append(f"worker group '{g}' (dp/tp/pp {p.resources.dp}/{p.tp}/{p.pp}) runs on the {'/'.join(split)} "
                         f"backend, which splits for {rollout_spec.name if p.rollout_backend in split else train_spec.name}"
                         f" (docs/engines.md)")
        dep = p.deployment
        if dep.actors > 1 and (dep.tp > 1 or dep.pp > 1):
            readers = [r.rank for r in dep.roles() if r.reads]
            writers = [r.rank for r in dep.roles() if r.writes]
            turns = "; its model MFCs take turns on the group's ranks within a step" if dep.shape == "mesh" else ""
            notes.append(f"worker group '{g}': {dep.actors} actors ({dep.shape}, engine_tp {dep.engine_tp}); dock readers "
                         f"{readers}, writers {writers}{turns}")
    return notes


def _floor4(x: float) -> float:
    """Ray counts resources in units of 1e-4: round shares down so k of them fit in one device."""
    import math
    return math.floor(x * 10000 + 1e-9) / 10000


def _check_dataset(cfg: Config) -> None:
    from pathlib import Path
    spec = cfg.data.dataset
    if cfg.rl_config.algorithm == "reward_modeling":   # preference pairs, read whole now (names file, line, key)
        from ..data.preferences import load_preference_dataset, split_held_out
        d = cfg.data
        try:
            split_held_out(load_preference_dataset(spec, d.prompt_key, d.chosen_key, d.rejected_key, d.num_digits,
                                                   d.size, cfg.trainer.seed), d.eval_size, cfg.trainer.seed)
        except ValueError as e:
            raise ConfigError(f"data.dataset={spec!r}: {e}") from None
        return
    from ..data.prompts import BUILTIN_PREFIX
    if spec.startswith(BUILTIN_PREFIX):
        from ..data.synthetic import KINDS
        if spec[len(BUILTIN_PREFIX):] not in KINDS:
            raise ConfigError(f"data.dataset={spec!r}: unknown built-in task; built-in tasks are "
                              f"{['builtin:' + k for k in KINDS]}")
        return
    from ..data.prompts import SUFFIXES
    if not Path(spec).expanduser().is_file():
        raise ConfigError(f"data.dataset={spec!r}: no such file; give a {'/'.join(SUFFIXES)} path (see "
                          "cli/preprocess_data.py) or a built-in task such as builtin:copy")
    if Path(spec).suffix not in SUFFIXES:
        raise ConfigError(f"data.dataset={spec!r}: unsupported file type {Path(spec).suffix!r}; give a "
                          f"{'/'.join(SUFFIXES)} file (see cli/preprocess_data.py) or a built-in task such as "
                          "builtin:copy")
    from ..data.prompts import check_prompt_file
    try:  # every row, now: the trainer reads the file only after the workers have loaded their models
        check_prompt_file(spec, cfg.data.prompt_key, cfg.data.answer_key, setting_prefix="data.")
    except (ValueError, ImportError) as e:
        raise ConfigError(f"data.dataset={spec!r}: {e}") from None


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
                              f"lower placement.groups.<name>.{field_} (fractions are fine), or {more}")


def plan_dict(plan: Plan) -> dict:
    """What the plan decided, as plan.json holds it: per worker group its MFCs, backends, dp/tp/pp, devices,
    actors and which ranks read the dock and write results; the stage order, columns and weight syncs."""
    return {"groups": {g: p.as_dict() for g, p in plan.groups.items()},
            "stage_order": [m.name for m in plan.order], "columns": list(plan.columns),
            "consumers": list(plan.consumers), "rows_per_step": plan.rows_per_step,
            "weight_sync": {model: {"trained_by": plan.trained[model], "readers": targets}
                            for model, targets in plan.sync_targets.items()},
            "model_paths": dict(plan.model_paths), "notes": list(plan.notes), "batch_sizes": list(plan.size_notes),
            "memory": plan.memory.as_dict() if plan.memory is not None else None}


def write_plan_json(plan: Plan, directory: str) -> str:
    """plan.json in `directory` (a dry run's and a real run's output_dir), written whole or not at all."""
    import json
    import os
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "plan.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plan_dict(plan), f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def format_plan(plan: Plan) -> str:
    if plan.placement is not None:
        return _format_mesh_plan(plan)
    return _format_groups(plan)


def _format_mesh_plan(plan: Plan) -> str:
    """mode mesh: the per-MFC table and the devices' sharing (docs/parallel.md), then the worker groups."""
    group_of = {m.name: g for g, p in plan.groups.items() for m in p.mfcs}
    return ("per-MFC placement on " + str(plan.placement.cluster) + "\n" + plan.placement.format_table()
            + "\n\nranks of each MFC (rank k of its worker group runs on the k-th device of its mesh; a replica's "
              "dock reader pulls its micro-batches and broadcasts them to the replica, its writer pushes the "
              "outputs)\n" + plan.placement.format_ranks(group_of)
            + "\n\nworker groups (MFCs of one model on one mesh share a group)\n" + _format_groups(plan))


def _format_groups(plan: Plan) -> str:
    from ..parallel import format_ids
    split = any(p.tp * p.pp > 1 for p in plan.groups.values())  # an engine-split rollout group's tp too
    rows = [("group", "MFCs", "role/type", "dp") + (("tp", "pp", "ranks") if split else ())
            + ("cpus", "gpus", "npus", "device", "on devices")]
    for g, p in plan.groups.items():
        r = p.resources
        rows.append((g, ", ".join(m.name for m in p.mfcs),
                     ", ".join(sorted({f"{m.model_name}/{InterfaceType(m.interface_type).value}" for m in p.mfcs})),
                     str(r.dp)) + ((str(p.tp), str(p.pp), str(p.world)) if split else ())
                    + (f"{r.num_cpus:g}", f"{r.num_gpus:g}", f"{r.num_npus:g}", r.device,
                       format_ids(p.devices) if p.devices else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tot = plan.resource_totals()
    lines.append(f"total: {tot['CPU']:g} CPU, {tot['GPU']:g} GPU, {tot['NPU']:g} NPU; "
                 f"{plan.rows_per_step} rows per step")
    lines.append("stage order (blocking mode): " + " -> ".join(m.name for m in plan.order))
    for model, targets in plan.sync_targets.items():
        lines.append(f"weight sync after each optimizer step of '{plan.trained[model]}': {model} -> {targets}")
    lines.append("dock columns: " + ", ".join(plan.columns))
    lines.extend(plan.notes)
    lines.extend(f"batch size: {s}" for s in plan.size_notes)
    return "\n".join(lines)


def _check_dynamic_sampling_groups(cfg: Config, groups: dict, model_kinds: dict) -> None:
    """Dynamic sampling with a model run collectively over several ranks is refused: a step the cap ends
    short of prompts_per_step kept groups has fewer rows than the ranks' equal shares, so one rank would
    make a collective call (a gradient all-reduce, a sharded forward) that another never makes."""
    for g, p in groups.items():
        models = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES
                  and InterfaceType(m.interface_type) in (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
        if models and (p.resources.dp > 1 or p.tp > 1 or p.pp > 1):
            raise ConfigError(
                f"rl_config.dynamic_sampling=true with worker group '{g}' ({models}) at dp={p.resources.dp} "
                f"tp={p.tp} pp={p.pp}: a step that ends short of rl_config.prompts_per_step kept groups "
                "(rl_config.max_oversample reached) gives its ranks unequal rows, and their collective steps would "
                "wait on each other; run that group on one rank (dp=tp=pp=1) or set rl_config.dynamic_sampling=false")
