"""The plan's backends: the registry's rows a config chooses, resolved once, deployed once per worker group
(engines/registry.py, engines/deployment.py) and checked against what each group runs. The rows are kept on
the GroupPlan; nothing here compares a backend's name or shape, it asks the row."""
from __future__ import annotations

from ..config import Config, ConfigError
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..engines.deployment import Deployment, DeployError, Slice
from ..engines.registry import Backend
from .model_features import check_features
from .plan_types import MODEL_ENGINES, GroupPlan, generates


def choose_backends(cfg: Config) -> tuple[Backend, Backend]:
    """The registry's rows of the rollout and train backends a config runs; refuses a name the registry lacks."""
    from ..engines import registry
    for key, table, name in (("generate_config.backend", registry.ROLLOUT_BACKENDS, cfg.generate_config.backend),
                             ("actor_config.backend", registry.TRAIN_BACKENDS, cfg.actor_config.backend)):
        if name not in registry.user_backends(table):
            raise ConfigError(f"{key}={name!r}: must be one of {registry.user_backends(table)} (docs/engines.md)")
    rollout, train = registry.chosen_backends(cfg)
    return registry.ROLLOUT_BACKENDS[rollout], registry.TRAIN_BACKENDS[train]


def check_installed(rollout: Backend, train: Backend) -> None:
    """A real run: each backend's package imports here, else its install command, before any worker starts."""
    from ..config.checks import installed
    for key, backend in (("generate_config.backend", rollout), ("actor_config.backend", train)):
        if backend.needs and not installed(backend.needs):
            raise ConfigError(f"{key}={backend.name}: the {backend.needs} package is not installed here; "
                              f"{backend.install}")


def check_own_process(rollout: Backend, groups: dict[str, GroupPlan]) -> None:
    """A rollout backend that must have its process to itself shares no group with another model MFC."""
    if not rollout.own_process:
        return
    for g, p in groups.items():
        gens = [m.name for m in p.mfcs if generates(m)]
        others = [m.name for m in p.mfcs if InterfaceType(m.interface_type) in
                  (InterfaceType.INFERENCE, InterfaceType.TRAIN_STEP)]
        if gens and others:
            raise ConfigError(f"generate_config.backend={rollout.name}: worker group '{g}' hosts {gens} and "
                              f"{others}, but {rollout.name} must have its process to itself (it takes torch's "
                              "default process group, re-seeds the RNGs and patches torch.set_num_threads); move "
                              "the generate MFCs to a group of their own")


def check_rollout_split(cfg: Config, backend: Backend, rollout: dict) -> None:
    """A rollout MFC with tp or pp > 1 runs only where its backend's deployment splits that way."""
    for n, p in rollout.items():
        try:
            dep = backend.deploy(Slice(p.dp, p.tp, p.pp))
        except DeployError as e:
            what = f"pp={p.pp}" if p.tp == 1 or not backend.whole_copies else f"dp/tp/pp {p.strategy}"
            raise ConfigError(f"placement.mfcs.{n}: {what} with generate_config.backend={backend.name!r}: {e}") from None
        if dep.over_actors and cfg.rl_config.max_weight_staleness:
            raise ConfigError(f"placement.mfcs.{n}: dp/tp/pp {p.strategy} generation on the mesh with "
                              f"rl_config.max_weight_staleness={cfg.rl_config.max_weight_staleness}: a weight sync "
                              f"would land on some ranks of a replica between two of their collective forwards and "
                              f"not on others; use max_weight_staleness: 0 with a split generation, or tp: 1, pp: 1")


def check_partial_rollout(cfg: Config, groups: dict[str, GroupPlan]) -> None:
    """rl_config.partial_rollout: every group's rollout engine can take weights while it generates
    (`RolloutEngine.partial_rollout`)."""
    if not cfg.rl_config.partial_rollout:
        return
    from ..engines.registry import ROLLOUT_BACKENDS, backend_options, user_backends
    for g, p in groups.items():
        row = p.rollout_row
        if row is not None and not _partial(row, backend_options(cfg, row)):
            able = [n for n in user_backends(ROLLOUT_BACKENDS) if _partial(ROLLOUT_BACKENDS[n], {})]
            serving = " or generate_config.vllm.serve=true" if row.name == "vllm" else ""
            raise ConfigError(f"rl_config.partial_rollout=true: worker group '{g}' generates on the {row.name} "
                              f"backend, which cannot take new weights while it generates; set "
                              f"rl_config.partial_rollout=false{serving}, or generate_config.backend to one of "
                              f"{able} (with tp 1 and pp 1)")


