"""The plan's fourth stage: each worker group deployed once on the chosen backends (engines/deployment.py),
and checked against what it runs there: a rollout backend that needs its process to itself, collectives that
need a device per rank, partial rollout, each group's models and the features their sections ask for. Nothing
here compares a backend's name or shape, it asks the registry's row; the rows are kept on the GroupPlan, so
the launch and the workers never look a name up again."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import ActorConfig, ConfigError, RLConfig, TrainerConfig
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..engines.deployment import Deployment, DeployError, Slice
from ..engines.registry import Backend
from .backends import Backends, check_installed
from .features import check_features, check_lora_targets
from .graph import MODEL_ENGINES, AlgorithmGraph, generates
from .groups import GroupPlan, device_sharing_groups
from .keys import (GROUPS_KEY, MESH_KEY, PARTIAL_ROLLOUT_KEY, PLACEMENT_MODE_KEY, PROMPTS_PER_STEP_KEY,
                   REWARD_SECTION, ROLLOUT_BACKEND_KEY, TRAIN_BACKEND_KEY, path_key)
from .models import ModelSections

DYNAMIC_SAMPLING_KEY = "rl_config.dynamic_sampling"


@dataclass
class Deployments:
    """The deployment stage's result: what the plan says of the deployments. Each GroupPlan holds its own
    deployment, the rows that run there and their options."""
    notes: list[str] = field(default_factory=list)


def deploy(groups: dict[str, GroupPlan], graph: AlgorithmGraph, backends: Backends, model_paths: dict[str, str],
           models: ModelSections, rl: RLConfig, trainer: TrainerConfig, check_files: bool) -> Deployments:
    """The groups' deployments on the chosen backends and what those backends must be able to run there;
    a real run also checks the packages and the models."""
    rollout, train, kinds = backends.rollout, backends.train, graph.model_kinds
    check_own_process(rollout, groups)
    if rl.dynamic_sampling:
        check_dynamic_sampling_groups(groups, kinds)
    notes = deploy_groups(groups, kinds, backends, check_files)
    check_collective_devices(groups)
    check_device_shares(groups)
    check_partial_rollout(rl, groups, backends.options_of)
    check_rollout_refusals(groups, backends.options_of)
    check_group_backends(models, groups, kinds, model_paths, train, check_files)
    check_lora_targets(models.actor, trainer, model_paths, graph.trained)
    if check_files:  # a backend's package missing: said once the placement is known good
        check_installed(rollout, train)
        check_rollout_model(models.actor, rollout, [p for p in groups.values() if any(generates(m) for m in p.mfcs)])
    return Deployments(notes)


def check_own_process(rollout: Backend, groups: dict[str, GroupPlan]) -> None:
    """A rollout backend that must have its process to itself shares no group with another model MFC."""
    if not rollout.own_process:
        return
    for g, p in groups.items():
        gens = [m.name for m in p.mfcs if generates(m)]
        others = [m.name for m in p.mfcs if InterfaceType(m.interface_type) in
                  (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
        if gens and others:
            raise ConfigError(f"{ROLLOUT_BACKEND_KEY}={rollout.name}: worker group '{g}' hosts {gens} and "
                              f"{others}, but {rollout.name} must have its process to itself (it takes torch's "
                              "default process group, re-seeds the RNGs and patches torch.set_num_threads); move "
                              "the generate MFCs to a group of their own")


def check_partial_rollout(rl: RLConfig, groups: dict[str, GroupPlan], options_of: Callable[[Backend], dict]) -> None:
    """rl_config.partial_rollout: every group's rollout engine can take weights while it generates
    (`RolloutEngine.partial_rollout`)."""
    if not rl.partial_rollout:
        return
    from ..engines.registry import ROLLOUT_BACKENDS, user_backends
    for g, p in groups.items():
        row = p.rollout_row
        if row is not None and not _partial(row, options_of(row)):
            able = [n for n in user_backends(ROLLOUT_BACKENDS) if _partial(ROLLOUT_BACKENDS[n], {})]
            serving = " or generate_config.vllm.serve=true" if row.name == "vllm" else ""
            raise ConfigError(f"{PARTIAL_ROLLOUT_KEY}=true: worker group '{g}' generates on the {row.name} "
                              f"backend, which cannot take new weights while it generates; set "
                              f"{PARTIAL_ROLLOUT_KEY}=false{serving}, or {ROLLOUT_BACKEND_KEY} to one of "
                              f"{able} (with tp 1 and pp 1)")


def check_rollout_refusals(groups: dict[str, GroupPlan], options_of: Callable[[Backend], dict]) -> None:
    """Each group's rollout engine can be built with its options at its tensor-parallel size
    (`RolloutEngine.refusal`), checked here so that it fails before any worker starts."""
    for g, p in groups.items():
        row = p.rollout_row
        if row is None:
            continue
        try:
            why = row.load().refusal(options_of(row), p.tp)
        except ImportError:   # a plugin's engine that does not import here: its install check says so
            continue
        if why:
            raise ConfigError(f"worker group '{g}': {why}")


def _partial(row: Backend, options: dict) -> bool:
    try:
        return bool(row.load().takes_partial_rollout(options))
    except ImportError:   # a plugin's engine that does not import here: its install check says so
        return False


def deploy_groups(groups: dict[str, GroupPlan], model_kinds: dict[str, str], backends: Backends,
                  check_files: bool) -> list[str]:
    """Each worker group's deployment, as its backends declare it (engines/deployment.py): which backend's
    engines run there, with which options, as how many actors, and which of them read the dock and write.
    Each backend deploys each group once; the rows that run there are kept on the group. A dry run plans
    what a real run refuses (a split the backend cannot make) and says so in a note."""
    from ..engines.registry import resolve_group
    rollout, train = backends.rollout, backends.train
    notes: list[str] = []
    options = _ChosenOptions(backends.options_of)
    for g, p in groups.items():
        gens = any(generates(m) for m in p.mfcs)
        models = any(model_kinds[m.name] in MODEL_ENGINES for m in p.mfcs)
        slice_ = Slice(p.resources.dp, p.tp, p.pp, tuple(p.devices))
        try:
            resolved = resolve_group(rollout if gens else None, train if models else None, slice_)
        except DeployError as e:
            if check_files:
                raise ConfigError(f"worker group '{g}' ({', '.join(m.name for m in p.mfcs)}): {e}") from None
            notes.append(f"planned, not run: worker group '{g}': {e}")
            p.deployment = Deployment.refused(slice_)
            continue
        p.deployment, p.rollout_row, p.train_row = resolved.deployment, resolved.rollout, resolved.train
        _set_engine_options(p, rollout, train, options)
        notes.extend(_deploy_notes(p, rollout, train))
    return notes


class _ChosenOptions:
    """The chosen backends' options from their config sections, each parsed once and only when a group runs
    the backend (a bad option is refused then)."""

    def __init__(self, read: Callable[[Backend], dict]):
        self.read = read
        self.parsed: dict[int, dict] = {}

    def of(self, backend: Backend) -> dict:
        if id(backend) not in self.parsed:
            try:
                self.parsed[id(backend)] = self.read(backend)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return self.parsed[id(backend)]


def _set_engine_options(p: GroupPlan, rollout: Backend, train: Backend, options: _ChosenOptions) -> None:
    """The group's backends' engine options: the chosen backend's section (a split train backend reads none of
    it) and what the row tells an engine of the deployment."""
    if p.rollout_row is not None:
        p.rollout_options = {**options.of(rollout), **p.rollout_row.engine_options(p.deployment)}
    if p.train_row is not None:
        p.train_options = {**(options.of(train) if p.train_row is train else {}),
                           **p.train_row.engine_options(p.deployment)}


def _deploy_notes(p: GroupPlan, rollout: Backend, train: Backend) -> list[str]:
    """What the plan says of a group: the split backend it runs on, and a split group's readers and writers."""
    notes = []
    chosen = (rollout, train)
    split = [b for b in (p.rollout_row, p.train_row) if b is not None and all(b is not c for c in chosen)]
    if split:
        rollout_split = any(b is p.rollout_row for b in split)
        notes.append(f"worker group '{p.name}' (dp/tp/pp {p.resources.dp}/{p.tp}/{p.pp}) runs on the "
                     f"{'/'.join(b.name for b in split)} backend, which splits for "
                     f"{rollout.name if rollout_split else train.name} (docs/engines.md)")
    dep = p.deployment
    if dep.actors > 1 and (dep.tp > 1 or dep.pp > 1):
        readers = [r.rank for r in dep.roles() if r.reads]
        writers = [r.rank for r in dep.roles() if r.writes]
        turns = "; its model MFCs take turns on the group's ranks within a step" if dep.over_actors else ""
        notes.append(f"worker group '{p.name}': {dep.actors} actors ({dep.shape}, engine_tp {dep.engine_tp}); dock "
                     f"readers {readers}, writers {writers}{turns}")
    return notes


