"""Training on a ("pp", "dp", "tp") device mesh with PyTorch's own parallelism: tensor parallelism
(`torch.distributed.tensor.parallel`), pipeline parallelism (`torch.distributed.pipelining`) and
FSDP2 (`fully_shard`) over the data-parallel replicas.

`actor_config.backend: mesh` (the lead wires it; see docs/engines.md). `TrainSpec.options`:

    tp, pp, dp          the mesh (dp * tp * pp must be the size of the default process group)
    pp_microbatches     the worker's micro-batches run through the pipeline per schedule step
                        (a "round"; default: pp)
    pp_schedule         "1f1b" (default; GPipe for a round of fewer micro-batches than stages) or "gpipe"
    dp_shard            with dp > 1, shard each replica's weights over dp with FSDP2 (default true);
                        false keeps a full copy per replica, so replicas run independently (the mesh
                        rollout backend, whose replicas generate different numbers of tokens)

Layout: the mesh is ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``,
so mesh rank ``pp_idx * dp * tp + dp_idx * tp + tp_idx`` is exactly `parallel.topology`'s sub-rank
(PP outermost, TP innermost), and the topology's reader (tp 0 of stage 0) and writer (tp 0 of the
last stage) of each replica are the ranks named below.

What runs where:

* Every rank loads the full HF model, keeps the decoder layers of its pipeline stage (contiguous,
  earlier stages take one more when they do not divide) and drops the rest. A stage module keeps
  the HF parameter names with *global* layer indexes (``model.layers.3.mlp.up_proj.weight`` on
  stage 1 of a 4-layer model with pp=2), so exports and checkpoints need no renaming. Stage 0 holds
  the embedding, the last stage the final norm and the head (``lm_head``, or a critic's ``score``).
* TP: `parallelize_module` on each decoder layer with the Megatron plan: ColwiseParallel on
  q/k/v/gate/up, RowwiseParallel on o/down (outputs are plain local tensors; HF's attention views
  its projections as ``(..., -1, head_dim)``, so it runs on the local heads unchanged).
  Needs num_attention_heads, num_key_value_heads and intermediate_size divisible by tp (Megatron's
  rule; the built-in 2-layer tiny model has 2 heads and 2 KV heads: tp up to 2). The
  embedding, norms and head stay replicated (plain tensors on every TP rank): their gradients are
  complete on every rank because the TP layers' input hooks all-reduce the gradients of their
  (replicated) inputs.
* PP: a `PipelineStage` and a `Schedule1F1B`/`ScheduleGPipe` per round of micro-batches (shapes
  may change between rounds; the stage is given its input/output shapes, so no shape inference
  runs). The micro-batches of a round are padded to one [rows, width] (extra left padding of the
  prompts, right padding of the responses, repeated rows) and cut back before the loss, so the
  worker's `loss_fn` sees exactly each micro-batch's own [B, R] tensors. The schedule's loss (on the
  last stage) is the worker's loss times `loss_scale`; `scale_grads=False`. Inference (`log_probs`,
  `values`) runs the same stages with the schedule's forward-only `eval`.
  Tied embeddings (Qwen2's lm_head = embed_tokens) with pp > 1: stage 0 holds the embedding, the
  last stage the head, the same values; their gradients are summed over the two (an all-reduce in
  a group of the first and last stage, Megatron's "embedding group"; torch has no API for it) so
  both copies take identical optimizer steps; the grad norm counts the weight once.
* DP: with dp > 1, FSDP2 `fully_shard` of each decoder layer and of the stage root over the "dp"
  sub-mesh (torchtitan's 2-D/3-D recipe): gradients averaged over the replicas, as DDP would.
* Mixed precision: `dtype` is the compute dtype. A trained engine loads fp32 master weights (fp32
  AdamW state) and runs its stages under `torch.autocast(dtype)` (activations between stages stay
  fp32: the residual stream adds fp32 to the autocast outputs); an inference-only engine holds
  `dtype`. Exports are cast to `dtype`.
* The last stage of a causal LM returns [rows, R, 2] log-probs and entropies, not logits: the head
  runs on the real response tokens only, in chunks (`torch_train.head_log_probs`), so no
  [rows, R, vocab] fp32 tensor crosses the schedule or stays for the backward.
* The optimizer is AdamW over this rank's parameters (DTensor shards and plain tensors); the grad
  norm is the global one: `get_total_norm` per kind of tensor (a DTensor's `full_tensor()`), the
  squares summed over the pipeline stages; clipping with `clip_grads_with_norm_`.

Calling contract (every rank of the mesh calls every method, in the same order):

* `train_step(micro_batches, loss_fn)`: only the replica's reader (mesh coordinate pp=0, tp=0 of
  each dp index: `topology.dock_reader_ranks`) iterates `micro_batches`; it broadcasts each
  micro-batch (columns, `loss_scale`, `last`) to the other ranks of its replica with
  `parallel.broadcast_micro_batch`. Other ranks pass anything (None); they must pass the same
  `loss_fn` (the last stage's TP ranks all compute the loss). The returned metrics are the replica's
  (the last stage's loss metrics, broadcast to the whole replica). With dp > 1 every replica must be
  given the same number of micro-batches (FSDP gathers at every forward).
* `log_probs(prompts, responses, micro_batch_size)` / `values(...)`: the reader's rows are used
  (broadcast); other ranks pass None. The result (a list of 1-D tensors) is returned on every rank
  of the last stage (the writer is its TP rank 0); other stages return None. Replicas may have
  different row counts (the short ones run dummy forwards).
* `export_weights(bucket_bytes)`: every rank iterates to the end; every rank yields every HF name
  once, full tensors (TP shards gathered with `full_tensor()`, each stage's parameters broadcast
  over its PP group from the owning stage), `lm_head.weight` included for tied embeddings.
* `update_weights(named, version)`: local; every rank is given the full tensors and keeps its
  stage's slice (a name of another stage is checked and skipped).
* `save_checkpoint` / `load_checkpoint`: `torch.distributed.checkpoint` of the stage module and the
  optimizer (flattened optimizer state: keys by parameter name, unique across stages), every rank.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ...algorithms.metrics import merge_metrics
from ..base import Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, TrainEngine, TrainSpec, bucketed
from ..batching import SequenceBatch, collate, forward_groups, join_groups, positions, right_pad, unpad_rows

OPTIONS = {"tp", "pp", "dp", "pp_microbatches", "pp_schedule", "dp_shard"}
SCHEDULES = ("1f1b", "gpipe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def qwen2_tp_plan() -> dict:
    """Megatron's TP plan of a Qwen2/Llama decoder layer (module path inside the layer -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def split_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the pp stages; the first `n_layers % pp` stages take one more."""
    if n_layers < pp:
        raise ValueError(f"pp={pp} stages but the model has {n_layers} decoder layers; use pp <= {n_layers}")
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


