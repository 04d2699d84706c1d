"""The two engine interfaces workers talk to: exactly the members workers use, nothing more.

A backend is a subclass registered by name in `registry.py`, the only place that knows backend
names. Workers never import a backend module; they ask the registry for an engine and call the
members below. docs/engines.md says what each backend supports and what was run where.

Why the train engine owns the whole update (`train_step`): a sharded (FSDP2) or pipelined
(Megatron, torch.distributed.pipelining) backend runs its own schedule of forwards, backwards and
gradient reductions. The worker hands it the micro-batches as they come out of the dock and a loss
function of the model's outputs; the engine does forward, backward (no gradient sync but on the
last micro-batch), clipping and the optimizer step.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one rollout call samples with (MindSpeed-RL's `generate_config` sampling keys)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    greedy: bool = False


@dataclass
class Rollout:
    """One generate call's answer, one entry per prompt, in order.

    `responses`: 1-D token ids, ending with a stop token unless cut by max_new_tokens.
    `log_probs`: 1-D float32, the log-prob of each sampled token under the distribution it was
    sampled from (temperature, top-k and top-p applied): the behaviour policy that off-policy
    corrections and the `rollout/logprob_diff_*` check compare with the trainer's log-probs.
    `version_switches`: per row, {token index: weight version} for each weight update that landed while
    the row was generated (the first token the new weights sampled); None from engines that do not say.
    """
    responses: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    version_switches: list[dict[int, int]] | None = None


NamedTensors = Iterable[tuple[str, torch.Tensor]]
Bucket = list[tuple[str, torch.Tensor]]


class ReplicaRoles:
    """What this rank does in its replica (the ranks holding one copy of the model), as verl's engines
    declare their data-parallel rank and which rank holds the outputs (`is_mp_src_rank_with_outputs`).

    A one-rank replica (plain data parallelism, the default) reads its own micro-batches from the dock
    and writes its own results. A split model (tp or pp > 1) has one reader (it pulls micro-batches and
    the replica gets them from it) and one writer (it holds the outputs and pushes them). Which rank is
    which comes from the deployment (`spec.role`, engines/deployment.py `RankRole`): a split engine sets
    these members from it and builds `replica_group` over its replica's ranks; it computes no role.
    """

    is_dock_reader: bool = True          # pulls micro-batches from the dock
    is_dock_writer: bool = True          # pushes the replica's outputs to the dock
    replica_group: Any = None            # the process group over the replica's ranks (None: one rank)
    reader_rank: int = 0                 # the reader's rank in the default group (the replica's broadcast source)
    writer_rank: int = 0                 # the writer's rank in the default group
    dp_rank: int = 0                     # this replica's data-parallel index
    dp_size: int = 1
    collective_forward: bool = False     # every forward is collective across the DP ranks (sharded weights:
                                         # FSDP, a mesh, megatron): each rank must make as many inference calls

    @property
    def shares_batches(self) -> bool:
        """Must the worker hand each micro-batch the reader pulled to the whole replica before the engine's
        call? Yes where the writer is not the reader (it must know which rows it writes); an engine that
        broadcasts inside its own calls needs nothing else."""
        return self.replica_group is not None and self.reader_rank != self.writer_rank


WAKE_TAGS = ("weights", "kv_cache")   # what a sleeping rollout engine can wake, one without the other (vLLM's tags)


class RolloutEngine(ReplicaRoles, abc.ABC):
    """Generates responses; holds its own copy of the policy weights, refreshed by weight sync."""

    weight_version: int = 0
    concurrent_generate: bool = False   # may two threads call `generate` at once (rows of two steps in flight)?
    partial_rollout: bool = False       # can it take new weights while `generate` calls are in flight (`paused`)?
    # micro-batches a generate stage keeps in flight at once: > 1 only for an engine that computes elsewhere
    # and batches across calls (a server); an in-process engine's concurrent calls would share its cores
    micro_batches_in_flight: int = 1

    @abc.abstractmethod
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int]) -> Rollout:
        """One response per prompt; row i samples with `seeds[i]`, so a row gets the same tokens
        whichever micro-batch, mode or process generates it."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load weights given by HF parameter name (a bucket at a time; may be called several
        times per version, each with some of the names), then serve `version`."""

    def state_checksum(self) -> str | None:
        """sha256 of the weights it serves, in HF names, when the backend can read them back
        (None otherwise); `weight_sync.verify` compares it with the trainer's."""
        return None

    def receive_targets(self) -> dict[str, torch.Tensor] | None:
        """{HF name: the tensor it serves that name from} when its weights map 1:1 onto HF names, so
        a sync from another process can receive big tensors straight into them
        (`weight_sync.receive_weights`): no receive buffer to copy out of, which on a CPU was a third
        of a sync's time. None (the default) when they do not (vLLM's fused qkv/gate_up, a sharded
        copy): every bucket then goes through `update_weights`. An engine that returns targets is
        afterwards told `update_weights((), version)` with no tensors, to serve `version` as if it
        had loaded them. Targets that lie side by side in one buffer (`flatten_parameters`) take a
        whole bucket of a flattened trainer in one broadcast; the alignment padding between them
        is written too, so it must belong to no other tensor."""
        return None

    @classmethod
    def refusal(cls, options: dict, tp: int) -> str | None:
        """Why the engine this backend builds from `options` cannot run at tensor-parallel size `tp`, or None:
        asked by the plan, so a combination the engine cannot build stops before any worker starts."""
        return None

    @classmethod
    def takes_partial_rollout(cls, options: dict) -> bool:
        """Whether the engine this backend builds from `options` implements `paused` (rl_config.partial_rollout)."""
        return cls.partial_rollout

    def paused(self) -> contextlib.AbstractContextManager:
        """Hold every `generate` call in flight at its next decode step until the context exits; a weight
        update loads inside it, and the calls go on with the new weights over the KV cache the old ones
        wrote (rl_config.partial_rollout: AReaL's interruptible generation, verl's partial rollout). Each
        token's log-prob is that of the weights that sampled it. Engines with `partial_rollout` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights while generate calls are in "
                                  "flight (partial_rollout is False)")

    def sleep(self) -> None:
        """Free device memory between rollouts when it shares a device with training (vLLM's
        sleep mode: its weights and its KV cache); a no-op where there is nothing to free."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory `sleep` freed: `tags` names which (WAKE_TAGS; None: all). A weight
        update needs only the weights (a sync wakes `("weights",)` before writing them: loading into
        memory the engine gave away corrupts it or fails), generation needs both. A no-op for what is
        awake and where `sleep` is one."""

    def close(self) -> None:
        """Release processes and memory; the engine is unusable afterwards."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and clipping of a trained model (actor_config / critic_config)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class RolloutSpec:
    """What a rollout backend is built from (the registry fills it from the config)."""
    model_path: str                      # a local HF checkpoint directory
    dtype: str = "float32"               # float32, bfloat16, float16
    device: str = "cpu"                  # torch device string: cpu, cuda:0, npu:0
    pad_token_id: int = 0
    seed: int = 0
    options: dict = field(default_factory=dict)  # backend-specific keys (generate_config.vllm.*)
    max_seq_len: int = 0                 # the longest prompt + response this run makes (0: unknown); an engine
                                         # that sizes its caches by it (vLLM's max_model_len) defaults to it
    cuda_graphs: bool | None = None      # generate_config.cuda_graphs: a fixed-shape decode replayed as CUDA graphs
                                         # (the hf engine); None: on CUDA, off elsewhere
    role: Any = None                     # this rank's deployment.RankRole (a split engine's reader, writer and
                                         # replica); None: a one-rank replica


