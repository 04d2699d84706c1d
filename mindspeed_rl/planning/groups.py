"""The plan's third stage: which worker group runs each MFC, with which resources. The placement mode's preset
groups, the config's own groups on top, and (placement.mode=mesh) the per-MFC meshes made into groups pinned
to devices. A group is what Ray starts as one set of actors, so everything after this stage (deployments,
memory, worker specs) is decided per group. Every refusal names the placement key and the fix."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import ConfigError, GroupConfig, PlacementConfig, RLConfig, TrainerConfig
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..engines.deployment import Deployment, DeployError, Slice
from ..engines.registry import Backend
from ..models.checkpoint import read_config
from ..parallel import ClusterSpec, PlacementPlan, plan_placement
from .graph import generates, model_mfc
from .keys import GROUPS_KEY, MESH_KEY, PLACEMENT_MODE_KEY, ROLLOUT_BACKEND_KEY, SIMULATE_KEY, path_key
from .models import ModelSections


def role_names(mfcs: list[MFCDef]) -> list[str]:
    """The group's model/interface pairs, as plan.json and the printed table give them."""
    return sorted({f"{m.model_name}/{InterfaceType(m.interface_type).value}" for m in mfcs})


@dataclass
class GroupPlan:
    """One worker group: its MFCs and resources (this stage), its deployment on the backends and their options
    (the deployment stage fills them)."""
    name: str
    mfcs: list[MFCDef]
    resources: GroupConfig                  # resources.dp: the data-parallel replicas
    devices: list[int] = field(default_factory=list)  # placement.mode=mesh: the group's devices, topology order
    tp: int = 1                             # placement.mode=mesh: the tensor- and pipeline-parallel sizes of
    pp: int = 1                             # the group's slice (its backend's deployment decides the actors)
    deployment: Deployment | None = None    # what the backends make of the slice (engines/deployment.py)
    rollout_row: Backend | None = field(default=None, repr=False)  # the registry's row whose rollout engine
                                                                   # generates here (None: none)
    train_row: Backend | None = field(default=None, repr=False)    # the row whose engines run the group's other
                                                                   # models; both resolved once by the plan
    rollout_options: dict = field(default_factory=dict)  # their options, checked by their dataclasses
    train_options: dict = field(default_factory=dict)

    @property
    def rollout_backend(self) -> str:
        return self.rollout_row.name if self.rollout_row is not None else ""

    @property
    def train_backend(self) -> str:
        return self.train_row.name if self.train_row is not None else ""

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
        return {"mfcs": [m.name for m in self.mfcs], "roles": role_names(self.mfcs),
                "rollout_backend": self.rollout_backend or None, "train_backend": self.train_backend or None,
                "rollout_options": self.rollout_options, "train_options": self.train_options,
                "dp": r.dp, "tp": self.tp, "pp": self.pp, "devices": list(self.devices), "device": r.device,
                "num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "num_npus": r.num_npus,
                "actors": self.world, "deployment": dep}


def device_sharing_groups(groups: dict[str, GroupPlan]) -> list[str]:
    """The groups outside a mesh whose actors hold a fraction of an accelerator: actor k of each shares the k-th
    of their devices (what the memory plan counts, what their one reservation asks Ray for, what the landing
    check compares)."""
    from ..device import accelerator_share
    return [g for g, p in groups.items() if not p.devices and 0 < accelerator_share(p.resources) < 1]


@dataclass
class WorkerGroups:
    """The group stage's result: the groups in the order of their first MFC, the mesh placement they come from
    (placement.mode=mesh) and a note per group folded into the one that generates."""
    groups: dict[str, GroupPlan]
    placement: PlacementPlan | None = None
    notes: list[str] = field(default_factory=list)


def dp_key(placement: PlacementConfig, group: str) -> str:
    """The key that sets a worker group's dp: its placement.groups entry, or (mode mesh) its MFCs' meshes."""
    return f"{MESH_KEY} (dp)" if placement.mode == "mesh" else f"{GROUPS_KEY}.{group}.dp"


@dataclass
class Layout:
    """MFC -> worker group, and per group its resources, devices and (tp, pp) before any group exists."""
    assign: dict[str, str] = field(default_factory=dict)
    resources: dict[str, GroupConfig] = field(default_factory=dict)
    devices: dict[str, list[int]] = field(default_factory=dict)
    splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    placement: PlacementPlan | None = None


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


