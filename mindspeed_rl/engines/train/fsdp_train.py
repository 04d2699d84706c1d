"""Training with FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and AdamW
state sharded over the DP ranks, gathered a decoder layer at a time for each forward and backward.

`actor_config.backend: fsdp` (also reference and critic models). Each decoder layer (the classes in
the HF model's `_no_split_modules`) and then the root is a `fully_shard` unit over a 1-D
`DeviceMesh` of the DP group; parameters are `DTensor`s sharded on dim 0, so AdamW's state is
sharded too, `clip_grad_norm_` computes the global norm (an all-reduce over the shards), and DCP
writes each rank's shards. Runs over gloo on the CPU and NCCL/HCCL on devices.

Collectives: every forward gathers parameters, so every rank of the DP group must make the same
calls in the same order: `log_probs`/`values` (these pad a rank that has fewer micro-batches with
dummy forwards, after an all-reduce of the counts), `train_step` (the same number of micro-batches
on every rank, `last=True` on the final one), `export_weights` (every rank iterates to the end),
`save_checkpoint`/`load_checkpoint`. `update_weights` is local (every rank is given the full
tensors and keeps its slice).

Threads: a sharded engine runs one call at a time (a lock; `export_weights` holds it a bucket at a
time). FSDP2 keeps one gathered-or-sharded state per module, so two forwards on it in two threads
reshard each other's parameters mid-forward, even on a one-rank mesh (`aten.mm got mixed
torch.Tensor and DTensor`; a frozen reference beside a DP group can be asked for two steps'
log-probs at once with max_weight_staleness > 0). The lock cannot order calls across ranks: the
collective calls of two threads must also come in the same order on every rank, which is the
caller's to keep (the worker runs a group's collective MFCs in turns: `Worker._turn`). Without a
mesh (one rank, no process group) the model is a plain module and calls run at once, as the torch
backend's do: `train_step` may wait on its micro-batches for log-probs another thread computes.

Dtypes: trained models keep fp32 parameters (the sharded master weights) and fp32 AdamW state; on a
device with `dtype: bfloat16`/`float16` the forward and backward run in that dtype
(`MixedPrecisionPolicy` over a mesh, gradients reduced in fp32; `torch.autocast` on one rank). On the CPU everything is fp32. An inference-only engine on a device
holds its parameters in `dtype` directly. `export_weights` casts to `dtype` (what rollout engines
load). docs/engines.md has the options and what was run where.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ...algorithms.metrics import merge_metrics
from ..base import Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, TrainEngine, TrainSpec, bucketed
from .offload import OffloadOptions, Offloader
from ..batching import SequenceBatch, collate, forward_groups, join_groups, right_pad, unpad_rows
from .torch_train import (adamw_kernel, check_token_budget, enable_gradient_checkpointing, pair_rows, response_log_probs,
                          response_values, sequence_scores)

OPTIONS = {"reshard_after_forward"}   # TrainSpec.options keys this backend reads


@dataclass
class FSDPOptions:
    """The fsdp backend's options (actor_config.backend_options)."""
    reshard_after_forward: bool = True   # free the gathered parameters after each forward (ZeRO-3); false: ZeRO-2

    def check(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r}: true or false")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: instances of the HF model's `_no_split_modules` classes
    (Qwen2DecoderLayer, LlamaDecoderLayer, ...), else the children of a ModuleList named `layers`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    for name, m in model.named_modules():
        if name.split(".")[-1] in ("layers", "h") and isinstance(m, torch.nn.ModuleList):
            return list(m)
    return []


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns on each single-process save/load that it assumes one process: we asked for that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _rows_of(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The dim-0 rows [lo, hi) rank `rank` holds of a tensor FSDP2 shards over `world` ranks
    (`torch.chunk`: ceil(rows / world) each, the last ones shorter or empty)."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def _exclusive(method):
    """A sharded engine's calls one at a time (module doc: Threads)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._one_call():
            return method(self, *args, **kwargs)
    return locked


class FSDPTrainEngine(TrainEngine):
    collective_forward = True   # sharded weights: every forward gathers them across the DP ranks
    def __init__(self, model: torch.nn.Module, spec: TrainSpec):
        self.spec = spec
        self._lock = threading.RLock()
        self.device = torch.device(spec.device)
        self.model_kind = spec.model_kind
        self.pad_token_id = int(spec.pad_token_id)
        self.temperature = float(spec.temperature)
        self.export_dtype = DTYPES[spec.dtype]
        self.optim_config = spec.optim
        unknown = set(spec.options) - OPTIONS
        if unknown:
            raise ValueError(f"fsdp backend options {sorted(unknown)} unknown; known: {sorted(OPTIONS)}")
        self.version = 0
        self._own_group = None
        self.mesh, self.group = self._mesh(spec.process_group)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1

        if spec.optim is None:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        else:
            model.train()
            if spec.gradient_checkpointing:   # before fully_shard: each layer's recompute gathers it again
                enable_gradient_checkpointing(model)
        self.max_tokens = check_token_budget(spec.max_tokens_per_micro_batch)
        # LoRA (engines/train/lora.py) before fully_shard, which shards the adapters with their layers; the
        # adapters' lock is the one-call lock, so a reference pass and the policy's calls never overlap
        self.lora = None
        if spec.lora:
            from .lora import apply_lora
            base = self.export_dtype if self.device.type != "cpu" else torch.float32
            self.lora = apply_lora(model, spec.lora, base, lock=self._lock)
        offload = OffloadOptions.of(spec.offload, "fsdp")
        if offload.fsdp_cpu_offload and self.mesh is None:
            raise ValueError("offload.fsdp_cpu_offload=true: FSDP2's CPUOffloadPolicy applies to sharded modules, and "
                             "one rank without a process group trains the plain module; use offload.params and "
                             "offload.optimizer there")
        if self.mesh is None:   # one rank, no process group: the plain module, same members
            self.model = model.to(self.device)
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            compute = self.export_dtype if self.device.type != "cpu" else torch.float32
            stored = next(model.parameters()).dtype
            # a LoRA model holds two dtypes (base, fp32 adapters): FSDP2 gathers one, the compute dtype
            mp = (MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
                  if compute != stored or self.lora is not None else MixedPrecisionPolicy())
            reshard = spec.options.get("reshard_after_forward", True)
            # shards, gradients and the optimizer step on the host; pinned only where there is a device
            policy = (CPUOffloadPolicy(pin_memory=self.device.type != "cpu") if offload.fsdp_cpu_offload
                      else OffloadPolicy())
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=reshard,
                            offload_policy=policy)
            # root: auto (kept gathered for backward)
            fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=policy)
            self.model = model
        self.optimizer = None
        if spec.optim is not None:
            o = spec.optim
            # only what trains has AdamW state: with LoRA, the adapters and the modules trained whole
            from .lora import trained_groups
            groups = trained_groups(self.model, spec.lora, o.lr)
            # the kernel by where the shards live: fsdp_cpu_offload keeps them (and the update) on the host
            where = next((p.device for g in groups for p in g["params"]), self.device)
            self.optimizer = torch.optim.AdamW(groups, betas=tuple(o.betas), eps=o.eps,
                                               weight_decay=o.weight_decay, **adamw_kernel(where))
        # between stages (engines/train/offload.py): the parameters and AdamW state wait on the host
        self.offloader = Offloader.for_engine(offload, lambda: self.model, lambda: self.optimizer, self.device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, spec: TrainSpec) -> "FSDPTrainEngine":
        from .torch_train import load_model

        device = torch.device(spec.device)
        if device.type != "cpu" and device.index is not None:
            getattr(torch, device.type).set_device(device)  # torch.cuda / torch.npu
        # trained models keep fp32 master weights; a device computes in `dtype` (mixed precision); a LoRA
        # base is held in `dtype` (the fp32 adapters are the masters)
        stored = ("float32" if (spec.optim is not None and not spec.lora) or device.type == "cpu"
                  else spec.dtype)
        torch.manual_seed(spec.seed)  # a value or reward model's fresh head: the same on every rank
        return cls(load_model(spec, stored), spec)

    def _mesh(self, group):
        """A 1-D DeviceMesh over the DP group (None when single-rank without a process group)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        device_type = self.device.type
        if group is None:
            if not dist.is_initialized():
                return None, None
            # a one-rank group of our own (no other rank takes part in creating it)
            group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
            self._own_group = group
        if group is dist.group.WORLD or group == dist.group.WORLD:
            mesh = init_device_mesh(device_type, (dist.get_world_size(),))
            return mesh, mesh.get_group()
        return DeviceMesh.from_group(group, device_type), group

    # ------------------------------------------------------------------ batches and forwards
    def batch(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> SequenceBatch:
        b = collate(prompts, responses, self.pad_token_id)
        if self.device.type != "cpu":
            b = SequenceBatch(*(x.to(self.device) for x in
                                (b.input_ids, b.attention_mask, b.position_ids, b.responses, b.response_mask)),
                              prompt_width=b.prompt_width)
        return b

    def forward(self, batch: SequenceBatch, with_entropy: bool = True) -> ModelOutput:
        """The model's outputs over the response tokens, with grad when grad is enabled. Log-probs and
        entropies come chunked from the response positions only (`response_log_probs`): no
        [rows, tokens, vocab] fp32 tensor."""
        with self._autocast():
            if self.model_kind == "reward":
                return ModelOutput(response_mask=batch.response_mask, scores=sequence_scores(self.model, batch))
            if self.model_kind == "value":
                return ModelOutput(response_mask=batch.response_mask, values=response_values(self.model, batch))
            logp, entropy = response_log_probs(self.model, batch, self.temperature, with_entropy)
        return ModelOutput(response_mask=batch.response_mask, log_probs=logp, entropy=entropy)

    def _autocast(self):
        """One rank has no FSDP2 MixedPrecisionPolicy: there the fp32 master weights compute in `dtype`
        under autocast on a device, as the policy makes a mesh's do. The CPU computes in fp32 either way."""
        if self.mesh is not None or self.device.type == "cpu" or self.export_dtype == torch.float32:
            return contextlib.nullcontext()
        if self.lora is None and next(self.model.parameters()).dtype == self.export_dtype:  # an inference
            # engine holds dtype itself (a LoRA base does too, but its fp32 adapters compute in dtype)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.export_dtype)

    def adapters_in_use(self):
        """Held around each forward (and backward) of the policy: a LoRA reference pass, which turns the
        adapters off model-wide, waits for it (engines/train/lora.py). On a mesh `_one_call` holds it already;
        without one it is what keeps a reference pass and the policy's forwards apart."""
        return self.lora.in_use() if self.lora is not None else contextlib.nullcontext()

    def _one_call(self):
        """The lock of a sharded engine (FSDP2's state is per module); nothing without a mesh."""
        return self._lock if self.mesh is not None else contextlib.nullcontext()

    def _reshard(self) -> None:
        """Back to sharded parameters (the root stays gathered after a forward without backward)."""
        if self.mesh is not None:
            self.model.reshard()

    def _max_over_ranks(self, n: int) -> int:
        if self.world == 1:
            return n
        dev = self.device if self.device.type != "cpu" else torch.device("cpu")
        t = torch.tensor([n], dtype=torch.long, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    @_exclusive
    @torch.no_grad()
    def _infer(self, prompts, responses, micro_batch_size: int, column: str) -> list[torch.Tensor]:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be > 0")
        groups = forward_groups(prompts, responses, micro_batch_size, self.max_tokens)
        # every rank runs the same number of forwards (each gathers parameters): pad with dummies
        total = self._max_over_ranks(len(groups))
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for g in groups:
            b = self.batch([prompts[i] for i in g], [responses[i] for i in g])
            with self.adapters_in_use():
                o = self.forward(b, with_entropy=False)
            if column == "scores":  # one per row
                rows = [v.reshape(1).float().cpu() for v in o.scores]
            else:
                rows = [r.float().cpu() for r in unpad_rows(getattr(o, column), b.response_mask)]
            for i, r in zip(g, rows):
                out[i] = r
        for _ in range(total - len(groups)):
            self.forward(self._dummy_batch(), with_entropy=False)
        self._reshard()
        return out

    def _dummy_batch(self) -> SequenceBatch:
        """One pad token of prompt and of response: the forward a rank with fewer groups makes so that
        its parameter gathers pair up with the other ranks'."""
        pad = torch.tensor([self.pad_token_id])
        return self.batch([pad], [pad])

    def _train_output(self, data: dict) -> tuple[ModelOutput, torch.Tensor | None]:
        """A training micro-batch's output (a reward model's over its pairs) and, where the DP ranks split
        theirs into different numbers of token-budget forwards, a zero that depends on this rank's dummy
        forwards (None without any): added to the loss, it takes them through the backward as well, so
        every rank gathers and reduces as many times. The split forwards are joined before the loss
        (`join_groups`), which sees exactly the micro-batch it would see from one padded forward."""
        if self.model_kind == "reward":
            return self.forward(self.batch(*pair_rows(data))), None
        prompts, responses = data["prompts"], data["responses"]
        if self.max_tokens is None:
            return self.forward(self.batch(prompts, responses)), None
        groups = forward_groups(prompts, responses, len(prompts), self.max_tokens)
        total = self._max_over_ranks(len(groups))
        outs = [self.forward(self.batch([prompts[i] for i in g], [responses[i] for i in g])) for g in groups]
        out = (outs[0] if len(groups) == 1 else
               join_groups(groups, outs, right_pad(responses, self.pad_token_id)[1].to(self.device)))
        zero = None
        for _ in range(total - len(groups)):
            o = self.forward(self._dummy_batch())
            t = (o.values if o.values is not None else o.log_probs + o.entropy).sum() * 0.0
            zero = t if zero is None else zero + t
        return out, zero

    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        if self.model_kind != "causal_lm":
            raise NotImplementedError("log_probs of a value model")
        return self._infer(prompts, responses, micro_batch_size, "log_probs")

    def values(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        if self.model_kind != "value":
            raise NotImplementedError(f"{type(self).__name__} holds no value model (model_kind={self.model_kind})")
        return self._infer(prompts, responses, micro_batch_size, "values")

    def scores(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """A reward model's score of each row ([1] float32), at its last token."""
        if self.model_kind != "reward":
            raise NotImplementedError(f"{type(self).__name__} holds no reward model (model_kind={self.model_kind})")
        return self._infer(prompts, responses, micro_batch_size, "scores")

    # ------------------------------------------------------------------ training
    @_exclusive
    def train_step(self, micro_batches: Iterable[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without optim)")
        sums: dict[str, float] = {}
        n = 0
        unsynced = False
        for mb in micro_batches:
            # each micro-batch's backward reduce-scatters its gradients (FSDP2's default, verl's way): a rank
            # accumulates its shard of the fp32 gradients, never the whole model's (30.5 GB for 7B)
            with self.adapters_in_use():
                out, zero = self._train_output(mb.data)
                loss, metrics = loss_fn(out, mb)
                loss = loss * mb.loss_scale
                (loss if zero is None else loss + zero).backward()
            unsynced = not mb.last
            merge_metrics(sums, metrics)  # _max maxed, _min minned, the rest summed
            n += 1
        if n == 0:
            raise ValueError("train_step got no micro-batches")
        if unsynced and self.mesh is not None:
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError("the last micro-batch of train_step had last=False: the step's micro-batches "
                               "ended early, so its gradients were dropped")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_config.grad_clip)
        if _is_dtensor(grad_norm):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {**sums, "micro_batches": n, "grad_norm": grad_norm}

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int, adapters: bool = True) -> Iterator[Bucket]:
        """Buckets are planned on the parameters' global shapes in the export dtype (the same
        buckets `bucketed` makes of the full tensors), then gathered a bucket at a time: at most
        one bucket's full tensors are alive per bucket pulled. A tied parameter in one bucket is
        gathered once and yielded under both names; in two buckets it is gathered in each. The engine's
        lock is held while a bucket is gathered, not while the caller has it. A LoRA model yields its
        merged weights under the base's HF names (`adapters=False`: the base alone, the LoRA reference's)."""
        with self._one_call():
            self._reshard()
            params = dict(self.model.named_parameters(remove_duplicate=False))
        if self.lora is not None:
            yield from self._export_merged(params, bucket_bytes, adapters)
            return
        plan = ((n, torch.empty(p.shape, dtype=self.export_dtype, device="meta")) for n, p in params.items())
        for planned in bucketed(plan, bucket_bytes):
            with self._one_call():
                bucket = self._gather_bucket([(n, params[n]) for n, _ in planned])
            yield bucket

    def _export_merged(self, params: dict, bucket_bytes: int, adapters: bool) -> Iterator[Bucket]:
        """LoRA's export: per bucket, its base weights gathered in the export dtype and their adapters in
        fp32, merged into one buffer (`lora.write_bucket`) before the next bucket is gathered."""
        from .lora import export_plan, write_bucket

        plan = export_plan(self.model, adapters)
        by_name = {e.name: e for e in plan}
        meta = ((e.name, torch.empty(params[e.source].shape, dtype=self.export_dtype, device="meta")) for e in plan)
        for planned in bucketed(meta, bucket_bytes):
            entries = [by_name[n] for n, _ in planned]
            sources = dict.fromkeys(e.source for e in entries)
            factors = dict.fromkeys(n for e in entries if e.lora for n in e.lora)
            with self._one_call():
                full = dict(self._gather_bucket([(n, params[n]) for n in sources]))
                full.update(self._gather_bucket([(n, params[n]) for n in factors], torch.float32))
                bucket = write_bucket(entries, full.__getitem__, self.export_dtype, next(iter(full.values())).device)
            yield bucket

    def _gather_bucket(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> Bucket:
        """(HF name, full tensor in `dtype`, default the export dtype) of each parameter, every rank taking part.

        Over gloo each row-sharded parameter is gathered by broadcasts: every rank casts its rows
        straight into its part of the full tensor and broadcasts that part, all of a bucket's
        broadcasts in flight together. On this CPU gloo's all-gather ran at 0.10 GB/s where two
        broadcasts moved the same bytes at 0.89 (`DTensor.full_tensor` is an all-gather), and this
        needs no padded gather buffer nor an unpadding copy. NCCL/HCCL keep `full_tensor` (cast
        the shard first, so the gather moves the export dtype): their all-gather is the fast one."""
        dtype = dtype or self.export_dtype
        out: Bucket = []
        done: dict[int, torch.Tensor] = {}
        works = []
        with torch.no_grad():
            for name, p in named:
                t = done.get(id(p))
                if t is None:
                    if not _is_dtensor(p):
                        t = p.detach().to(dtype)
                    elif self._broadcast_gather(p):
                        t = torch.empty(p.shape, dtype=dtype, device=p.to_local().device)
                        works += self._broadcast_rows(p, t)
                    else:
                        t = (p.to(dtype) if p.dtype != dtype else p).full_tensor()
                    done[id(p)] = t
                out.append((name, t))
            for w in works:
                w.wait()
        return out

    def _broadcast_gather(self, p) -> bool:
        """Gather `p` by `_broadcast_rows`: gloo, and rows sharded as `torch.chunk` cuts them."""
        from torch.distributed.tensor import Shard

        if (self.group is None or dist.get_backend(self.group) != "gloo" or p.dim() == 0
                or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),)):
            return False
        mesh = p.device_mesh
        lo, hi = _rows_of(p.shape[0], mesh.size(), mesh.get_local_rank())
        local = p.to_local()
        return tuple(local.shape) == (hi - lo, *p.shape[1:])

    def _broadcast_rows(self, p, full: torch.Tensor) -> list:
        """Fill `full` with `p`'s rows: this rank's copied in (cast), every rank's broadcast from it."""
        mesh = p.device_mesh
        pg, me, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        works = []
        for r in range(world):
            lo, hi = _rows_of(p.shape[0], world, r)
            if hi <= lo:
                continue
            if r == me:
                full[lo:hi].copy_(p.to_local())
            works.append(dist.broadcast(full[lo:hi], src=dist.get_global_rank(pg, r), group=pg, async_op=True))
        return works

    @_exclusive
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        from torch.distributed.tensor import distribute_tensor

        self._reshard()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, full in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: {name!r} is no parameter of this model")
                p = params[name]
                if _is_dtensor(p):
                    # this rank's slice, cut locally (src_data_rank=None: no communication)
                    part = distribute_tensor(full.to(device=p.device, dtype=p.dtype), p.device_mesh,
                                             p.placements, src_data_rank=None)
                    p.to_local().copy_(part.to_local())
                else:
                    p.copy_(full.to(device=p.device, dtype=p.dtype))
        self.version = int(version)

    # ------------------------------------------------------------------ checkpoints
    def _state_options(self):
        """A LoRA model's checkpoint holds its adapters only (the base is the checkpoint it loads from);
        loading leaves the frozen base as it is."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.lora is not None else None

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
            if self.lora is not None:   # a tied frozen weight (lm_head.weight) escapes ignore_frozen_params
                trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
                model_sd = {k: v for k, v in model_sd.items() if k in trained}
            return {"model": model_sd, "optim": optim_sd, "version": self.version}
        return {"model": get_model_state_dict(self.model), "version": self.version}

    @_exclusive
    def save_checkpoint(self, directory: str) -> list[str]:
        import torch.distributed.checkpoint as dcp

        self._reshard()
        os.makedirs(directory, exist_ok=True)
        with _quiet_no_dist():
            dcp.save(self._state(), checkpoint_id=directory, process_group=self.group,
                     no_dist=self.group is None)
        prefix = f"__{self.rank}_"
        return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                      if f.startswith(prefix) or (self.rank == 0 and f == ".metadata"))

    @_exclusive
    def load_checkpoint(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        self._reshard()
        state = self._state()
        with _quiet_no_dist():
            dcp.load(state, checkpoint_id=directory, process_group=self.group, no_dist=self.group is None)
        if self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=self._state_options())
        else:
            set_model_state_dict(self.model, state["model"])
        self.version = int(state["version"])

    @_exclusive
    def close(self) -> None:
        self.optimizer = None
        self.model = None
        if self._own_group is not None:
            dist.destroy_process_group(self._own_group)
            self._own_group = None
