"""Training on a ("pp", "dp", "tp") device mesh with PyTorch's own parallelism: tensor parallelism
(`torch.distributed.tensor.parallel`), pipeline parallelism (`torch.distributed.pipelining`) and
FSDP2 (`fully_shard`) over the data-parallel replicas.

`actor_config.backend: mesh`, or a torch or fsdp group with tp or pp > 1 (docs/engines.md). This
module holds the engine's construction, mesh, batches and inference; `mesh_stage.py` the stage module
and TP plan, `mesh_step.py` the optimizer step, `mesh_weights.py` export, update and checkpoints. `TrainSpec.options`:

    tp, pp, dp          the mesh (dp * tp * pp must be the size of the default process group)
    pp_microbatches     the worker's micro-batches run through the pipeline per schedule step
                        (a "round"; default: pp)
    pp_schedule         "1f1b" (default; GPipe for a round of fewer micro-batches than stages) or "gpipe"
    dp_shard            with dp > 1, shard each replica's weights over dp with FSDP2 (default true);
                        false keeps a full copy per replica, so replicas run independently (the mesh
                        rollout backend, whose replicas generate different numbers of tokens)

Layout: the mesh is ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``,
so mesh rank ``pp_idx * dp * tp + dp_idx * tp + tp_idx`` is exactly `parallel.topology`'s sub-rank
(PP outermost, TP innermost), as the mesh deployment numbers its actors. Which rank of a replica
reads the dock, which writes and which ranks form the replica come from the deployment
(`TrainSpec.role`, engines/deployment.py `RankRole`); the engine builds the replica's process group
from it.

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
  runs on the real response tokens only, in chunks (`log_probs.head_log_probs`), so no
  [rows, R, vocab] fp32 tensor crosses the schedule or stays for the backward.
* The optimizer is AdamW over this rank's parameters (DTensor shards and plain tensors); the grad
  norm is the global one: `get_total_norm` per kind of tensor (a DTensor's `full_tensor()`), the
  squares summed over the pipeline stages; clipping with `clip_grads_with_norm_`.

Calling contract (every rank of the mesh calls every method, in the same order):

* `train_step(micro_batches, loss_fn)`: only the replica's reader (mesh coordinate pp=0, tp=0 of
  each dp index: its deployment's `RankRole.reads`) iterates `micro_batches`; it broadcasts each
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

import torch
import torch.distributed as dist
from torch import nn

from ..base import MicroBatch, ModelOutput, TrainEngine, TrainSpec
from ..batching import SequenceBatch, collate, forward_groups, positions, unpad_rows
from .mesh_stage import StageModule, is_dtensor, qwen2_tp_plan, split_layers
from .mesh_step import MeshTrainStep
from .mesh_weights import MeshWeights

OPTIONS = {"tp", "pp", "dp", "pp_microbatches", "pp_schedule", "dp_shard"}
SCHEDULES = ("1f1b", "gpipe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MeshTrainEngine(MeshTrainStep, MeshWeights, TrainEngine):
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
        self._build_mesh(spec.process_group, spec.role)

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
            mixed = len({is_dtensor(p) for p in params}) > 1
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

    def _build_mesh(self, group, role) -> None:
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
        self._grid = self.mesh.mesh  # [pp, dp, tp] tensor of global ranks
        self._take_role(role)
        self.embed_group = None

    def _take_role(self, role) -> None:
        """The dock roles of this rank and its replica's process group, from its deployment's `RankRole`
        (engines/deployment.py); an engine built outside a worker (`role` None) takes its rank's role from the
        mesh deployment of its (tp, pp, dp)."""
        if role is None:
            from ..deployment import MESH, Deployment
            role = Deployment("mesh", MESH, dp=self.dp, tp=self.tp, pp=self.pp).roles()[self.rank]
        if role.rank != self.rank or role.replica != self.dp_rank or role.dp != self.dp:
            raise ValueError(f"mesh backend: rank {self.rank} (dp index {self.dp_rank} of {self.dp}) was given the role "
                             f"of rank {role.rank} (replica {role.replica} of {role.dp}); the deployment and the "
                             "mesh must number the ranks alike ((pp, dp, tp)-major)")
        self.role = role
        self.replica_group = self._subgroup([list(r) for r in role.replicas], list(role.replica_ranks))
        self.replica_size = len(role.replica_ranks)
        self.reader_rank, self.writer_rank = role.reader, role.writer
        self.is_dock_reader, self.is_dock_writer = role.reads, role.writes
        self.dp_size = role.dp

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

    def close(self) -> None:
        self.optimizer = None
        self.stage = None
        for g in self._groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        self._groups = []