def check_group_backends(models: ModelSections, groups: dict[str, GroupPlan], model_kinds: dict[str, str],
                         model_paths: dict[str, str], train: Backend, check_files: bool) -> None:
    """The train backend runs every model engine but rollout: can its row run each group's models there (the
    device, the model itself, the features asked for, a reward model, a critic)?"""
    for g, p in groups.items():
        if p.train_row is None:
            continue
        row = p.train_row
        engines = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES]
        if engines and p.resources.device != "auto" and p.resources.device not in row.devices:
            raise ConfigError(f"{TRAIN_BACKEND_KEY}={row.name}: runs on {list(row.devices)}, but worker "
                              f"group '{g}' ({engines}) has device={p.resources.device!r}; pick a backend that runs "
                              f"there (docs/engines.md) or put the group on {row.devices[0]}")
        if check_files and engines:
            _check_train_model(row, p, [m for m in p.mfcs if model_kinds[m.name] in ("policy", "value")],
                               model_paths)
        trained_in_group: dict[str, bool] = {}
        for m in p.mfcs:
            if model_kinds[m.name] in MODEL_ENGINES:
                trained_in_group[m.model_name] = (trained_in_group.get(m.model_name, False)
                                                  or InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP)
        check_features(models, g, row, trained_in_group, p.resources.device)
        rewards = [m.name for m in p.mfcs if model_kinds[m.name] == "reward"]
        if rewards:
            _check_reward_backend(models.reward.backend, g, p, rewards)
        values = [m.name for m in p.mfcs if model_kinds[m.name] == "value"]
        if values and not row.value_models:
            raise ConfigError(f"{TRAIN_BACKEND_KEY}={train.name}: cannot run a critic ({values}: a value head); "
                              "use torch or fsdp for algorithms with a critic")


