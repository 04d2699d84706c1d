"""How the megatron backend builds an engine (`MegatronTrainEngine.build`, engine.py): the options checked,
megatron's parallel state started, the GPTModel made from the HF config and loaded from the HF weights,
megatron's DDP and optimizer wrapped around it. megatron-core is imported inside the functions, so this
module imports anywhere."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ...base import TrainSpec
from . import convert as C

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NPU_ADAPTORS = ("mindspeed.megatron_adaptor", "megatron_adaptor")
INSTALL = ("pip install megatron-core (and transformer-engine for layer_spec: te, which layer_spec: auto then "
           "picks) on a CUDA machine; on Ascend: torch_npu, megatron-core and MindSpeed's megatron adaptor")


def recompute_kwargs(gradient_checkpointing: bool) -> dict:
    """`TransformerConfig` keywords of activation checkpointing: megatron's full recompute of every
    transformer layer, one layer per checkpointed chunk (only each layer's input is kept), as the
    torch and fsdp backends checkpoint each decoder layer."""
    if not gradient_checkpointing:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


class _LazySafetensors(Mapping):
    """name -> tensor over an HF checkpoint's safetensors files, read one tensor at a time."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self._where: dict[str, Any] = {}
        self._handles = []
        for name in files:
            h = safe_open(os.path.join(directory, name), framework="pt")
            self._handles.append(h)
            for k in h.keys():
                self._where[k] = h

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].get_tensor(name)
        except KeyError:
            raise KeyError(f"the HF checkpoint has no weight {name!r}") from None

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def transformer_engine_installed() -> bool:
    """Is the `transformer_engine` package installed (found on the import path)? Only looked up, not imported:
    importing it loads its CUDA libraries."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_layer_spec(name: str, device_kind: str) -> str:
    """The layer spec an engine builds: `local` and `te` as asked; `auto`, Transformer Engine's fused layers
    (`te`: fused norm + linear, TE's attention and GEMM kernels, what megatron's own GPU recipes build) on CUDA where
    transformer_engine is installed, else megatron's local layers (TE is a CUDA library: an NPU or a machine
    without it gets `local`)."""
    if name not in C.LAYER_SPEC_OPTIONS:
        raise ValueError(f"megatron backend: layer_spec={name!r}; use one of {C.LAYER_SPEC_OPTIONS}")
    if name != C.AUTO:
        return name
    return C.TE if device_kind == "cuda" and transformer_engine_installed() else C.LOCAL


def checked_options(spec: TrainSpec, defaults: Mapping[str, Any]) -> dict:
    """`spec.options` over `defaults`, refused where megatron cannot run them (unknown keys, a layer spec,
    a value model, a dtype, fp16 training); `layer_spec: auto` resolved to the spec this machine builds."""
    from ....device import device_type
    unknown = sorted(set(spec.options) - set(defaults))
    if unknown:
        raise ValueError(f"megatron backend: unknown option(s) {unknown}; known: {sorted(defaults)}")
    opts = {**defaults, **spec.options}
    opts["layer_spec"] = resolve_layer_spec(opts["layer_spec"], device_type(spec.device))
    if spec.model_kind != "causal_lm":
        raise NotImplementedError("megatron backend: value models (critic) are not built on megatron-core "
                                  "here (GPTModel has no 1-wide value head); use backend torch or fsdp for "
                                  "the critic")
    if spec.dtype not in DTYPES:
        raise ValueError(f"megatron backend: dtype={spec.dtype!r}; use one of {sorted(DTYPES)}")
    if spec.dtype == "float16" and spec.optim is not None:
        raise ValueError("megatron backend: training in float16 (loss scaling) is not supported; use bfloat16")
    return opts


def open_device(spec: TrainSpec, opts: Mapping[str, Any]) -> torch.device:
    """The engine's device, made current; on an NPU MindSpeed's adaptor is imported first (before megatron),
    and the CPU is refused."""
    from ....device import device_type, set_device
    kind = device_type(spec.device)   # "npu:0" parses before torch_npu is imported
    if kind == "npu":
        _import_npu_adaptor(opts["npu_adaptor"])   # torch_npu, then the adaptor, before megatron
    elif kind != "cuda":
        raise RuntimeError(f"megatron backend: device {spec.device!r}; megatron-core's GPTModel forward needs "
                           f"CUDA (or an Ascend NPU with MindSpeed's adaptor). On the CPU use backend torch or "
                           f"fsdp")
    set_device(spec.device)
    return torch.device(spec.device)


def start_parallel_state(tp: int, pp: int, seed: int, device: torch.device) -> bool:
    """megatron's TP/PP/DP groups over the default group (a second engine of the process reuses them: same tp
    and pp); returns whether a one-process default group was started here."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
    except ImportError as e:
        raise ImportError(f"megatron backend needs megatron-core: {e}; {INSTALL}") from e
    own_group = _init_process_group(tp * pp, device)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"megatron backend: world size {world} is not a multiple of tp*pp = {tp * pp}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron backend: this process already runs tp={have[0]}, pp={have[1]}; "
                             f"every megatron engine of a process must use the same tp and pp")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return own_group