def check_rollout_refusals(cfg: Config, groups: dict[str, GroupPlan]) -> None:
    """Each group's rollout engine can be built with its options at its tensor-parallel size
    (`RolloutEngine.refusal`), checked here so that it fails before any worker starts."""
    from ..engines.registry import backend_options
    for g, p in groups.items():
        row = p.rollout_row
        if row is None:
            continue
        try:
            why = row.load().refusal(backend_options(cfg, row), p.tp)
        except ImportError:   # a plugin's engine that does not import here: its install check says so
            continue
        if why:
            raise ConfigError(f"worker group '{g}': {why}")


def _partial(row: Backend, options: dict) -> bool:
    try:
        return bool(row.load().takes_partial_rollout(options))
    except ImportError:   # a plugin's engine that does not import here: its install check says so
        return False


def deploy_groups(cfg: Config, groups: dict[str, GroupPlan], model_kinds: dict[str, str], rollout: Backend,
                  train: Backend, check_files: bool) -> list[str]:
    """Each worker group's deployment, as its backends declare it (engines/deployment.py): which backend's
    engines run there, with which options, as how many actors, and which of them read the dock and write.
    Each backend deploys each group once; the rows that run there are kept on the group. A dry run plans
    what a real run refuses (a split the backend cannot make) and says so in a note."""
    from ..engines.registry import resolve_group
    notes: list[str] = []
    options = _ChosenOptions(cfg)
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

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.parsed: dict[int, dict] = {}

    def of(self, backend: Backend) -> dict:
        from ..engines.registry import backend_options
        if id(backend) not in self.parsed:
            try:
                self.parsed[id(backend)] = backend_options(self.cfg, backend)
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


def check_group_backends(cfg: Config, groups: dict[str, GroupPlan], model_kinds: dict[str, str],
                         model_paths: dict[str, str], train: Backend, check_files: bool) -> None:
    """The train backend runs every model engine but rollout: can its row run each group's models there (the
    device, the model itself, the features asked for, a reward model, a critic)?"""
    for g, p in groups.items():
        if p.train_row is None:
            continue
        row = p.train_row
        engines = [m.name for m in p.mfcs if model_kinds[m.name] in MODEL_ENGINES]
        if engines and p.resources.device != "auto" and p.resources.device not in row.devices:
            raise ConfigError(f"actor_config.backend={row.name}: runs on {list(row.devices)}, but worker "
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
        check_features(cfg, g, row, trained_in_group, p.resources.device)
        rewards = [m.name for m in p.mfcs if model_kinds[m.name] == "reward"]
        if rewards:
            _check_reward_backend(cfg, g, p, rewards)
        values = [m.name for m in p.mfcs if model_kinds[m.name] == "value"]
        if values and not row.value_models:
            raise ConfigError(f"actor_config.backend={train.name}: cannot run a critic ({values}: a value head); "
                              "use torch or fsdp for algorithms with a critic")


def _check_reward_backend(cfg: Config, g: str, p: GroupPlan, mfcs: list[str]) -> None:
    """A reward model runs on a train backend that declares it can (`Backend.reward_models`), whole (no tp or pp)."""
    from ..engines.registry import TRAIN_BACKENDS, user_backends
    row = TRAIN_BACKENDS.get(cfg.reward_model.backend) if cfg.reward_model.backend else p.train_row
    name = cfg.reward_model.backend or p.train_backend
    key = "reward_model.backend" if cfg.reward_model.backend else "actor_config.backend"
    if row is None:
        raise ConfigError(f"{key}={name!r}: must be one of {user_backends(TRAIN_BACKENDS)} (docs/engines.md)")
    if not row.reward_models:
        able = [b.name for b in TRAIN_BACKENDS.values() if b.user and b.reward_models]
        split = f" (worker group '{g}' has tp/pp {p.tp}/{p.pp})" if p.tp * p.pp > 1 else ""
        raise ConfigError(f"{key}={name!r}: the {name} train backend{split} cannot run a reward model ({mfcs}: a "
                          f"one-label sequence classifier); use one of {able} with tp: 1, pp: 1")


def check_rollout_model(cfg: Config, backend: Backend, generating: list[GroupPlan]) -> None:
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
