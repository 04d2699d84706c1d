"""Training with megatron-core: TP/PP GPTModel, megatron's DDP and (distributed) optimizer, its
pipeline schedules, dist_checkpointing (`actor_config.backend: megatron`).

WHAT RUNS WHERE -- read this first. megatron-core's GPTModel, DDP and optimizers need a CUDA device:
its rotary embedding, default causal mask, RNG tracker (`model_parallel_cuda_manual_seed`), grad
buffers, optimizers and grad clipping allocate on or assert `cuda`. On an Ascend NPU it runs only with
MindSpeed's megatron adaptor imported first (it patches those calls onto torch_npu), which `build()`
does. On the CPU `build()` refuses with a clear error. This project's CI has no GPU and no
megatron-core: the CI tests (tests/engines/test_megatron_convert.py) cover the pure-torch pieces
(`right_padded`, `vocab_parallel_log_probs`, the conversion in `convert.py`) and check that the
engine refuses the CPU. During development the whole engine was also run, outside CI, against
megatron-core 0.16.1 on CPU gloo ranks with megatron's CUDA-only calls shimmed to the CPU in a
throwaway script (tp x pp x dp = 1x1x1, 2x1x1, 1x2x1, 2x2x1, 1x1x2, 1x2x2; plain and distributed
optimizer; tied and untied): log-probs, the train step's loss metrics and grad norm, the updated
weights, export/update_weights and checkpoint save/load agreed with the torch backend
(docs/engines.md has the numbers). It has not run on a GPU or an NPU. No part of it is a stub: every
call is megatron-core's public API as of 0.16.

Calling contract (the mesh backend's; every rank of the model calls every method, in the same order):

* A replica is the tp*pp ranks of one DP index (megatron's model-parallel group). Its reader is
  stage 0 / TP rank 0 (`is_dock_reader`), its writer the last stage / TP rank 0 (`is_dock_writer`); `coord` is
  (pp, dp, tp) as `parallel.topology` numbers ranks (megatron's default rank order tp-cp-ep-dp-pp is
  the same layout: global rank = pp * dp * tp + dp_idx * tp + tp_idx).
* `train_step(micro_batches, loss_fn)`: only the reader iterates `micro_batches` (to the end: the
  schedule needs the count); it broadcasts them to its replica (`parallel.broadcast_micro_batch`);
  other ranks pass None and the same `loss_fn`. Metrics are the replica's, on every rank. Replicas
  may run different micro-batch counts (DP gradients are reduced once, after the schedule).
* `log_probs(prompts, responses, micro_batch_size)`: the reader's rows (others pass None); the
  result is returned on every rank of the last stage, None elsewhere.
* `export_weights`: every rank iterates to the end and gets the same full HF-named buckets.
  `update_weights`: local, every rank is given the full tensors and keeps its stage's TP shard.
  `save_checkpoint` / `load_checkpoint`: every rank.

How it runs:

* The process group. `torch.distributed` must already be initialized over all tp*pp*dp ranks of the
  model (the worker group starts them); a single rank (tp = pp = dp = 1) starts a one-process group
  itself. `parallel_state.initialize_model_parallel` builds the TP/PP/DP groups; a second engine in
  the process (the reference) reuses them (same tp and pp).
* The model. `GPTModel` from `convert.transformer_config_kwargs` / `gpt_model_kwargs`, megatron's local
  layer spec (`layer_spec: local`, plain torch modules) or Transformer Engine's (`layer_spec: te`),
  `pre_process`/`post_process` by PP stage. Weights come from the HF safetensors through
  `convert.hf_to_mcore_rank` (each rank reads only its stage's tensors and keeps its TP shard).
* Batches are right-padded (`right_padded`): prompt and response back to back from column 0, so the
  causal mask alone is right and no attention mask is passed (works with both layer specs); the
  logits that predict response token t of row i sit at column len(prompt_i) + t - 1. With pp > 1 a
  step's micro-batches are padded to one [rows, width] (the p2p exchanges have one shape) and cut
  back before the loss.
* Log-probs on the last PP stage from vocab-sharded logits (`vocab_parallel_log_probs`: max and
  sum-exp all-reduced over the TP group, the target logit taken on the rank that holds it, exact
  gradients). Megatron's padded vocab rows are masked out, so the distribution is HF's.
* `train_step` runs `get_forward_backward_func()` (1F1B when pp > 1) with a loss that is the
  worker's `loss_fn` times `loss_scale * num_microbatches` (the schedule divides by
  num_microbatches); `finalize_model_grads` reduces over DP (and the tied embedding over the
  first/last stage); then `prepare_grads` + `get_grad_norm`: a non-finite norm skips the update
  (the `TrainEngine` contract), else `optimizer.step()` clips and steps. fp16 training (loss
  scaling) is refused (its scaler would be updated twice); bf16 and fp32 are supported. Megatron's
  param groups exempt biases and norms from weight decay (the torch backend decays everything).
* `export_weights` gathers one layer at a time over TP (all_gather) and sends it from its PP stage
  to the others (broadcast over the PP group), converts it to HF names, and buckets it.
* Checkpoints: `megatron.core.dist_checkpointing.save/load` of the model's and optimizer's
  `sharded_state_dict` under `<directory>/megatron/`; the distributed optimizer's state as
  `dp_reshardable` (fully parallel; reshardable over DP).

Options (`TrainSpec.options`, from the config): tp, pp, layer_spec (local|te),
make_vocab_size_divisible_by (128), use_distributed_optimizer (True),
num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage (None), npu_adaptor
(the module to import first on NPU; default tries `mindspeed.megatron_adaptor`, then `megatron_adaptor`).

Model features (`TrainSpec` fields): `gradient_checkpointing` is megatron's full recompute of every layer
(`recompute_kwargs`); `max_tokens_per_micro_batch` makes each forward a token-budget group of rows, for
log-probs and for training (`_train_step_split`). Both are written against megatron-core's API and have
not run: only the recompute options' mapping is tested here.

Not built here: value models (a critic needs a 1-wide output head megatron's GPTModel does not have;
use backend torch, fsdp or mesh for the critic), virtual pipeline stages, sequence/context
parallelism, fp16 loss scaling.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ....algorithms.metrics import merge_metrics
from ...base import Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, TrainEngine, TrainSpec, bucketed
from ...batching import forward_groups, join_groups, right_pad
from . import convert as C

OPTIONS = {"tp": 1, "pp": 1, "dp": None, "layer_spec": C.LOCAL, "make_vocab_size_divisible_by": 128,
           "use_distributed_optimizer": True, "num_layers_in_first_pipeline_stage": None,
           "num_layers_in_last_pipeline_stage": None, "npu_adaptor": None}


@dataclass
class MegatronOptions:
    """The megatron backend's options (actor_config.backend_options); tp and pp come from the placement
    (placement.mfcs.<mfc>.tp/pp in placement.mode: mesh)."""
    layer_spec: str = C.LOCAL                         # local (megatron's own layers) or te (transformer-engine)
    make_vocab_size_divisible_by: int = 128
    use_distributed_optimizer: bool = True
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    npu_adaptor: Optional[str] = None                 # Ascend: the module that adapts megatron to torch_npu

    def check(self) -> None:
        if self.layer_spec not in C.LAYER_SPECS:
            raise ValueError(f"layer_spec={self.layer_spec!r}: use one of {list(C.LAYER_SPECS)}")
        if isinstance(self.make_vocab_size_divisible_by, bool) or not isinstance(
                self.make_vocab_size_divisible_by, int) or self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by!r}: an integer >= 1")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NPU_ADAPTORS = ("mindspeed.megatron_adaptor", "megatron_adaptor")
INSTALL = ("pip install megatron-core (and transformer-engine for layer_spec: te) on a CUDA machine; on "
           "Ascend: torch_npu, megatron-core and MindSpeed's megatron adaptor")


def recompute_kwargs(gradient_checkpointing: bool) -> dict:
    """`TransformerConfig` keywords of activation checkpointing: megatron's full recompute of every
    transformer layer, one layer per checkpointed chunk (only each layer's input is kept), as the
    torch and fsdp backends checkpoint each decoder layer."""
    if not gradient_checkpointing:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


# --------------------------------------------------------------------------- pure-torch helpers
@dataclass
class RightPadded:
    """Rows laid out for a causal model without an attention mask (see the module doc)."""
    tokens: torch.Tensor          # [B, S] long: prompt then response, then pad
    position_ids: torch.Tensor    # [B, S] long: 0.. along each row (pads continue counting; unseen by real tokens)
    targets: torch.Tensor         # [B, S] long: tokens shifted left by one (the token each column predicts)
    index: torch.Tensor           # [B, R] long: the column predicting each response token (0 on padding)
    response_mask: torch.Tensor   # [B, R] float: 1 on real response tokens

    def to(self, device) -> "RightPadded":
        return RightPadded(*(t.to(device) for t in (self.tokens, self.position_ids, self.targets, self.index,
                                                    self.response_mask)))

    @property
    def rows(self) -> int:
        """Real rows (`tokens` may carry dummy rows after them, see `padded_to`)."""
        return self.index.shape[0]

    def padded_to(self, rows: int, width: int, pad_id: int) -> "RightPadded":
        """The same rows in a [rows, width] token block: pipeline stages exchange activations of one
        shape for every micro-batch, so with pp > 1 a step's micro-batches are padded to the largest.
        Extra columns are right padding (causal: unseen by real tokens); extra rows are all padding and
        are cut off before the loss (`index` and `response_mask` keep the real rows only)."""
        b, s = self.tokens.shape
        if rows < b or width < s:
            raise ValueError(f"cannot pad a [{b}, {s}] batch to [{rows}, {width}]")
        tokens = torch.full((rows, width), int(pad_id), dtype=self.tokens.dtype, device=self.tokens.device)
        tokens[:b, :s] = self.tokens
        targets = torch.full_like(tokens, int(pad_id))
        targets[:, :-1] = tokens[:, 1:]
        positions = torch.arange(width, device=tokens.device).expand(rows, width).contiguous()
        return RightPadded(tokens, positions, targets, self.index, self.response_mask)


def right_padded(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int,
                 multiple_of: int = 1) -> RightPadded:
    """Prompt + response of each row from column 0, right-padded to the longest row (rounded up to
    `multiple_of`). Response token t of row i is predicted by column len(prompt_i) + t - 1."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: need as many, at least one")
    lengths = [(int(p.numel()), int(r.numel())) for p, r in zip(prompts, responses)]
    if any(p == 0 for p, _ in lengths):
        raise ValueError("an empty prompt: the first response token would have no position predicting it")
    width = max(p + r for p, r in lengths)
    width = -(-width // multiple_of) * multiple_of
    rwidth = max(1, max(r for _, r in lengths))
    tokens = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
    index = torch.zeros((len(prompts), rwidth), dtype=torch.long)
    mask = torch.zeros((len(prompts), rwidth), dtype=torch.float32)
    for i, ((p, r), pr, rs) in enumerate(zip(lengths, prompts, responses)):
        tokens[i, :p] = torch.as_tensor(pr, dtype=torch.long)
        tokens[i, p:p + r] = torch.as_tensor(rs, dtype=torch.long)
        index[i, :r] = torch.arange(p - 1, p + r - 1)
        mask[i, :r] = 1.0
    targets = torch.cat([tokens[:, 1:], torch.full((len(prompts), 1), int(pad_id), dtype=torch.long)], dim=1)
    positions = torch.arange(width).expand(len(prompts), width).contiguous()
    return RightPadded(tokens, positions, targets, index, mask)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group in the forward, identity in the backward: every rank then computes the same
    loss from the sum, so each rank's local term gets the loss's gradient once (megatron's
    `reduce_from_tensor_model_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _AllReduceSum.apply(x, group)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                             vocab_size: int | None = None, group=None,
                             with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target and the entropy, from this rank's slice of the vocab.

    logits: [..., V_local] float, this rank's columns vocab_start .. vocab_start + V_local of the
    (padded) vocab; targets: [...] global token ids; vocab_size: the real vocab (columns at or past
    it are megatron's padding and get no probability); group: the TP group (None: one rank holds the
    whole vocab). Equal to `log_softmax(logits_full[..., :vocab_size])` at the targets, with gradients.
    """
    x = logits.float()
    local = x.shape[-1]
    valid = None
    if vocab_size is not None and vocab_start + local > vocab_size:
        valid = torch.arange(vocab_start, vocab_start + local, device=x.device) < vocab_size
        x = x.masked_fill(~valid, torch.finfo(x.dtype).min)
    m = x.detach().amax(dim=-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    # Only rank-local terms of x (and the constant m) are summed over the group, and the sums feed
    # only computations every rank repeats: that is what makes the identity backward of `_sum` exact.
    # (Entropy as sum(p * x) with p = exp(x - lse) would put the summed lse back into a local term.)
    e = (x - m.unsqueeze(-1)).exp()
    s = _sum(e.sum(-1), group)
    lse = m + s.log()
    inside = (targets >= vocab_start) & (targets < vocab_start + local)
    picked = x.gather(-1, (targets - vocab_start).clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum(torch.where(inside, picked, torch.zeros_like(picked)), group)
    logp = target_logit - lse
    if not with_entropy:
        return logp, None
    ex = e * (x if valid is None else torch.where(valid, x, torch.zeros_like(x)))
    return logp, lse - _sum(ex.sum(-1), group) / s     # H = lse - sum(p x), sum(p x) = sum(e x) / sum(e)


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


_PARALLEL_USERS = 0   # engines in this process sharing megatron's parallel_state


# ----------------------------------------------------------------------------------- the engine
class MegatronTrainEngine(TrainEngine):
    """See the module doc. Built by `build(spec)`; requires CUDA (or NPU + MindSpeed) and megatron-core."""
    collective_forward = True   # sharded weights: every forward gathers them across the DP ranks

    def __init__(self, *, model, runnable, optimizer, config, dims: C.Qwen2Dims, opts: dict, spec: TrainSpec,
                 device: torch.device, own_group: bool):
        from megatron.core import parallel_state as ps
        self.ps = ps
        self.module = model        # the GPTModel (this rank's stage and TP shard): its state dict, weights
        self.model = runnable      # what runs forward: DDP(Float16Module(GPTModel)) when training in bf16
        self.optimizer = optimizer
        self.config = config
        self.dims = dims
        self.opts = opts
        self.device = device
        self.dtype = DTYPES[spec.dtype]
        self.pad_token_id = int(spec.pad_token_id)
        self.temperature = float(spec.temperature)
        self.layer_spec = opts["layer_spec"]
        self.tp, self.pp = int(opts["tp"]), int(opts["pp"])
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_size = self.dp
        # a replica: the tp*pp ranks of one DP index (megatron's model-parallel group); its global
        # ranks sorted are [stage 0: tp 0..tp-1, stage 1: ...] (megatron's rank order tp-cp-ep-dp-pp)
        self.replica_group = ps.get_model_parallel_group() if self.tp * self.pp > 1 else None
        replica = sorted(dist.get_process_group_ranks(self.replica_group)) if self.replica_group else [dist.get_rank()]
        self.reader_rank = replica[0]                         # stage 0, TP rank 0: reads the dock
        self.writer_rank = replica[(self.pp - 1) * self.tp]   # last stage, TP rank 0: writes results
        self.is_dock_reader = dist.get_rank() == self.reader_rank
        self.is_dock_writer = dist.get_rank() == self.writer_rank
        self.padded_vocab = C.padded_vocab_size(dims.vocab_size, opts["make_vocab_size_divisible_by"], self.tp)
        self.layers = C.pp_layer_range(dims.num_layers, self.pp, self.pp_rank,
                                       opts["num_layers_in_first_pipeline_stage"],
                                       opts["num_layers_in_last_pipeline_stage"])
        self.own_group = own_group
        self.version = 0
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        from ..torch_train import check_token_budget
        # at most this many tokens per forward, counted as `batching.padded_tokens` does (an upper bound of
        # the right-padded layout's rows x longest row)
        self.max_tokens = check_token_budget(spec.max_tokens_per_micro_batch)

    # ------------------------------------------------------------------------------ build
    @classmethod
    def build(cls, spec: TrainSpec) -> "MegatronTrainEngine":
        global _PARALLEL_USERS
        unknown = sorted(set(spec.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"megatron backend: unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
        opts = {**OPTIONS, **spec.options}
        if opts["layer_spec"] not in C.LAYER_SPECS:
            raise ValueError(f"megatron backend: layer_spec={opts['layer_spec']!r}; use one of {C.LAYER_SPECS}")
        if spec.model_kind != "causal_lm":
            raise NotImplementedError("megatron backend: value models (critic) are not built on megatron-core "
                                      "here (GPTModel has no 1-wide value head); use backend torch or fsdp for "
                                      "the critic")
        if spec.dtype not in DTYPES:
            raise ValueError(f"megatron backend: dtype={spec.dtype!r}; use one of {sorted(DTYPES)}")
        if spec.dtype == "float16" and spec.optim is not None:
            raise ValueError("megatron backend: training in float16 (loss scaling) is not supported; use bfloat16")
        from ....device import device_type, set_device
        kind = device_type(spec.device)   # "npu:0" parses before torch_npu is imported
        if kind == "npu":
            _import_npu_adaptor(opts["npu_adaptor"])   # torch_npu, then the adaptor, before megatron
        elif kind != "cuda":
            raise RuntimeError(f"megatron backend: device {spec.device!r}; megatron-core's GPTModel forward needs "
                               f"CUDA (or an Ascend NPU with MindSpeed's adaptor). On the CPU use backend torch or "
                               f"fsdp")
        set_device(spec.device)
        device = torch.device(spec.device)
        try:
            from megatron.core import parallel_state as ps
            from megatron.core import tensor_parallel
            from megatron.core.models.gpt import GPTModel
            from megatron.core.transformer import TransformerConfig
        except ImportError as e:
            raise ImportError(f"megatron backend needs megatron-core: {e}; {INSTALL}") from e
        from transformers import AutoConfig

        tp, pp = int(opts["tp"]), int(opts["pp"])
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
            tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)

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
        _load_exact(model, weights)
        runnable = model
        if dtype != torch.float32:
            # megatron's own recipe (training.get_model): the module cast to bf16/fp16, last-stage
            # outputs back to fp32; the optimizer keeps fp32 main params
            from megatron.core.transformer.module import Float16Module
            runnable = Float16Module(config, model)

        ddp_model = optimizer = None
        if spec.optim is not None:
            from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                                   finalize_model_grads)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            o = spec.optim
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
        else:
            runnable.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        _PARALLEL_USERS += 1
        return cls(model=model, runnable=ddp_model if ddp_model is not None else runnable, optimizer=optimizer,
                   config=config, dims=dims, opts=opts, spec=spec, device=device, own_group=own_group)

    @property
    def coord(self) -> tuple[int, int, int]:
        """(pp, dp, tp) of this rank, as `parallel.topology.ProcessTopology.coord` has it."""
        return self.pp_rank, self.dp_rank, self.tp_rank

    # ------------------------------------------------------------------ data from the reader
    def _wire_device(self):
        return self.device if dist.get_backend() != "gloo" else None

    def _bcast_obj(self, obj, src: int):
        if self.replica_group is None:
            return obj
        box = [obj if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src, group=self.replica_group, device=self._wire_device())
        return box[0]

    def _bcast_rows(self, data: dict | None) -> dict:
        """The reader's columns ({name: [1-D tensor per row]}) on every rank of the replica."""
        from ....parallel.broadcast import broadcast_micro_batch
        if self.replica_group is None:
            return data
        n = len(next(iter(data.values()))) if self.is_dock_reader and data else 0
        out, _ = broadcast_micro_batch(data if self.is_dock_reader else None, list(range(n)) if self.is_dock_reader else None,
                                       src=self.reader_rank, group=self.replica_group, device=self._wire_device())
        return out

    def _micro_batches(self, micro_batches: Iterable[MicroBatch] | None) -> list[MicroBatch]:
        """The reader's micro-batches (its iterator consumed to the end) on every rank of the replica."""
        mbs = list(micro_batches) if self.is_dock_reader else []
        head = self._bcast_obj([(float(mb.loss_scale), bool(mb.last)) for mb in mbs], self.reader_rank)
        if self.replica_group is None:
            return mbs
        if self.is_dock_reader:
            for mb in mbs:
                self._bcast_rows({k: mb.data[k] for k in mb.data})
            return mbs
        return [MicroBatch(self._bcast_rows(None), scale, last) for scale, last in head]

    # ------------------------------------------------------------------------ forward pieces
    def _rows(self, prompts, responses) -> RightPadded:
        return right_padded(prompts, responses, self.pad_token_id).to(self.device)

    def _token_log_probs(self, logits: torch.Tensor, rows: RightPadded, with_entropy: bool):
        """[B, S, V/tp] logits of the last stage -> [B, R] log-probs (and entropies) of the responses."""
        logits = logits[:rows.rows]   # dummy rows of a pipeline-padded micro-batch take no part
        if self.temperature not in (0.0, 1.0):
            logits = logits.float() / self.temperature
        logp, ent = vocab_parallel_log_probs(logits, rows.targets[:rows.rows], vocab_start=self.tp_rank * logits.shape[-1],
                                             vocab_size=self.dims.vocab_size, group=self.tp_group,
                                             with_entropy=with_entropy)
        logp = logp.gather(1, rows.index)
        return logp, (ent.gather(1, rows.index) if ent is not None else None)

    def _forward_step(self, on_output, data_iterator, model):
        """megatron's forward_step_func: the model's output and the loss function of it."""
        rows, payload = next(data_iterator)
        output = model(input_ids=rows.tokens, position_ids=rows.position_ids, attention_mask=None)
        return output, partial(on_output, rows, payload)

    def _run(self, batches: list, on_output, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        if self.pp > 1:   # one activation shape for the p2p exchanges of the whole schedule
            b = max(r.tokens.shape[0] for r, _ in batches)
            s = max(r.tokens.shape[1] for r, _ in batches)
            batches = [(r.padded_to(b, s, self.pad_token_id), x) for r, x in batches]
        get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, on_output), data_iterator=iter(batches),
            model=[self.model], num_microbatches=len(batches),
            seq_length=max(r.tokens.shape[1] for r, _ in batches),
            micro_batch_size=max(r.tokens.shape[0] for r, _ in batches), forward_only=forward_only)

    # ------------------------------------------------------------------------------ inference
    @torch.no_grad()
    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor] | None:
        """The reader's rows (other ranks of the replica pass None) -> per-token log-probs, returned on
        every rank of the last stage (the writer is its TP rank 0); other stages return None."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be > 0")
        data = self._bcast_rows({"prompts": list(prompts), "responses": list(responses)} if self.is_dock_reader else None)
        prompts, responses = data["prompts"], data["responses"]
        if not prompts:
            return [] if self.last_stage else None
        batches = [(self._rows([prompts[i] for i in g], [responses[i] for i in g]), g)
                   for g in forward_groups(prompts, responses, micro_batch_size, self.max_tokens)]
        lengths = [int(r.numel()) for r in responses]
        flat = torch.zeros(sum(lengths), dtype=torch.float32, device=self.device)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)

        def on_output(rows: RightPadded, group: list[int], output: torch.Tensor):
            logp, _ = self._token_log_probs(output, rows, with_entropy=False)
            for j, i in enumerate(group):
                a, b = starts[i], starts[i + 1]
                flat[a:b] = logp[j, :b - a].float()
            return output.new_zeros((), dtype=torch.float32), {}

        was_training = self.module.training
        self.model.eval()
        try:
            self._run(batches, on_output, forward_only=True)
        finally:
            self.model.train(was_training)
        if not self.last_stage:
            return None
        flat = flat.cpu()
        return [flat[starts[i]:starts[i + 1]].clone() for i in range(len(lengths))]

    # ------------------------------------------------------------------------------ training
    def train_step(self, micro_batches: Iterable[MicroBatch] | None, loss_fn: LossFn) -> dict[str, float]:
        """Only the replica's reader iterates `micro_batches` (others pass None) and broadcasts them;
        every rank passes the same `loss_fn` (the last stage's TP ranks all compute the loss). The
        metrics are the replica's, on every rank. Replicas may hold different micro-batch counts."""
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without OptimConfig)")
        mbs = self._micro_batches(micro_batches)   # megatron's schedule needs the count up front
        if self.max_tokens is not None:
            return self._train_step_split(mbs, loss_fn)
        batches = [(self._rows(mb.data["prompts"], mb.data["responses"]), mb) for mb in mbs]
        n = len(batches)
        sums: dict[str, float] = {}

        def on_output(rows: RightPadded, mb: MicroBatch, output: torch.Tensor):
            logp, ent = self._token_log_probs(output, rows, with_entropy=True)
            loss, m = loss_fn(ModelOutput(response_mask=rows.response_mask, log_probs=logp, entropy=ent), mb)
            merge_metrics(sums, m)  # _max maxed, _min minned, the rest summed
            return loss * (mb.loss_scale * n), {}   # the schedule divides by n

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if n:
            self._run(batches, on_output, forward_only=False)
        metrics = self._metrics_from_last_stage(sums)
        metrics["micro_batches"] = float(n)
        metrics.update(self.optimizer_step())
        return metrics

    def _train_step_split(self, mbs: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """`train_step` with a token budget: each micro-batch's rows in token-budget groups, each group a
        micro-batch of megatron's schedule. The schedule runs a micro-batch's backward right after its
        loss, but the loss must see the whole micro-batch (its aggregation, its metrics). So the groups
        first run forward-only; the last stage joins each micro-batch's log-probs and entropies
        (`join_groups`), computes its loss and the loss's gradient with respect to them; then the
        groups run the training schedule with the loss sum(outputs * that gradient), whose parameter
        gradients are the micro-batch loss's. One forward-only pass more per update; replicas may run
        different group counts (megatron reduces DP gradients once, after the schedule)."""
        flat: list[tuple[int, list[int]]] = []   # (micro-batch, its rows) of each group
        for j, mb in enumerate(mbs):
            p, r = mb.data["prompts"], mb.data["responses"]
            flat += [(j, g) for g in forward_groups(p, r, len(p), self.max_tokens)]
        batches = [(self._rows([mbs[j].data["prompts"][i] for i in g], [mbs[j].data["responses"][i] for i in g]), k)
                   for k, (j, g) in enumerate(flat)]
        outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def record(rows: RightPadded, k: int, output: torch.Tensor):
            outs[k] = self._token_log_probs(output, rows, with_entropy=True)
            return output.new_zeros((), dtype=torch.float32), {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if batches:
            with torch.no_grad():
                self._run(batches, record, forward_only=True)
        sums: dict[str, float] = {}
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.last_stage:
            for j, mb in enumerate(mbs):
                ks = [k for k, (owner, _) in enumerate(flat) if owner == j]
                leaves = [tuple(t.clone().requires_grad_() for t in outs[k]) for k in ks]
                parts = [ModelOutput(response_mask=batches[k][0].response_mask, log_probs=lp, entropy=ent)
                         for k, (lp, ent) in zip(ks, leaves)]
                mask = right_pad(mb.data["responses"], self.pad_token_id)[1].to(self.device)
                loss, m = loss_fn(join_groups([flat[k][1] for k in ks], parts, mask), mb)
                merge_metrics(sums, m)
                wrt = [t for pair in leaves for t in pair]
                got = torch.autograd.grad(loss * mb.loss_scale, wrt, allow_unused=True)
                for i, k in enumerate(ks):
                    grads[k] = tuple(torch.zeros_like(wrt[2 * i + c]) if got[2 * i + c] is None else got[2 * i + c]
                                     for c in (0, 1))
        n = len(batches)

        def surrogate(rows: RightPadded, k: int, output: torch.Tensor):
            logp, ent = self._token_log_probs(output, rows, with_entropy=True)
            g_lp, g_ent = grads[k]
            return ((logp * g_lp).sum() + (ent * g_ent).sum()) * n, {}   # the schedule divides by n

        if batches:
            self._run(batches, surrogate, forward_only=False)
        metrics = self._metrics_from_last_stage(sums)
        metrics["micro_batches"] = float(len(mbs))
        metrics.update(self.optimizer_step())
        return metrics

    def _metrics_from_last_stage(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(self._bcast_obj(sums, self.writer_rank) if self.pp > 1 else sums)

    def optimizer_step(self) -> dict[str, float]:
        """Skip the update on a non-finite gradient norm (counted as a step), else clip and step.

        `prepare_grads` copies the model grads into the optimizer's main grads (idempotent for bf16
        and fp32, the dtypes trained here), so `step()` redoing it is harmless."""
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not torch.isfinite(torch.tensor(norm)):
            self.optimizer.zero_grad()
        else:
            ok, norm_after, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("megatron optimizer.step() reported an unsuccessful update on finite gradients")
            norm = float(norm_after) if norm_after is not None else norm
        self.version += 1
        return {"grad_norm": norm}

    # ------------------------------------------------------------------------------ weights
    def _gather_tp(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None or C.tp_rule(name) == C.REPLICATED:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return C.unshard_tensor(name, parts)

    def _hf_from_stage(self, owner_stage: int, named: dict[str, torch.Tensor] | None,
                       shapes: Mapping[str, tuple]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors computed on PP stage `owner_stage`, broadcast to every stage."""
        for name, shape in shapes.items():
            t = named[name] if self.pp_rank == owner_stage else torch.empty(shape, dtype=self.dtype, device=self.device)
            if self.pp_group is not None:
                dist.broadcast(t, src=dist.get_global_rank(self.pp_group, owner_stage), group=self.pp_group)
            yield name, t

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        own = {k: v.detach() for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")}
        shapes = C.hf_shapes(self.dims)
        d, first, last = self.dims, self.opts["num_layers_in_first_pipeline_stage"], \
            self.opts["num_layers_in_last_pipeline_stage"]
        embed = None
        if self.first_stage:
            embed = self._gather_tp(C.MC_EMBED, own[C.MC_EMBED])[:d.vocab_size]
        yield from self._hf_from_stage(0, {C.HF_EMBED: embed}, {C.HF_EMBED: shapes[C.HF_EMBED]})
        for g in range(d.num_layers):
            stage, local = C.global_to_stage(g, d.num_layers, self.pp, first, last)
            hf_layer = None
            if stage == self.pp_rank:
                pre = f"decoder.layers.{local}."
                whole = {k: self._gather_tp(k, own[pre + k]) for k in C.mcore_layer_keys(self.layer_spec)}
                hf_layer = {f"model.layers.{g}.{k}": t for k, t in C.layer_to_hf(whole, d, self.layer_spec).items()}
            names = {f"model.layers.{g}.{k}": shapes[f"model.layers.{g}.{k}"] for k in C.HF_LAYER_KEYS}
            yield from self._hf_from_stage(stage, hf_layer, names)
        tail = None
        if self.last_stage:
            tail = {C.HF_NORM: own[C.MC_NORM]}
            if not d.tie_word_embeddings:
                tail[C.HF_HEAD] = self._gather_tp(C.MC_HEAD, own[C.MC_HEAD])[:d.vocab_size]
        names = {C.HF_NORM: shapes[C.HF_NORM]}
        if not d.tie_word_embeddings:
            names[C.HF_HEAD] = shapes[C.HF_HEAD]
        yield from self._hf_from_stage(self.pp - 1, tail, names)
        if d.tie_word_embeddings:
            yield from self._hf_from_stage(0, {C.HF_HEAD: embed}, {C.HF_HEAD: shapes[C.HF_HEAD]})

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        return bucketed(self._export(), bucket_bytes)

    @torch.no_grad()
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load HF-named tensors (every rank is given them all and keeps its stage's TP shard). A decoder
        layer is converted once all of its HF tensors have arrived (they may span buckets)."""
        own = dict(self.module.state_dict(keep_vars=True))
        d = self.dims
        known = C.hf_shapes(d)

        def put(name: str, t: torch.Tensor) -> None:
            target = own.get(name)
            if target is None:
                return
            shard = C.shard_tensor(name, t, self.tp, self.tp_rank)
            if tuple(shard.shape) != tuple(target.shape):
                raise ValueError(f"weight sync: {name!r} converts to shape {tuple(shard.shape)} but this rank holds "
                                 f"{tuple(target.shape)}")
            target.data.copy_(shard)

        for name, t in named_tensors:
            if name not in known:
                raise ValueError(f"weight sync: {name!r} is not a weight of the megatron Qwen2 model")
            if tuple(t.shape) != tuple(known[name]):
                raise ValueError(f"weight sync: {name!r} has shape {tuple(t.shape)}, the model's is {known[name]}")
            if name == C.HF_EMBED:
                padded = C._pad_rows(t, self.padded_vocab)
                put(C.MC_EMBED, padded)
                if d.tie_word_embeddings and self.pp > 1 and self.last_stage:
                    put(C.MC_HEAD, padded)
            elif name == C.HF_HEAD:
                if not d.tie_word_embeddings:
                    put(C.MC_HEAD, C._pad_rows(t, self.padded_vocab))
            elif name == C.HF_NORM:
                put(C.MC_NORM, t)
            else:
                g, key = name[len("model.layers."):].split(".", 1)
                g = int(g)
                if g not in self.layers:
                    continue
                pending = self._pending.setdefault(g, {})
                pending[key] = t.to(self.device)
                if len(pending) == len(C.HF_LAYER_KEYS):
                    del self._pending[g]
                    for k, v in C.layer_to_mcore(pending, d, self.layer_spec).items():
                        put(f"decoder.layers.{g - self.layers.start}.{k}", v)
        self.version = int(version)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()   # the main (fp32) copies follow the new weights

    # ------------------------------------------------------------------------------ checkpoints
    # the distributed optimizer's state as one ShardedTensor per buffer: saved and loaded fully in
    # parallel, reshardable over DP (megatron-core 0.16's default, fully_sharded_model_space, is deprecated
    # and its flattened ranges are refused by dist_checkpointing there)
    CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

    def _sharded_state(self, loading: bool) -> dict:
        meta = dict(self.CHECKPOINT_METADATA)
        state: dict[str, Any] = {"model": self.module.sharded_state_dict(metadata=meta)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], is_loading=loading, metadata=meta)
        return state

    def save_checkpoint(self, directory: str) -> list[str]:
        from megatron.core import dist_checkpointing
        where = os.path.join(directory, "megatron")
        os.makedirs(where, exist_ok=True)
        dist.barrier()
        state = self._sharded_state(loading=False)
        state["version"] = self.version
        dist_checkpointing.save(state, where)
        rank = dist.get_rank()
        return sorted(os.path.join(where, f) for f in os.listdir(where)
                      if f.startswith(f"__{rank}_") or (rank == 0 and not f.startswith("__")))

    @torch.no_grad()   # the fp32 distributed optimizer's main params are views of the (grad) model params
    def load_checkpoint(self, directory: str) -> None:
        from megatron.core import dist_checkpointing
        state = self._sharded_state(loading=True)
        state["version"] = 0
        loaded = dist_checkpointing.load(state, os.path.join(directory, "megatron"))
        _load_exact(self.module, loaded["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])
        self.version = int(loaded["version"])

    def close(self) -> None:
        global _PARALLEL_USERS
        self.optimizer = None
        self.model = self.module = None
        _PARALLEL_USERS -= 1
        if _PARALLEL_USERS == 0:
            self.ps.destroy_model_parallel()
            if self.own_group and dist.is_initialized():
                dist.destroy_process_group()


# ------------------------------------------------------------------------------ build helpers
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
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def _load_exact(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load converted weights; every weight of the stage must be given (TE's _extra_state aside)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron backend: converted HF weights do not fit the GPTModel: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
