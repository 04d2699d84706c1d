"""Training with megatron-core: TP/PP GPTModel, megatron's DDP and (distributed) optimizer, its
pipeline schedules, dist_checkpointing (`actor_config.backend: megatron`).

WHAT RUNS WHERE -- read this first. megatron-core's GPTModel, DDP and optimizers need a CUDA device:
its rotary embedding, default causal mask, RNG tracker (`model_parallel_cuda_manual_seed`), grad
buffers, optimizers and grad clipping allocate on or assert `cuda`. On an Ascend NPU it runs only with
MindSpeed's megatron adaptor imported first (it patches those calls onto torch_npu), which `build()`
does. On the CPU `build()` refuses with a clear error. This project's CI has no GPU and no
megatron-core: the CI tests (tests/engines/test_megatron_convert.py) cover the pure-torch pieces
(`tensors.py`: `right_padded`, `vocab_parallel_log_probs`; the conversion in `convert.py`) and check that the
engine refuses the CPU. During development the whole engine was also run, outside CI, against
megatron-core 0.16.1 on CPU gloo ranks with megatron's CUDA-only calls shimmed to the CPU in a
throwaway script (tp x pp x dp = 1x1x1, 2x1x1, 1x2x1, 2x2x1, 1x1x2, 1x2x2; plain and distributed
optimizer; tied and untied): log-probs, the train step's loss metrics and grad norm, the updated
weights, export/update_weights and checkpoint save/load agreed with the torch backend
(docs/engines.md has the numbers). It has not run on a GPU or an NPU. No part of it is a stub: every
call is megatron-core's public API as of 0.16.

Calling contract (the mesh backend's; every rank of the model calls every method, in the same order):

* A replica is the tp*pp ranks of one DP index (megatron's model-parallel group). Its reader
  (`is_dock_reader`) and writer (`is_dock_writer`) are the deployment's (`TrainSpec.role`); `coord` is
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
  layer spec (`layer_spec: local`, plain torch modules) or Transformer Engine's (`layer_spec: te`; the
  default `auto` takes it on CUDA where transformer_engine is installed, else local: `setup.resolve_layer_spec`),
  `pre_process`/`post_process` by PP stage. Weights come from the HF safetensors through
  `convert.hf_to_mcore_rank` (each rank reads only its stage's tensors and keeps its TP shard).
* Batches are right-padded (`right_padded`): prompt and response back to back from column 0, so the
  causal mask alone is right and no attention mask is passed (works with both layer specs); the
  logits that predict response token t of row i sit at column len(prompt_i) + t - 1. With pp > 1 a
  step's micro-batches are padded to one [rows, width] (the p2p exchanges have one shape) and cut
  back before the loss.
* Log-probs on the last PP stage from vocab-sharded logits (`vocab_parallel_log_probs`: max and
  sum-exp all-reduced over the TP group, the target logit taken on the rank that holds it, exact
  gradients). Megatron's padded vocab rows are masked out, so the distribution is HF's. The model
  hands over its 16-bit logits (`Float16Module(fp32_output=False)` where megatron-core takes it), and
  they go to fp32 a chunk of rows at a time (`chunked_vocab_parallel_log_probs`, checkpointed with grad).
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

Options (`TrainSpec.options`, from the config): tp, pp, layer_spec (auto|local|te; auto by default),
make_vocab_size_divisible_by (128), use_distributed_optimizer (True),
num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage (None), npu_adaptor
(the module to import first on NPU; default tries `mindspeed.megatron_adaptor`, then `megatron_adaptor`).

Model features (`TrainSpec` fields): `gradient_checkpointing` is megatron's full recompute of every layer
(`setup.recompute_kwargs`); `max_tokens_per_micro_batch` makes each forward a token-budget group of rows, for
log-probs and for training (`_train_step_split`). Both are written against megatron-core's API and have
not run: only the recompute options' mapping is tested here.

Not built here: value models (a critic needs a 1-wide output head megatron's GPTModel does not have;
use backend torch, fsdp or mesh for the critic), virtual pipeline stages, sequence/context
parallelism, fp16 loss scaling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from ....algorithms.metrics import merge_metrics
from ...base import Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, TrainEngine, TrainSpec, bucketed
from ...batching import forward_groups, join_groups, right_pad
from . import convert as C
from . import setup as S
from .setup import DTYPES
from .tensors import RightPadded, chunked_vocab_parallel_log_probs, right_padded

OPTIONS = {"tp": 1, "pp": 1, "dp": None, "layer_spec": C.AUTO, "make_vocab_size_divisible_by": 128,
           "use_distributed_optimizer": True, "num_layers_in_first_pipeline_stage": None,
           "num_layers_in_last_pipeline_stage": None, "npu_adaptor": None}


@dataclass
class MegatronOptions:
    """The megatron backend's options (actor_config.backend_options); tp and pp come from the placement
    (placement.mfcs.<mfc>.tp/pp in placement.mode: mesh)."""
    layer_spec: str = C.AUTO   # te (transformer-engine) where installed on CUDA, else local; or local / te as asked
    make_vocab_size_divisible_by: int = 128
    use_distributed_optimizer: bool = True
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    npu_adaptor: Optional[str] = None                 # Ascend: the module that adapts megatron to torch_npu

    def check(self) -> None:
        if self.layer_spec not in C.LAYER_SPEC_OPTIONS:
            raise ValueError(f"layer_spec={self.layer_spec!r}: use one of {list(C.LAYER_SPEC_OPTIONS)}")
        if isinstance(self.make_vocab_size_divisible_by, bool) or not isinstance(
                self.make_vocab_size_divisible_by, int) or self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by!r}: an integer >= 1")


_PARALLEL_USERS = 0   # engines in this process sharing megatron's parallel_state


# ----------------------------------------------------------------------------------- the engine
def _takes_fp32_output() -> bool:
    """Does this megatron-core's Float16Module.forward take `fp32_output` (whether to convert its outputs)?"""
    import inspect

    from megatron.core.transformer.module import Float16Module
    return "fp32_output" in inspect.signature(Float16Module.forward).parameters


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
        self._take_role(spec.role)
        self.padded_vocab = C.padded_vocab_size(dims.vocab_size, opts["make_vocab_size_divisible_by"], self.tp)
        self.layers = C.pp_layer_range(dims.num_layers, self.pp, self.pp_rank,
                                       opts["num_layers_in_first_pipeline_stage"],
                                       opts["num_layers_in_last_pipeline_stage"])
        self.own_group = own_group
        # the last stage's logits stay 16-bit (Float16Module converts them to fp32 by default: a full-vocab
        # fp32 tensor per micro-batch); log-probs are taken in fp32 a chunk of rows at a time
        self._output_kwargs = {"fp32_output": False} if self.dtype != torch.float32 and _takes_fp32_output() else {}
        self.version = 0
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        from ..torch_train import check_token_budget
        # at most this many tokens per forward, counted as `batching.padded_tokens` does (an upper bound of
        # the right-padded layout's rows x longest row)
        self.max_tokens = check_token_budget(spec.max_tokens_per_micro_batch)

    def _take_role(self, role) -> None:
        """The dock roles of this rank from its deployment's `RankRole` (engines/deployment.py); an engine built
        outside a worker (`role` None) takes its rank's role from the mesh deployment of its (tp, pp, dp). The
        replica is megatron's model-parallel group (the tp*pp ranks of one DP index), which must hold the
        deployment's replica ranks (megatron's rank order tp-cp-ep-dp-pp is the deployment's (pp, dp, tp))."""
        if role is None:
            from ...deployment import MESH, Deployment
            role = Deployment("megatron", MESH, dp=self.dp, tp=self.tp, pp=self.pp).roles()[dist.get_rank()]
        self.replica_group = self.ps.get_model_parallel_group() if role.split else None
        ranks = tuple(sorted(dist.get_process_group_ranks(self.replica_group))) if role.split else (dist.get_rank(),)
        if ranks != role.replica_ranks:
            raise ValueError(f"megatron backend: the model-parallel group {list(ranks)} is not the deployment's replica "
                             f"{list(role.replica_ranks)}; the deployment and megatron must number the ranks alike")
        self.role = role
        self.reader_rank, self.writer_rank = role.reader, role.writer
        self.is_dock_reader, self.is_dock_writer = role.reads, role.writes
        self.dp_size = role.dp

    # ------------------------------------------------------------------------------ build
    @classmethod
    def build(cls, spec: TrainSpec) -> "MegatronTrainEngine":
        global _PARALLEL_USERS
        opts = S.checked_options(spec, OPTIONS)
        device = S.open_device(spec, opts)
        own_group = S.start_parallel_state(int(opts["tp"]), int(opts["pp"]), spec.seed, device)
        model, runnable, config, dims = S.load_model(spec, opts, device)
        runnable, optimizer = S.wrap_for_training(spec, opts, config, model, runnable)
        _PARALLEL_USERS += 1
        return cls(model=model, runnable=runnable, optimizer=optimizer, config=config, dims=dims, opts=opts, spec=spec,
                   device=device, own_group=own_group)

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
        """[B, S, V/tp] logits of the last stage (16-bit when training in bf16) -> [B, R] log-probs (and
        entropies) of the responses, in fp32 a chunk of rows at a time (at most ACCELERATOR_LOGITS_CHUNK_BYTES
        of fp32 logits)."""
        from ..log_probs import ACCELERATOR_LOGITS_CHUNK_BYTES
        logits = logits[:rows.rows]   # dummy rows of a pipeline-padded micro-batch take no part
        row_bytes = 4 * logits.shape[1] * logits.shape[-1]
        logp, ent = chunked_vocab_parallel_log_probs(
            logits, rows.targets[:rows.rows], chunk_rows=ACCELERATOR_LOGITS_CHUNK_BYTES // row_bytes,
            temperature=self.temperature, vocab_start=self.tp_rank * logits.shape[-1],
            vocab_size=self.dims.vocab_size, group=self.tp_group, with_entropy=with_entropy)
        logp = logp.gather(1, rows.index)
        return logp, (ent.gather(1, rows.index) if ent is not None else None)

    def _forward_step(self, on_output, data_iterator, model):
        """megatron's forward_step_func: the model's output and the loss function of it."""
        rows, payload = next(data_iterator)
        output = model(input_ids=rows.tokens, position_ids=rows.position_ids, attention_mask=None,
                       **self._output_kwargs)
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
        S.load_exact(self.module, loaded["model"])
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