def worker_groups(placement: PlacementConfig, rl: RLConfig, models: ModelSections, trainer: TrainerConfig,
                  order: list[MFCDef], rollout_spec: Backend, check_files: bool) -> WorkerGroups:
    """The worker groups: the mode's preset, then the config's groups (which may move MFCs or add resources),
    in the order of their first MFC."""
    layout = Layout()
    if placement.mode == "mesh":
        layout = mesh_groups(placement, rl, models, trainer, order, rollout_spec, check_files)
    elif placement.mode != "custom":
        for g, names in preset_groups(placement.mode, order, rollout_spec.own_process).items():
            for n in names:
                layout.assign[n] = g
    _claim_config_groups(placement, rl.algorithm, order, layout)
    groups = _build_groups(order, layout)
    folded, fold_notes = _fold_own_process_group(placement, order, rollout_spec, layout.assign, groups)
    for g, gc in placement.groups.items():
        if g not in groups and not gc.mfcs and g not in folded:
            raise ConfigError(f"{GROUPS_KEY}.{g}: no such worker group in {PLACEMENT_MODE_KEY}="
                              f"{placement.mode!r} (groups: {list(groups)}); give it mfcs: [...] to create it")
    return WorkerGroups(groups=groups, placement=layout.placement, notes=fold_notes)


def _claim_config_groups(placement: PlacementConfig, algorithm: str, order: list[MFCDef], layout: Layout) -> None:
    """placement.groups' MFCs move to their group (each MFC listed once), their resources replace the preset's;
    every MFC must end in some group."""
    by_name = {m.name: m for m in order}
    claimed: dict[str, str] = {}
    for g, gc in placement.groups.items():
        for n in gc.mfcs:
            if n not in by_name:
                raise ConfigError(f"{GROUPS_KEY}.{g}.mfcs: unknown MFC {n!r}; the {algorithm} graph "
                                  f"has {list(by_name)}")
            if n in claimed:
                raise ConfigError(f"{GROUPS_KEY}.{g}.mfcs: {n!r} is already in {GROUPS_KEY}.{claimed[n]}.mfcs;"
                                  " list each MFC in one group")
            claimed[n] = g
            layout.assign[n] = g
        layout.resources[g] = gc
    missing = [n for n in by_name if n not in layout.assign]
    if missing:
        raise ConfigError(f"placement: MFCs {missing} are in no worker group; with {PLACEMENT_MODE_KEY}=custom list "
                          f"every MFC under {GROUPS_KEY}.<name>.mfcs")


def _build_groups(order: list[MFCDef], layout: Layout) -> dict[str, GroupPlan]:
    """One GroupPlan per group, in the order of its first MFC, holding its MFCs in stage order."""
    groups: dict[str, GroupPlan] = {}
    for m in order:
        g = layout.assign[m.name]
        if g not in groups:
            res = dataclasses.replace(layout.resources.get(g, GroupConfig()), mfcs=[])
            tp, pp = layout.splits.get(g, (1, 1))
            groups[g] = GroupPlan(name=g, mfcs=[], resources=res, devices=list(layout.devices.get(g, [])), tp=tp, pp=pp)
        groups[g].mfcs.append(m)
        groups[g].resources.mfcs.append(m.name)
    return groups


def _fold_own_process_group(placement: PlacementConfig, order: list[MFCDef], rollout_spec: Backend,
                            assign: dict[str, str], groups: dict[str, GroupPlan]) -> tuple[list[str], list[str]]:
    """The placement follows the rollout backend: a config written for a backend that needs its own
    process (vLLM: `placement.groups.rollout`, with its share of the GPU) still runs when the user
    switches to one that does not (`generate_config.backend=hf`). The group that backend would have had,
    declared without `mfcs` and absent now, hands its resources to the group that generates instead
    (its CPUs and device share are added), so one override switches the backend. Returns the groups
    folded and a note for each."""
    if placement.mode not in ("colocated", "disaggregated") or rollout_spec.own_process:
        return [], []
    would_be = preset_groups(placement.mode, order, rollout_own_process=True)
    generating = {assign[m.name] for m in order if generates(m)}
    folded, notes = [], []
    for g, gc in placement.groups.items():
        if g in groups or gc.mfcs or g not in would_be or len(generating) != 1:
            continue
        if not all(generates(m) for m in order if m.name in would_be[g]):
            continue
        host = groups[next(iter(generating))]
        r = host.resources
        from ..device import RAY_RESOURCES
        host.resources = dataclasses.replace(r, **{f: getattr(r, f) + getattr(gc, f) for f in RAY_RESOURCES})
        folded.append(g)
        notes.append(f"{GROUPS_KEY}.{g} is for a rollout backend with a process of its own; "
                     f"{ROLLOUT_BACKEND_KEY}={rollout_spec.name} generates in worker group '{host.name}', "
                     f"which takes its resources (now {host.resources.num_cpus:g} CPUs, "
                     f"{host.resources.num_gpus:g} GPUs per actor)")
    return folded, notes