@dataclass
class TrainSpec:
    """What a train backend is built from (the registry fills it from the config)."""
    model_path: str                      # a local HF checkpoint directory
    model_kind: str = "causal_lm"        # causal_lm (policy, reference), value (critic) or reward (reward model)
    dtype: str = "float32"
    device: str = "cpu"
    pad_token_id: int = 0
    temperature: float = 1.0             # log-probs of the sampling distribution (logits / temperature)
    optim: OptimConfig | None = None     # None: inference only
    process_group: Any = None            # the DP group over this model's ranks (None: a single rank)
    role: Any = None                     # this rank's deployment.RankRole (a split engine's reader, writer and
                                         # replica); None: a one-rank replica
    seed: int = 0
    options: dict = field(default_factory=dict)  # backend-specific keys
    # what the model's own config section asks of any backend (a backend lists the ones it takes in its
    # registry row, `Backend.model_features`; the plan refuses the others before any worker starts)
    max_tokens_per_micro_batch: int | None = None  # padded tokens per forward (length-sorted split); None: off
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in the backward
    lora: dict | None = None             # LoraConfig's fields (rank > 0) of a trained policy; None: no adapters
    offload: dict | None = None          # OffloadConfig's fields (params, optimizer, fsdp_cpu_offload); None: off


MODEL_FEATURES = ("max_tokens_per_micro_batch", "gradient_checkpointing", "lora", "offload")