class StageModule(nn.Module):
    """One pipeline stage of a HF decoder-only model (Qwen2, Llama layout), with the HF parameter
    names: ``model.embed_tokens`` (first stage), ``model.layers.<global index>``, ``model.norm``
    and ``lm_head`` / ``score`` (last stage).

    forward(x, attention_mask, position_ids, labels=None): x is input ids on the first stage, hidden
    states after it; the last stage returns the head's output at the response positions
    `response_slice` = (prompt_width P, response width R): positions P-1 .. P+R-2, as
    `torch_train.response_logits` reads them. A causal LM given `labels` (the [rows, R] responses)
    returns [rows, R, 2] log-probs and entropies instead of logits (`log_probs`); without them,
    fp32 logits (the mesh rollout backend samples from them)."""

    def __init__(self, hf: nn.Module, layers: range, first: bool, last: bool, kind: str):
        super().__init__()
        base = getattr(hf, hf.base_model_prefix)
        self.config = hf.config
        self.first, self.last, self.kind = first, last, kind
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.model.rotary_emb = base.rotary_emb
        if last:
            self.model.norm = base.norm
            if kind == "value":
                self.score = hf.score
            else:
                self.lm_head = hf.lm_head
        self.response_slice: tuple[int, int] | None = None
        self.temperature = 1.0
        self.with_entropy = True   # log-probs mode: compute entropies too (training)
        self.checkpoint_layers = False   # activation checkpointing of each decoder layer (training forwards)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.model.embed_tokens(x) if self.first else x
        cfg = self.config
        kw = dict(config=cfg, inputs_embeds=h, attention_mask=attention_mask, past_key_values=None,
                  position_ids=position_ids)
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pe = self.model.rotary_emb(h, position_ids)
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled()
        for i, layer in self.model.layers.items():
            kw = dict(attention_mask=masks[layer_types[int(i)]], position_embeddings=pe, position_ids=position_ids)
            if recompute:   # keep the layer's input only; the backward runs it again (TP and FSDP hooks too)
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, **kw)
            else:
                h = layer(h, **kw)
        if not self.last:
            return h
        p, r = self.response_slice
        h = self.model.norm(h[:, p - 1:p + r - 1])
        if self.kind == "value":  # a copy, not a view: FSDP2 warns on a root module returning a view
            return self.score(h)[..., 0].float().clone()
        if labels is not None:
            return self.log_probs(h, labels, attention_mask[:, p:p + r])
        logits = self.lm_head(h).float()
        return logits / self.temperature if self.temperature not in (0, 1.0) else logits

    def log_probs(self, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows, R, 2]: log-prob of each label and entropy (0 unless `with_entropy`), fp32, 0 at
        padding; the head runs on the real response tokens only, a chunk at a time
        (`torch_train.head_log_probs`): no [rows, R, vocab] fp32 tensor leaves or stays in the stage."""
        from .torch_train import head_log_probs

        logp, ent = head_log_probs(h, self.lm_head.weight, self.lm_head.bias, labels, self.temperature,
                                   self.with_entropy, mask=mask)
        return torch.stack([logp, ent if ent is not None else torch.zeros_like(logp)], dim=-1)


class MeshTrainEngine(TrainEngine):
    collective_forward = True   # sharded weights: every forward gathers them across the DP ranks
    def __init__(self, model: nn.Module, spec: TrainSpec):
        opts = dict(spec.options)
        unknown = set(opts) - OPTIONS
        if unknown:
            raise ValueError(f"mesh backend options {sorted(unknown)} unknown; known: {sorted(OPTIONS)}")
        self.tp, self.pp, self.dp = (int(opts.get(k, 1)) for k in ("tp", "pp", "dp"))
        for k, v in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)):
            if v < 1:
                raise ValueError(f"mesh backend: {k}={v} must be >= 1")
        self.pp_microbatches = int(opts.get("pp_microbatches", self.pp))
        if self.pp_microbatches < 1:
            raise ValueError(f"pp_microbatches={self.pp_microbatches} must be >= 1")
        self.schedule = str(opts.get("pp_schedule", "1f1b")).lower()
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.schedule!r}; use one of {SCHEDULES}")
        if spec.model_kind not in ("causal_lm", "value"):
            raise ValueError(f"model_kind={spec.model_kind!r}: expected causal_lm or value")
        self.spec = spec
        self.model_kind = spec.model_kind
        self.device = torch.device(spec.device)
        self.pad_token_id = int(spec.pad_token_id)
        self.export_dtype = DTYPES[spec.dtype]
        self.compute_dtype = DTYPES[spec.dtype]
        self.optim_config = spec.optim
        self.version = 0
        self._groups: list = []
        self._build_mesh(spec.process_group)

        cfg = model.config
        # the full model's weights in HF order, and the stage that owns each (export / update)
        ranges = split_layers(cfg.num_hidden_layers, self.pp)
        self.stage_layers = ranges
        self.manifest: list[tuple[str, tuple, int]] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            self.manifest.append((name, tuple(p.shape), self._owner(name, ranges)))
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False)) and self.model_kind == "causal_lm"

        stage = StageModule(model, ranges[self.pp_rank], self.pp_rank == 0, self.pp_rank == self.pp - 1,
                            self.model_kind)
        stage.temperature = float(spec.temperature)
        stage.checkpoint_layers = bool(spec.gradient_checkpointing) and spec.optim is not None
        from .torch_train import check_token_budget
        self.max_tokens = check_token_budget(spec.max_tokens_per_micro_batch)
        del model
        stage.to(self.device)
        if self.tp > 1:
            self._check_tp(cfg)
            from torch.distributed.tensor.parallel import parallelize_module
            for layer in stage.model.layers.values():
                parallelize_module(layer, self.mesh["tp"], qwen2_tp_plan())
        self.fsdp = self.dp > 1 and bool(opts.get("dp_shard", True))
        if self.dp > 1 and not self.fsdp and spec.optim is not None:
            raise ValueError("mesh backend: dp_shard=false with an optimizer would leave the replicas' gradients "
                             "unaveraged; it is for inference-only engines (the mesh rollout backend)")
        if spec.optim is None:
            stage.eval()
            for p in stage.parameters():
                p.requires_grad_(False)
        else:
            stage.train()
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard
            for layer in stage.model.layers.values():
                fully_shard(layer, mesh=self.mesh["dp"])
            fully_shard(stage, mesh=self.mesh["dp"])
        self.stage = stage
        self.optimizer = None
        if spec.optim is not None:
            o = spec.optim
            params = list(stage.parameters())
            mixed = len({_is_dtensor(p) for p in params}) > 1
            # foreach kernels take one tensor type per call: a mix of DTensor shards and plain
            # replicated tensors (TP without FSDP) steps parameter by parameter
            self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                               weight_decay=o.weight_decay, foreach=False if mixed else None)
            self._ensure_embed_group()

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, spec: TrainSpec) -> "MeshTrainEngine":
        from ...models import load_causal_lm, load_value_model

        device = torch.device(spec.device)
        if device.type != "cpu" and device.index is not None:
            getattr(torch, device.type).set_device(device)
        # a trained model keeps fp32 master weights and computes under autocast; inference holds `dtype`
        stored = "float32" if spec.optim is not None else spec.dtype
        torch.manual_seed(spec.seed)  # a value model's fresh head: the same on every rank
        loader = load_value_model if spec.model_kind == "value" else load_causal_lm
        return cls(loader(spec.model_path, stored), spec)

    def _build_mesh(self, group) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("mesh backend: torch.distributed is not initialized; the caller initializes the "
                               "default process group over the dp*tp*pp ranks")
        world = dist.get_world_size()
        size = self.dp * self.tp * self.pp
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != world:
            raise ValueError("mesh backend: process_group must be the default group (or None); the mesh spans "
                             "the default group's ranks")
        if world != size:
            raise ValueError(f"mesh backend: dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {size} but the default "
                             f"process group has {world} ranks")
        self.mesh = init_device_mesh(self.device.type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.rank = dist.get_rank()
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        grid = self.mesh.mesh  # [pp, dp, tp] tensor of global ranks
        self._grid = grid
        # a replica: every stage and TP rank of one dp index (where the reader broadcasts)
        replicas = [sorted(int(r) for r in grid[:, d, :].reshape(-1)) for d in range(self.dp)]
        self.replica_group = self._subgroup(replicas, replicas[self.dp_rank])
        self.replica_size = len(replicas[self.dp_rank])
        self.reader_rank = int(grid[0, self.dp_rank, 0])
        self.writer_rank = int(grid[self.pp - 1, self.dp_rank, 0])
        self.is_dock_reader = self.rank == self.reader_rank
        self.dp_size = self.dp
        self.embed_group = None

    def _subgroup(self, groups: list[list[int]], mine: list[int]):
        """This rank's group of `groups` (every rank creates all of them, in the same order)."""
        if len(mine) == 1:
            return None
        found = None
        for g in groups:
            pg = dist.new_group(g)
            self._groups.append(pg)
            if g == mine:
                found = pg
        return found

    def _owner(self, name: str, ranges: list[range]) -> int:
        parts = name.split(".")
        if name.startswith("model.layers."):
            i = int(parts[2])
            return next(s for s, r in enumerate(ranges) if i in r)
        if name.startswith("model.embed_tokens."):
            return 0
        return self.pp - 1   # model.norm, lm_head, score

    def _check_tp(self, cfg) -> None:
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            v = getattr(cfg, key)
            if v % self.tp:
                raise ValueError(f"tp={self.tp} must divide the model's {key}={v} (Megatron's rule: each TP rank "
                                 f"takes whole heads); use a tp that divides it")

    def _ensure_embed_group(self) -> None:
        """The group of stage 0 and the last stage of each (dp, tp) column, for tied embeddings."""
        if self.embed_group is not None or not (self.tied and self.pp > 1):
            return
        g = self._grid
        groups = [[int(g[0, d, t]), int(g[self.pp - 1, d, t])] for d in range(self.dp) for t in range(self.tp)]
        mine = [int(g[0, self.dp_rank, self.tp_rank]), int(g[self.pp - 1, self.dp_rank, self.tp_rank])]
        self.embed_group = self._subgroup(groups, mine)

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_dock_writer(self) -> bool:
        """TP rank 0 of the last stage: the rank of its replica that pushes outputs to the dock."""
        return self.rank == self.writer_rank

    @property
    def coord(self) -> tuple[int, int, int]:
        """(pp, dp, tp) of this rank, as `parallel.topology.ProcessTopology.coord` has it."""
        return self.pp_rank, self.dp_rank, self.tp_rank

    # ------------------------------------------------------------------ data from the reader
    def _bcast_obj(self, obj, src: int, group):
        if group is None:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=group,
                                   device=self.device if self.device.type != "cpu" else None)
        return box[0]

    def _bcast_batch(self, data: dict | None) -> dict:
        from ...parallel.broadcast import broadcast_micro_batch

        if self.replica_group is None:
            return data
        n = len(next(iter(data.values()))) if self.is_dock_reader and data else 0
        out, _ = broadcast_micro_batch(data if self.is_dock_reader else None, list(range(n)) if self.is_dock_reader else None,
                                       src=self.reader_rank, group=self.replica_group,
                                       device=self.device if self.device.type != "cpu" else None)
        return out

    def _next_round(self, it, size: int) -> list[MicroBatch]:
        """Up to `size` micro-batches from the reader's iterator, on every rank of the replica."""
        mbs: list[MicroBatch] = []
        if self.is_dock_reader:
            for mb in it:
                mbs.append(mb)
                if len(mbs) == size:
                    break
        head = self._bcast_obj([(float(mb.loss_scale), bool(mb.last)) for mb in mbs], self.reader_rank, self.replica_group)
        if self.is_dock_reader:
            for mb in mbs:
                self._bcast_batch(mb.data)
            return mbs
        return [MicroBatch(self._bcast_batch(None), scale, last) for scale, last in head]

    # ------------------------------------------------------------------ batches
    def _to_device(self, b: SequenceBatch) -> SequenceBatch:
        if self.device.type == "cpu":
            return b
        return SequenceBatch(*(x.to(self.device) for x in (b.input_ids, b.attention_mask, b.position_ids,
                                                           b.responses, b.response_mask)),
                             prompt_width=b.prompt_width)

    def _output(self, head_out: torch.Tensor, b: SequenceBatch, with_entropy: bool = True) -> ModelOutput:
        if self.model_kind == "value":
            return ModelOutput(response_mask=b.response_mask, values=head_out)
        return ModelOutput(response_mask=b.response_mask, log_probs=head_out[..., 0],
                           entropy=head_out[..., 1] if with_entropy else None)

    def autocast(self):
        """Forward (and so backward) in the compute dtype when the parameters are held in another
        (fp32 masters of a trained model)."""
        held = next((p.dtype for p in self.stage.parameters()), self.compute_dtype)
        if held == self.compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _labels(self, b: SequenceBatch):
        return None if self.model_kind == "value" else b.responses

    def _run_local(self, b: SequenceBatch) -> torch.Tensor:
        """pp=1: the whole model on this rank (TP collectives inside)."""
        self.stage.response_slice = (b.prompt_width, b.responses.shape[1])
        with self.autocast():
            return self.stage(b.input_ids, b.attention_mask, b.position_ids, labels=self._labels(b))

    def _padded_round(self, batches: list[SequenceBatch]):
        """The round's batches padded to one [rows, P + R] and concatenated (the pipeline chunks
        them back into equal micro-batches): prompts left-padded to the widest P, responses
        right-padded to the widest R, missing rows copies of row 0."""
        P = max(b.prompt_width for b in batches)
        R = max(b.responses.shape[1] for b in batches)
        rows = max(b.input_ids.shape[0] for b in batches)
        ids, masks = [], []
        for b in batches:
            n, p, r = b.input_ids.shape[0], b.prompt_width, b.responses.shape[1]
            i = torch.nn.functional.pad(b.input_ids, (P - p, R - r), value=self.pad_token_id)
            m = torch.nn.functional.pad(b.attention_mask, (P - p, R - r), value=0)
            if rows > n:
                i = torch.cat([i, i[:1].expand(rows - n, -1)])
                m = torch.cat([m, m[:1].expand(rows - n, -1)])
            ids.append(i)
            masks.append(m)
        ids, masks = torch.cat(ids), torch.cat(masks)
        return ids, masks, positions(masks), P, R, rows

    def _round_labels(self, ids: torch.Tensor, P: int) -> dict:
        """The `labels` kwarg of a padded round (its response columns), for a causal LM's last stage."""
        return {} if self.model_kind == "value" else {"labels": ids[:, P:]}

    def _pipeline(self, n_mb: int, rows: int, width: int, R: int, has_backward: bool, loss_fn=None,
                  head: str = "logits"):
        """A schedule of `n_mb` micro-batches of [rows, width]; the last stage puts out logits
        [rows, R, V] (`head="logits"`: the mesh rollout backend) or [rows, R, 2] log-probs and
        entropies (`head="log_probs"`, given `labels`)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        hidden = self.stage.config.hidden_size
        # activations between stages: the parameters' dtype (fp32 masters under autocast keep an
        # fp32 residual stream; an inference copy in bf16 passes bf16)
        dt = next((p.dtype for p in self.stage.parameters()), torch.float32)
        meta = "meta"
        # the activations' metadata (no shape inference at run time); requires_grad marks the
        # tensors whose gradients travel back between stages when training
        if self.is_first:
            inp = torch.empty(rows, width, dtype=torch.long, device=meta)
        else:
            inp = torch.empty(rows, width, hidden, dtype=dt, device=meta, requires_grad=has_backward)
        if self.is_last:
            out_shape = ((rows, R) if self.model_kind == "value" else (rows, R, 2) if head == "log_probs"
                         else (rows, R, self.stage.config.vocab_size))
            out = torch.empty(*out_shape, dtype=torch.float32, device=meta, requires_grad=has_backward)
        else:
            out = torch.empty(rows, width, hidden, dtype=dt, device=meta, requires_grad=has_backward)
        stage = PipelineStage(self.stage, self.pp_rank, self.pp, self.device, input_args=(inp,), output_args=(out,),
                              group=self.pp_group)
        cls = Schedule1F1B if (has_backward and self.schedule == "1f1b" and n_mb >= self.pp) else ScheduleGPipe
        return cls(stage, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=False)

    def _dev(self, *ts):
        return tuple(t.to(self.device) for t in ts) if self.device.type != "cpu" else ts

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def _infer(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor] | None:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be > 0")
        data = self._bcast_batch({"prompts": list(prompts), "responses": list(responses)} if self.is_dock_reader else None)
        prompts, responses = data["prompts"], data["responses"]
        # the replica's ranks share the reader's rows, so they make the same groups
        groups = forward_groups(prompts, responses, micro_batch_size, self.max_tokens)
        chunks = [collate([prompts[i] for i in g], [responses[i] for i in g], self.pad_token_id) for g in groups]
        real = len(chunks)
        chunks += [self._dummy_batch() for _ in range(self._max_over_replicas(real) - real)]
        self.stage.with_entropy = False
        outs = self._forward_chunks(chunks)
        self._reshard()
        if not self.is_last:
            return None
        result: list[torch.Tensor | None] = [None] * len(prompts)
        for g, b, o in zip(groups, chunks[:real], outs[:real]):
            b = self._to_device(b)
            vals = o if self.model_kind == "value" else o[..., 0]
            for i, r in zip(g, unpad_rows(vals, b.response_mask)):
                result[i] = r.float().cpu()
        return result

    @torch.no_grad()
    def _forward_chunks(self, chunks: list[SequenceBatch]) -> list[torch.Tensor]:
        """Forward-only over `chunks` (pp > 1: through the pipeline in rounds of `pp_microbatches`): the last
        stage's output of each, cut to its rows and response width (nothing on the other stages)."""
        outs: list[torch.Tensor] = []
        if self.pp == 1:
            for b in chunks:
                outs.append(self._run_local(self._to_device(b)))
            return outs
        step = self.pp_microbatches
        for k in range(0, len(chunks), step):
            rnd = chunks[k:k + step]
            ids, masks, pos, P, R, rows = self._padded_round(rnd)
            self.stage.response_slice = (P, R)
            sched = self._pipeline(len(rnd), rows, ids.shape[1], R, has_backward=False, head="log_probs")
            ids, masks, pos = self._dev(ids, masks, pos)
            args = (ids,) if self.is_first else ()
            with self.autocast():
                merged = sched.eval(*args, attention_mask=masks, position_ids=pos, **self._round_labels(ids, P))
            if self.is_last:
                for j, b in enumerate(rnd):
                    outs.append(merged[j * rows:j * rows + b.input_ids.shape[0], :b.responses.shape[1]])
        return outs

    def _dummy_batch(self) -> SequenceBatch:
        """One pad token of prompt and of response: the forward a replica with fewer forwards makes so that
        its FSDP gathers pair up with the other replicas'."""
        pad = torch.tensor([self.pad_token_id])
        return collate([pad], [pad], self.pad_token_id)

    def _max_over_replicas(self, n: int) -> int:
        """The most forwards any replica makes (FSDP over dp gathers at every forward: all make as many)."""
        if not self.fsdp:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(t.item())

    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor] | None:
        if self.model_kind == "value":
            raise NotImplementedError("log_probs of a value model")
        return self._infer(prompts, responses, micro_batch_size)

    def values(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor] | None:
        if self.model_kind != "value":
            raise NotImplementedError(f"{type(self).__name__} holds no value model (model_kind={self.model_kind})")
        return self._infer(prompts, responses, micro_batch_size)

    def _reshard(self) -> None:
        if self.fsdp:
            self.stage.reshard()

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batches: Iterable[MicroBatch] | None, loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without optim)")
        it = iter(micro_batches) if self.is_dock_reader else None
        sums: dict[str, float] = {}
        n = 0
        round_size = 1 if self.pp == 1 else self.pp_microbatches
        last_seen = False
        while True:
            rnd = self._next_round(it, round_size)
            if not rnd:
                break
            metrics = self._train_round(rnd, loss_fn)
            for m in metrics:
                merge_metrics(sums, m)  # _max maxed, _min minned, the rest summed
            n += len(rnd)
            last_seen = rnd[-1].last
        if n == 0:
            raise ValueError("train_step got no micro-batches")
        if self.fsdp and self.pp == 1 and not last_seen:
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError("the last micro-batch of train_step had last=False: FSDP reduces gradients only on "
                               "a micro-batch marked last")
        grad_norm = self._clip()
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.pp > 1:  # the loss metrics live on the last stage: the replica reports them
            sums = self._bcast_obj(sums, self.writer_rank, self.replica_group)
        return {**sums, "micro_batches": n, "grad_norm": grad_norm}

    def _train_round(self, rnd: list[MicroBatch], loss_fn: LossFn, split: bool = True) -> list[dict]:
        if split and self.pp > 1 and self.max_tokens is not None:
            return self._train_round_split(rnd, loss_fn)
        cpu = [collate(mb.data["prompts"], mb.data["responses"], self.pad_token_id) for mb in rnd]
        batches = [self._to_device(b) for b in cpu]
        self.stage.with_entropy = True
        if self.pp == 1:
            out = []
            for mb, b in zip(rnd, batches):
                if self.fsdp:
                    self.stage.set_requires_gradient_sync(bool(mb.last))
                o, zero = self._local_output(mb, b)
                loss, m = loss_fn(o, mb)
                loss = loss * mb.loss_scale
                (loss if zero is None else loss + zero).backward()
                out.append(m)
            return out
        ids, masks, pos, P, R, rows = self._padded_round(cpu)
        metrics: list[dict] = [{} for _ in rnd]

        def pp_loss(head_out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            j = int(target[0])
            b = batches[j]
            o = self._output(head_out[:b.input_ids.shape[0], :b.responses.shape[1]], b)
            loss, m = loss_fn(o, rnd[j])
            metrics[j] = m
            return loss * rnd[j].loss_scale

        self.stage.response_slice = (P, R)
        sched = self._pipeline(len(rnd), rows, ids.shape[1], R, has_backward=True, loss_fn=pp_loss, head="log_probs")
        target = torch.arange(len(rnd)).repeat_interleave(rows)
        ids, masks, pos, target = self._dev(ids, masks, pos, target)
        kwargs = {"attention_mask": masks, "position_ids": pos}
        args = (ids,) if self.is_first else ()
        # a new PipelineStage clears the gradients of FSDP modules when the schedule initializes it
        # (`_post_metadata_inference_cleanup`): earlier rounds' reduced gradients are set aside
        # around the step and added back
        saved = []
        if self.fsdp:
            saved = [(p, p.grad) for p in self.stage.parameters() if p.grad is not None]
            for p, _ in saved:
                p.grad = None
        with self.autocast():
            sched.step(*args, target=target if self.is_last else None, return_outputs=False, **kwargs,
                       **self._round_labels(ids, P))
        with torch.no_grad():
            for p, g in saved:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return metrics

    def _train_round_split(self, rnd: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """pp > 1 with a token budget. A pipeline schedule runs each pipeline micro-batch's backward right
        after its loss, but the loss must see the whole micro-batch, whose token-budget groups are separate
        pipeline micro-batches. So the groups first run forward-only; the last stage computes each
        micro-batch's loss on its joined outputs (`join_groups`) and the loss's gradient with respect to
        them; then the groups run the training schedule with the loss sum(output * that gradient), whose
        parameter gradients are the micro-batch loss's (the chain rule through the same forwards, same
        shapes, same values). The price of exact losses is one forward-only pass more per update. Dummy
        groups (zero gradient) give every FSDP replica as many pipeline micro-batches."""
        pad = self.pad_token_id
        flat: list[tuple[int, list[int]]] = []   # (micro-batch, its rows) of each group
        for j, mb in enumerate(rnd):
            p, r = mb.data["prompts"], mb.data["responses"]
            flat += [(j, g) for g in forward_groups(p, r, len(p), self.max_tokens)]
        rows = [([rnd[j].data["prompts"][i] for i in g], [rnd[j].data["responses"][i] for i in g]) for j, g in flat]
        dummy = [torch.tensor([pad])]
        rows += [(dummy, dummy)] * (self._max_over_replicas(len(rows)) - len(rows))
        self.stage.with_entropy = True
        outs = self._forward_chunks([collate(p, r, pad) for p, r in rows])
        self._reshard()
        grads: list[torch.Tensor | None] = [None] * len(rows)
        metrics: list[dict] = [{} for _ in rnd]
        if self.is_last:
            for j, mb in enumerate(rnd):
                ks = [k for k, (owner, _) in enumerate(flat) if owner == j]
                leaves = [outs[k].detach().requires_grad_() for k in ks]
                parts = [self._output(leaf, self._to_device(collate(*rows[k], pad))) for leaf, k in zip(leaves, ks)]
                mask = right_pad(mb.data["responses"], pad)[1].to(self.device)
                loss, metrics[j] = loss_fn(join_groups([flat[k][1] for k in ks], parts, mask), mb)
                for k, g in zip(ks, torch.autograd.grad(loss * mb.loss_scale, leaves, allow_unused=True)):
                    grads[k] = torch.zeros_like(outs[k]) if g is None else g
            for k in range(len(flat), len(rows)):
                grads[k] = torch.zeros_like(outs[k])

        def surrogate(o: ModelOutput, group: MicroBatch) -> tuple[torch.Tensor, dict]:
            head = o.values if o.values is not None else torch.stack([o.log_probs, o.entropy], dim=-1)
            return (head * grads[group.data["index"]]).sum(), {}

        groups = [MicroBatch({"prompts": p, "responses": r, "index": k}, 1.0) for k, (p, r) in enumerate(rows)]
        for k in range(0, len(groups), self.pp_microbatches):
            self._train_round(groups[k:k + self.pp_microbatches], surrogate, split=False)
        return metrics

    def _local_output(self, mb: MicroBatch, b: SequenceBatch) -> tuple[ModelOutput, torch.Tensor | None]:
        """pp=1: a training micro-batch's output, in token-budget forwards joined before the loss when a
        budget is set (`join_groups`: the loss sees what one padded forward gives it); with FSDP over dp, a
        zero that depends on this replica's dummy forwards, so its backward gathers and reduces as often
        as the replica with the most forwards (None when it ran none)."""
        if self.max_tokens is None:
            return self._output(self._run_local(b), b), None
        prompts, responses = mb.data["prompts"], mb.data["responses"]
        groups = forward_groups(prompts, responses, len(prompts), self.max_tokens)
        total = self._max_over_replicas(len(groups))
        outs = []
        for g in groups:
            gb = self._to_device(collate([prompts[i] for i in g], [responses[i] for i in g], self.pad_token_id))
            outs.append(self._output(self._run_local(gb), gb))
        out = outs[0] if len(groups) == 1 else join_groups(groups, outs, b.response_mask)
        zero = None
        for _ in range(total - len(groups)):
            t = self._run_local(self._to_device(self._dummy_batch())).sum() * 0.0
            zero = t if zero is None else zero + t
        return out, zero

    def _clip(self) -> float:
        """Global grad norm over TP shards, FSDP shards and pipeline stages; clip all by it."""
        params = [p for p in self.stage.parameters() if p.grad is not None]
        counted = params
        if self.tied and self.pp > 1:
            tied = self._tied_param()
            if tied is not None and tied.grad is not None and self.embed_group is not None:
                g = tied.grad.to_local() if _is_dtensor(tied.grad) else tied.grad
                dist.all_reduce(g, group=self.embed_group)
            if self.is_last and not self.is_first:
                counted = [p for p in params if p is not tied]   # the same weight as stage 0's embedding
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for grads in self._by_kind([p.grad for p in counted]):
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if _is_dtensor(norm):
                norm = norm.full_tensor()
            sq = sq + norm.float() ** 2
        if self.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        total = sq.sqrt()
        for group in self._by_kind(params):
            torch.nn.utils.clip_grads_with_norm_(group, self.optim_config.grad_clip, total)
        return float(total)

    @staticmethod
    def _by_kind(tensors: list) -> list[list]:
        """Group tensors by kind: plain tensors, and DTensors per (mesh, placements); a parameter is
        grouped by its gradient. torch's foreach norm/scale kernels take one kind per call."""
        groups: dict[Any, list] = {}
        for t in tensors:
            g = t.grad if isinstance(t, nn.Parameter) else t
            key = (id(g.device_mesh), tuple(g.placements)) if _is_dtensor(g) else None
            groups.setdefault(key, []).append(t)
        return list(groups.values())

    def _tied_param(self):
        if self.is_first:
            return self.stage.model.embed_tokens.weight
        if self.is_last:
            return self.stage.lm_head.weight
        return None

    # ------------------------------------------------------------------ weights
    def _stage_params(self) -> dict[str, torch.Tensor]:
        return dict(self.stage.named_parameters(remove_duplicate=False))

    def _full(self) -> Iterator[tuple[str, torch.Tensor]]:
        own = self._stage_params()
        for name, shape, owner in self.manifest:
            t = None
            if owner == self.pp_rank:
                p = own[name]
                with torch.no_grad():
                    t = p.full_tensor() if _is_dtensor(p) else p.detach()
                    t = t.to(self.export_dtype)
            if self.pp > 1:
                if t is None:
                    t = torch.empty(shape, dtype=self.export_dtype, device=self.device)
                else:
                    t = t.contiguous()
                src = int(self._grid[owner, self.dp_rank, self.tp_rank])
                dist.broadcast(t, src=src, group=self.pp_group)
            yield name, t

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        self._reshard()
        yield from bucketed(self._full(), bucket_bytes)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        from torch.distributed.tensor import distribute_tensor

        self._reshard()
        own = self._stage_params()
        known = {n for n, _, _ in self.manifest}
        alias = {}
        if self.tied:
            alias = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}
        with torch.no_grad():
            for name, full in named_tensors:
                if name not in known:
                    raise KeyError(f"update_weights: {name!r} is no parameter of this model")
                for target in (name, alias.get(name)):
                    p = own.get(target) if target else None
                    if p is None:
                        continue
                    if tuple(full.shape) != tuple(p.shape):
                        raise ValueError(f"update_weights: {name!r} has shape {tuple(full.shape)}, the model's is "
                                         f"{tuple(p.shape)}")
                    src = full.to(device=p.device, dtype=p.dtype)
                    if _is_dtensor(p):
                        part = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
                        p.to_local().copy_(part.to_local())
                    else:
                        p.copy_(src)
        self.version = int(version)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.stage, self.optimizer, options=opts)
            return {"model": model_sd, "optim": optim_sd, "version": self.version}
        return {"model": get_model_state_dict(self.stage, options=opts), "version": self.version}

    def save_checkpoint(self, directory: str) -> list[str]:
        import torch.distributed.checkpoint as dcp

        self._reshard()
        os.makedirs(directory, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=directory)
        prefix = f"__{self.rank}_"
        return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                      if f.startswith(prefix) or (self.rank == 0 and f == ".metadata"))

    def load_checkpoint(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_state_dict)

        self._reshard()
        state = self._state()
        dcp.load(state, checkpoint_id=directory)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if self.optimizer is not None:
            set_state_dict(self.stage, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            set_model_state_dict(self.stage, state["model"], options=opts)
        self.version = int(state["version"])

    def close(self) -> None:
        self.optimizer = None
        self.stage = None
        for g in self._groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        self._groups = []