def _check_reward_backend(backend: str | None, g: str, p: GroupPlan, mfcs: list[str]) -> None:
    """A reward model runs on a train backend that declares it can (`Backend.reward_models`), whole (no tp or pp);
    `backend`: reward_model.backend (null: the group's)."""
    from ..engines.registry import TRAIN_BACKENDS, user_backends
    row = TRAIN_BACKENDS.get(backend) if backend else p.train_row
    name = backend or p.train_backend
    key = f"{REWARD_SECTION}.backend" if backend else TRAIN_BACKEND_KEY
    if row is None:
        raise ConfigError(f"{key}={name!r}: must be one of {user_backends(TRAIN_BACKENDS)} (docs/engines.md)")
    if not row.reward_models:
        able = [b.name for b in TRAIN_BACKENDS.values() if b.user and b.reward_models]
        split = f" (worker group '{g}' has tp/pp {p.tp}/{p.pp})" if p.tp * p.pp > 1 else ""
        raise ConfigError(f"{key}={name!r}: the {name} train backend{split} cannot run a reward model ({mfcs}: a "
                          f"one-label sequence classifier); use one of {able} with tp: 1, pp: 1")


def check_rollout_model(actor: ActorConfig, backend: Backend, generating: list[GroupPlan]) -> None:
    """The rollout backend's own check of the model on the devices generation runs on (vLLM's CPU
    attention runs only some head sizes), before any worker starts rather than after an engine build."""
    if not backend.check_model or not generating:
        return
    from ..device import resolve_device
    from ..models import resolve_model_path
    path = str(resolve_model_path(actor.model_path))
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
            raise ConfigError(f"{ROLLOUT_BACKEND_KEY}={backend.name!r} with {path_key('actor')}="
                              f"{actor.model_path!r}: {e}") from None