@dataclass
class MicroBatch:
    """What a train step consumes: the rows' columns (`prompts`, `responses`, ...) as lists of 1-D
    tensors, and the weight of this micro-batch's loss in the mini-batch (rows / mini-batch rows),
    so accumulated gradients equal one pass over the whole mini-batch."""
    data: dict[str, list]
    loss_scale: float
    last: bool = False      # the mini-batch's last micro-batch: gradients are reduced across DP on it


@dataclass
class ModelOutput:
    """What the engine's forward gives a loss function, [B, R] over response tokens."""
    response_mask: torch.Tensor
    log_probs: torch.Tensor | None = None     # causal LMs
    entropy: torch.Tensor | None = None       # causal LMs
    values: torch.Tensor | None = None        # value models
    scores: torch.Tensor | None = None        # reward models: one per row [B], at its last token


# loss_fn(outputs, micro_batch) -> (scalar loss with grad, metrics to sum over micro-batches)
LossFn = Callable[[ModelOutput, MicroBatch], "tuple[torch.Tensor, dict[str, float]]"]


class TrainEngine(ReplicaRoles, abc.ABC):
    """Forward, backward and optimizer of one model (the policy, a critic, a reference).

    Built with an optimizer it trains (`train_step`); built without one it only infers (reference
    log-probs, or a reader of the policy on another worker, refreshed by `update_weights`).
    `version` counts optimizer steps (the weight version weight sync publishes).
    """

    version: int = 0
    offloader: Any = None   # engines/train/offload.Offloader where TrainSpec.offload moves state between stages

    def holding(self, for_training: bool, why: str) -> "contextlib.AbstractContextManager[None]":
        """The state a caller needs on the device while it runs: the parameters, and the optimizer
        state `for_training`. Where the engine offloads (`offloader`), what went to the host comes back
        and leaves again after the last holder; otherwise nothing moves. Callers: each stage of an MFC
        (workers/stage.py), the weight export of a sync, a checkpoint."""
        if self.offloader is None:
            return contextlib.nullcontext()
        return self.offloader.holding(for_training, why)

    # ---- inference
    @abc.abstractmethod
    def log_probs(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                  micro_batch_size: int) -> list[torch.Tensor]:
        """Per-token log-probs of each response (1-D float32 per row, on the CPU)."""

    def values(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
               micro_batch_size: int) -> list[torch.Tensor]:
        """A value model's per-token values of each response (1-D float32 per row, on the CPU)."""
        raise NotImplementedError(f"{type(self).__name__} holds no value model")

    def scores(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
               micro_batch_size: int) -> list[torch.Tensor]:
        """A reward model's score of each (prompt, response): a [1] float32 tensor per row, on the CPU."""
        raise NotImplementedError(f"{type(self).__name__} holds no reward model")

    # ---- training
    @abc.abstractmethod
    def train_step(self, micro_batches: Iterable[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over a mini-batch: forward, `loss_fn`, backward of
        `loss * loss_scale` per micro-batch as they arrive, then (once `micro_batches` is exhausted)
        clip, step, zero the gradients and bump `version`.

        Returns the loss metrics summed over micro-batches, `micro_batches` (their count) and
        `grad_norm` (before clipping). A non-finite gradient norm skips the update but counts the
        step. The iterable is consumed to its end before the optimizer steps, so a worker may wait
        there (for readers of the old weights) in its generator."""

    # ---- weights
    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The model's weights in HF names, a bucket of at most `bucket_bytes` at a time (a single
        tensor larger than that is a bucket of its own), in the model's dtype and on the engine's
        device. Tied weights come under every name a reader needs (`lm_head.weight` too). A sharded
        engine gathers one bucket at a time and every rank must iterate to the end (the gathers are
        collective); only the rank that sends needs to look at the tensors."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load weights by HF name (a reader of a model trained elsewhere), then report `version`."""

    # ---- checkpoints
    @abc.abstractmethod
    def save_checkpoint(self, directory: str) -> list[str]:
        """Model and optimizer state (and `version`) under `directory`; every rank calls it
        (a sharded engine writes its shards); returns the files this rank wrote."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Restore exactly what `save_checkpoint` wrote (every rank calls it)."""

    def state_checksum(self) -> str | None:
        """`weight_sync.checksum` of the weights it holds in HF names (None when it cannot read them
        back cheaply); `weight_sync.verify` compares it with what the trainer sent."""
        return None

    def receive_targets(self) -> dict[str, torch.Tensor] | None:
        """As `RolloutEngine.receive_targets`: an inference copy of a model trained elsewhere whose
        parameters are its HF names returns them, so a sync receives into them with no copy-out."""
        return None

    def close(self) -> None:
        """Release process groups and memory."""


ALIGN = 64  # byte alignment of a tensor in a flat parameter buffer and in a weight sync bucket


def flatten_parameters(module: torch.nn.Module, align: int = ALIGN) -> dict[tuple, torch.Tensor]:
    """Move `module`'s parameters into one contiguous byte buffer per (device, dtype), in
    `named_parameters()` order, each at an `align`-byte-aligned offset; `p.data` becomes a view.

    Why: weight sync sends a bucket whose tensors lie side by side in one storage, at the same
    relative offsets as its wire layout (`sync/bucket_layout.BucketSpec`, also `ALIGN`-aligned), as ONE
    broadcast straight from that memory, and a reader whose parameters lie the same way receives
    it straight into them. Per-tensor broadcasts (~180 for Qwen2.5-0.5B) cost a quarter of the
    throughput of one flat broadcast over gloo.

    The Parameter objects stay the same (a tied parameter, e.g. Qwen2's `lm_head.weight`, is one
    Parameter: it gets one view and stays tied; optimizers and hooks that hold the Parameters keep
    working); values are unchanged. Existing `.grad`s are left as they are. Idempotent: a group
    already laid out this way is not copied again. Returns {(device, dtype): buffer}.

    Only for engines whose weights are saved with `torch.save`/DCP (views of one storage are
    fine there): safetensors' `save_pretrained` refuses tensors that share a storage. A later
    `module.to(...)` that changes device or dtype makes fresh tensors again (contiguity is lost,
    nothing breaks), so call it after moving the module."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for _, p in module.named_parameters():           # a tied parameter once
        groups.setdefault((p.device, p.dtype), []).append(p)
    out = {}
    for key, params in groups.items():
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total = (total + p.numel() * p.element_size() + align - 1) // align * align
        base = params[0].data
        storage = base.untyped_storage()
        start = base.storage_offset() * base.element_size()
        if all(p.data.is_contiguous() and p.data.untyped_storage().data_ptr() == storage.data_ptr()
               and p.data.storage_offset() * p.element_size() - start == off for p, off in zip(params, offsets)):
            n = min(total, storage.nbytes() - start)   # the last tensor's alignment tail may be absent
            out[key] = torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage, start, (n,))
            continue
        buf = torch.empty(total, dtype=torch.uint8, device=key[0])
        with torch.no_grad():
            for p, off in zip(params, offsets):
                view = buf[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view
        out[key] = buf
    return out


def bucketed(named: NamedTensors, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes` (a larger tensor alone),
    sized as if in `dtype` when given (the dtype they will be sent in)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0 (weight_sync.bucket_mb sets it)")
    bucket: Bucket = []
    size = 0
    for name, t in named:
        n = t.numel() * (t.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def cast_bucket(bucket: Bucket, dtype: torch.dtype, align: int = ALIGN) -> Bucket:
    """`bucket` with every floating tensor in `dtype`; tensors already in it are passed as they are.

    The cast copies go into ONE new buffer at the offsets weight sync's wire gives them (`align`-byte
    aligned, in bucket order; a tensor named twice, a tied weight, takes one place), so the bucket
    still lies in memory as on the wire and goes as one broadcast (`sync/bucket_layout.BucketSpec`)."""
    if all(t.dtype == dtype or not t.is_floating_point() for _, t in bucket):
        return bucket
    def key(t: torch.Tensor) -> tuple:   # the same view of the same memory (as BucketSpec dedups)
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()

    places: dict[tuple, tuple[int, torch.Tensor]] = {}
    total = 0
    for _, t in bucket:
        if not t.numel() or key(t) in places:
            continue
        places[key(t)] = (total, t)
        size = t.numel() * (torch.empty((), dtype=dtype).element_size() if t.is_floating_point() else t.element_size())
        total = (total + size + align - 1) // align * align
    device = bucket[0][1].device
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    views: dict[tuple, torch.Tensor] = {}
    with torch.no_grad():
        for k, (off, t) in places.items():
            dt = dtype if t.is_floating_point() else t.dtype
            n = t.numel() * torch.empty((), dtype=dt).element_size()
            views[k] = buf[off:off + n].view(dt).view(t.shape)
            views[k].copy_(t)
    return [(name, views[key(t)] if t.numel() else t.to(dtype if t.is_floating_point() else t.dtype))
            for name, t in bucket]


def cast_buckets(named: NamedTensors, dtype: torch.dtype, bucket_bytes: int) -> Iterator[Bucket]:
    """`bucketed` in `dtype`: buckets planned on the cast sizes, each cast when it is pulled (one
    bucket's copies alive at a time, not a second model). A trained engine with fp32 master weights
    exports this way in its compute dtype."""
    for bucket in bucketed(named, bucket_bytes, dtype):
        yield cast_bucket(bucket, dtype)


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight a reader of the HF checkpoint needs, tied ones under each of their names."""
    yield from ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))


def load_named(model: torch.nn.Module, named: NamedTensors) -> list[str]:
    """Copy tensors into `model`'s parameters and buffers by HF name; returns the names loaded.

    An unknown name or a shape that does not fit is refused before anything is written from that
    tensor, naming it: the reader's architecture differs from the trainer's."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers()))
    loaded = []
    with torch.no_grad():
        for name, t in named:
            target = own.get(name)
            if target is None:
                raise ValueError(f"weight sync: {name!r} is not a weight of the reading model "
                                 f"({type(model).__name__}); the reader's architecture differs from the trainer's")
            if tuple(target.shape) != tuple(t.shape):
                raise ValueError(f"weight sync: {name!r} has shape {tuple(t.shape)} but the reading model's is "
                                 f"{tuple(target.shape)}; the reader's architecture differs from the trainer's")
            target.copy_(t)
            loaded.append(name)
    return loaded