def mesh_groups(placement: PlacementConfig, rl: RLConfig, models: ModelSections, trainer: TrainerConfig,
                order: list[MFCDef], rollout_spec: Backend, check_files: bool) -> Layout:
    """placement.mode=mesh: per-MFC meshes (ReaLHF's allocation) -> worker groups pinned to devices.

    MFCs of one model on the same mesh with the same DP/TP/PP share a worker group (one copy of the
    weights, as `actor_log_prob` and `actor_train` share the trainer's); each rank runs on one device
    of the mesh, so a group has dp * tp * pp ranks. A device that k groups share gives each of their
    actors 1/k of it, so Ray packs them onto the device's placement-group bundle. MFCs without a model
    (rule reward, advantages) that are not listed run in a light CPU group outside the meshes.
    TP/PP > 1 is run for the inference and train MFCs of a model (the mesh train backend); a real run
    refuses it for generation (the rollout engines are data parallel only) and compute MFCs.
    """
    by_name = _check_mesh_entries(placement, rl.algorithm, order)
    try:
        cluster = ClusterSpec(placement.n_nodes, placement.n_devices_per_node, placement.device_kind)
        plan = plan_placement({n: placement.mfcs[n] for n in by_name if n in placement.mfcs},
                              {n: by_name[n].model_name for n in placement.mfcs}, cluster)
    except ValueError as e:
        raise ConfigError(f"{MESH_KEY}: {e}") from None
    if check_files:
        _check_model_parallel(rl, models, trainer, by_name, plan, rollout_spec)
    layout = Layout(placement=plan)
    members: dict[str, list[str]] = {}
    for name, p in plan.placements.items():
        group = f"{by_name[name].model_name}@{p.mesh.spec}" + (f"/{p.strategy}" if p.tp > 1 or p.pp > 1 else "")
        layout.assign[name] = group
        members.setdefault(group, []).append(name)
    for m in order:
        layout.assign.setdefault(m.name, "rule")
    _mesh_resources(placement, cluster, plan, members, layout)
    return layout


def _check_mesh_entries(placement: PlacementConfig, algorithm: str, order: list[MFCDef]) -> dict[str, MFCDef]:
    """placement.mfcs names only the graph's MFCs, and every MFC that runs a model; returns the MFCs by name."""
    by_name = {m.name: m for m in order}
    unknown = [n for n in placement.mfcs if n not in by_name]
    if unknown:
        raise ConfigError(f"{MESH_KEY}: unknown MFC(s) {unknown}; the {algorithm} graph has "
                          f"{list(by_name)}")
    unplaced = [m.name for m in order if m.name not in placement.mfcs
                and InterfaceType(m.interface_type) is not InterfaceType.COMPUTE]
    if unplaced:
        raise ConfigError(f"{PLACEMENT_MODE_KEY}=mesh: MFC(s) {unplaced} run a model but have no entry in {MESH_KEY}; "
                          f"give each one {{mesh: ..., dp: ..}} (docs/parallel.md)")
    return by_name


def _check_model_parallel(rl: RLConfig, models: ModelSections, trainer: TrainerConfig, by_name: dict[str, MFCDef],
                          plan: PlacementPlan, rollout_spec: Backend) -> None:
    """A real run's refusals of tp or pp > 1: with the simulate backend, for generation its backend cannot
    split, for compute MFCs, and for a split the model's heads and layers do not divide."""
    model_parallel = {n: p.strategy for n, p in plan.placements.items() if p.tp > 1 or p.pp > 1}
    if not model_parallel:
        return
    if trainer.simulate_cost_s_per_row:  # first: no backend's split applies to the simulate backend's run
        raise ConfigError(f"{MESH_KEY}: {model_parallel} (dp/tp/pp) with {SIMULATE_KEY}: "
                          "the simulate backend splits no model; use tp: 1, pp: 1 with it")
    check_rollout_split(rl, rollout_spec, {n: plan.placements[n] for n in model_parallel if generates(by_name[n])})
    compute = {n: s for n, s in model_parallel.items()
               if InterfaceType(by_name[n].interface_type) is InterfaceType.COMPUTE}
    if compute:
        raise ConfigError(f"{MESH_KEY}: {compute} (dp/tp/pp): compute MFCs run no model, so there is "
                          "nothing to split; give them tp: 1, pp: 1")
    for n in model_parallel:
        model = by_name[n].model_name
        path = models.path(model)   # None: a model without a section of its own (a reward model)
        if path:
            _check_split(n, plan.placements[n], path, path_key(model))