def _check_train_model(backend: Backend, group: GroupPlan, mfcs: list[MFCDef], model_paths: dict[str, str]) -> None:
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


def check_dynamic_sampling_groups(groups: dict[str, GroupPlan], model_kinds: dict[str, str]) -> None:
    """Dynamic sampling with a model run collectively over several ranks is refused: a step the cap ends
    short of prompts_per_step kept groups has fewer rows than the ranks' equal shares, so one rank would
    make a collective call (a gradient all-reduce, a sharded forward) that another never makes."""
    for g, p in groups.items():
        models = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES
                  and InterfaceType(m.interface_type) in (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
        if models and (p.resources.dp > 1 or p.tp > 1 or p.pp > 1):
            raise ConfigError(
                f"{DYNAMIC_SAMPLING_KEY}=true with worker group '{g}' ({models}) at dp={p.resources.dp} "
                f"tp={p.tp} pp={p.pp}: a step that ends short of {PROMPTS_PER_STEP_KEY} kept groups "
                "(rl_config.max_oversample reached) gives its ranks unequal rows, and their collective steps would "
                f"wait on each other; run that group on one rank (dp=tp=pp=1) or set {DYNAMIC_SAMPLING_KEY}=false")


def check_collective_devices(groups: dict[str, GroupPlan]) -> None:
    """Refuse a group whose ranks share torch's process group over NCCL or HCCL and could land two on one
    device: NCCL refuses two ranks of a communicator on one GPU (and HCCL one NPU) when the group first
    talks. Outside mode mesh Ray places each actor by its share of a device, so a share below one may pack two
    ranks onto one device; in mode mesh each rank's devices are its own by construction, checked here too."""
    from ..device import accelerator_share
    for g, p in groups.items():
        if p.deployment is None or not p.deployment.joins_default_process_group or p.world < 2:
            continue
        share = accelerator_share(p.resources)
        if p.devices:
            held = [set(p.actor_devices(k)) for k in range(p.world)]
            shared = sorted({d for a in range(len(held)) for b in range(a) for d in held[a] & held[b]})
            if shared and share:
                raise ConfigError(f"{MESH_KEY}: group '{g}' puts two of its ranks on device(s) {shared}; its "
                                  "collectives (NCCL/HCCL) need one device per rank: give its MFCs as many devices "
                                  "as dp * tp * pp")
        elif 0 < share < 1:
            field_ = "num_gpus" if p.resources.num_gpus else "num_npus"
            raise ConfigError(f"{GROUPS_KEY}.{g}.{field_}={share:g} with {p.world} ranks in one process group: "
                              f"Ray may place two of them on one device, which NCCL/HCCL refuse; give each rank a "
                              f"whole device ({field_}: 1), or place the MFCs by mesh ({PLACEMENT_MODE_KEY}=mesh)")


def check_device_shares(groups: dict[str, GroupPlan]) -> None:
    """Refuse groups holding fractions of an accelerator whose shares of one device add up to more than one:
    actor k of every such group shares the k-th device (their shared reservation, `trainer/launch.group_bundles`),
    which Ray could not reserve."""
    from ..device import accelerator_share
    fractional = {g: groups[g] for g in device_sharing_groups(groups)}
    for k in range(max((p.world for p in fractional.values()), default=0)):
        on_k = {g: accelerator_share(p.resources) for g, p in fractional.items() if k < p.world}
        if sum(on_k.values()) > 1 + 1e-9:
            field_ = "num_gpus" if any(p.resources.num_gpus for p in fractional.values()) else "num_npus"
            raise ConfigError(f"{GROUPS_KEY}: the groups holding a fraction of a device share one per actor index, "
                              f"and on device {k} their {field_} add up to {sum(on_k.values()):g} ("
                              + ", ".join(f"{g}: {v:g}" for g, v in on_k.items())
                              + f"); lower {GROUPS_KEY}.<group>.{field_} so they add up to at most 1, or give a group "
                                "whole devices")