def load_model(spec: TrainSpec, opts: Mapping[str, Any], device: torch.device):
    """This rank's GPTModel (its PP stage and TP shard) with the HF checkpoint's weights, and what runs it
    (Float16Module in bf16/fp16, megatron's recipe); returns (model, runnable, TransformerConfig, dims)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    tp, pp = int(opts["tp"]), int(opts["pp"])
    dims = C.Qwen2Dims.from_hf(AutoConfig.from_pretrained(spec.model_path))
    dtype = DTYPES[spec.dtype]
    first, last = opts["num_layers_in_first_pipeline_stage"], opts["num_layers_in_last_pipeline_stage"]
    kw = C.transformer_config_kwargs(dims, tp=tp, pp=pp, dtype=dtype, num_layers_in_first_pipeline_stage=first,
                                     num_layers_in_last_pipeline_stage=last)
    kw.update(recompute_kwargs(spec.gradient_checkpointing and spec.optim is not None))
    # perform_initialization stays on: megatron marks TP-sharded params (tensor_model_parallel) in its
    # init functions, and the grad norm counts unmarked ones as TP duplicates (the weights are then
    # overwritten by the checkpoint)
    config = TransformerConfig(**kw)
    model = GPTModel(config=config, transformer_layer_spec=_layer_spec(opts["layer_spec"]),
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     **C.gpt_model_kwargs(dims, tp=tp,
                                          make_vocab_size_divisible_by=opts["make_vocab_size_divisible_by"]))
    model.to(device)
    weights = C.hf_to_mcore_rank(_LazySafetensors(spec.model_path), dims, tp=tp,
                                 tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp,
                                 pp_rank=ps.get_pipeline_model_parallel_rank(), layer_spec=opts["layer_spec"],
                                 make_vocab_size_divisible_by=opts["make_vocab_size_divisible_by"],
                                 first=first, last=last)
    load_exact(model, weights)
    runnable = model
    if dtype != torch.float32:
        # megatron's own recipe (training.get_model): the module cast to bf16/fp16, last-stage
        # outputs back to fp32; the optimizer keeps fp32 main params
        from megatron.core.transformer.module import Float16Module
        runnable = Float16Module(config, model)
    return model, runnable, config, dims


def wrap_for_training(spec: TrainSpec, opts: Mapping[str, Any], config, model, runnable):
    """(what runs forward, the optimizer): megatron's DDP and (distributed) optimizer around `runnable` for a
    trained engine; `runnable` in eval mode, its parameters frozen, and no optimizer for an inference one."""
    if spec.optim is None:
        runnable.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return runnable, None
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    o, dtype = spec.optim, DTYPES[spec.dtype]
    ddp_model = DistributedDataParallel(
        config=config, module=runnable,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=opts["use_distributed_optimizer"]))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                        adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.grad_clip,
                        bf16=dtype == torch.bfloat16, params_dtype=dtype,
                        use_distributed_optimizer=opts["use_distributed_optimizer"]),
        [ddp_model])
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    ddp_model.train()
    return ddp_model, optimizer


def _import_npu_adaptor(name: str | None) -> None:
    from ....device import require_torch_npu
    require_torch_npu()
    tried = [name] if name else list(NPU_ADAPTORS)
    for module in tried:
        try:
            importlib.import_module(module)
            return
        except ImportError:
            continue
    raise ImportError(f"megatron backend on NPU: none of {tried} imports; install MindSpeed (Ascend's megatron "
                      f"adaptor) matching your megatron-core, or set the option npu_adaptor")


def _init_process_group(model_ranks: int, device: torch.device) -> bool:
    """Use the caller's default group; start a one-process one when a single rank runs the model."""
    if dist.is_initialized():
        return False
    if model_ranks != 1:
        raise RuntimeError(f"megatron backend: tp*pp = {model_ranks} ranks need torch.distributed initialized over "
                           f"all of the model's ranks before build (the worker group starts them)")
    from ....device import dist_backend
    from ...sync.weight_sync import free_port
    dist.init_process_group(dist_backend(device), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def _layer_spec(name: str):
    if name == C.TE:
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError as e:   # installed (what `auto` looks up) but not importable: a build for another torch
            raise ImportError(f"megatron backend: layer_spec te (which layer_spec: auto picks where transformer_engine "
                              f"is installed) does not import: {e}; install a transformer-engine built for this "
                              f"torch, or set actor_config.backend_options.layer_spec: local") from e
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def load_exact(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load converted weights; every weight of the stage must be given (TE's _extra_state aside)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron backend: converted HF weights do not fit the GPTModel: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