def check_rollout_split(rl: RLConfig, backend: Backend, rollout: dict) -> None:
    """A rollout MFC with tp or pp > 1 runs only where its backend's deployment splits that way."""
    for n, p in rollout.items():
        try:
            dep = backend.deploy(Slice(p.dp, p.tp, p.pp))
        except DeployError as e:
            what = f"pp={p.pp}" if p.tp == 1 or not backend.whole_copies else f"dp/tp/pp {p.strategy}"
            raise ConfigError(f"{MESH_KEY}.{n}: {what} with {ROLLOUT_BACKEND_KEY}={backend.name!r}: {e}") from None
        if dep.over_actors and rl.max_weight_staleness:
            raise ConfigError(f"{MESH_KEY}.{n}: dp/tp/pp {p.strategy} generation on the mesh with "
                              f"rl_config.max_weight_staleness={rl.max_weight_staleness}: a weight sync "
                              f"would land on some ranks of a replica between two of their collective forwards and "
                              f"not on others; use max_weight_staleness: 0 with a split generation, or tp: 1, pp: 1")


def _check_split(mfc: str, placement, model_path: str, path_key: str) -> None:
    """Megatron's rules, before any worker starts: each TP rank takes whole heads, KV heads and an equal
    share of the MLP; each pipeline stage at least one decoder layer."""
    config = read_config(model_path)
    if config is None:
        return
    tp, pp = placement.tp, placement.pp
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = config.get(key)
        if key == "num_key_value_heads" and v is None:
            v = config.get("num_attention_heads")
        if isinstance(v, int) and v % tp:
            raise ConfigError(f"{MESH_KEY}.{mfc}: tp={tp} must divide the model's {key}={v} ({path_key}="
                              f"{model_path!r}; each TP rank takes whole heads); use a tp that divides it")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and pp > layers:
        raise ConfigError(f"{MESH_KEY}.{mfc}: pp={pp} stages but the model ({path_key}={model_path!r}) has "
                          f"{layers} decoder layers; use pp <= {layers}")


def _mesh_resources(placement: PlacementConfig, cluster: ClusterSpec, plan: PlacementPlan,
                    members: dict[str, list[str]], layout: Layout) -> None:
    """Per mesh group: its dp, its share of each device (1/k where k groups share one) and of the CPUs per
    device, its devices and its (tp, pp)."""
    share: dict[int, int] = {}
    for group, names in members.items():
        for d in plan.placements[names[0]].mesh.devices:
            share[d] = share.get(d, 0) + 1
    from ..device import group_field, torch_device_type
    device = torch_device_type(cluster.device_kind)
    for group, names in members.items():
        p = plan.placements[names[0]]
        k = max(share[d] for d in p.mesh.devices)
        res = GroupConfig(dp=p.dp, num_cpus=_floor4(placement.cpus_per_device / k), device=device)
        if cluster.device_kind != "cpu":  # the accelerator's GroupConfig field (device/kinds.py)
            setattr(res, group_field(cluster.device_kind), _floor4(1.0 / k))
        layout.resources[group] = res
        layout.devices[group] = list(p.mesh.devices)
        layout.splits[group] = (p.tp, p.pp)


def _floor4(x: float) -> float:
    """Ray counts resources in units of 1e-4: round shares down so k of them fit in one device."""
    return math.floor(x * 10000 + 1e-9) / 10000


def mesh_notes(rl: RLConfig, placement: PlacementPlan, order: list[MFCDef], rollout: Backend,
               check_files: bool) -> list[str]:
    """placement.mode=mesh: the splits a real run refuses, said as notes of a dry run's plan."""
    by_name = {m.name: m for m in order}
    split = {n: p for n, p in placement.placements.items() if (p.tp > 1 or p.pp > 1) and n in by_name}
    notes = []
    strategies = {n: p.strategy for n, p in split.items() if not model_mfc(by_name[n])}
    if strategies:
        notes.append(f"{MESH_KEY} with tp or pp > 1 ({strategies}): planned, not run; a compute MFC runs no "
                     "model, so a real run stops before any worker starts")
    if not check_files:
        try:
            check_rollout_split(rl, rollout, {n: p for n, p in split.items() if generates(by_name[n])})
        except ConfigError as e:
            notes.append(f"planned, not run: {e}")
    return notes
