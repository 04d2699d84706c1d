"""Training with plain torch: AdamW, gradient accumulation over micro-batches, grad clipping, and
DDP over gloo (nccl/hccl on devices) when a stage has DP > 1.

The engine knows nothing about RL: it turns rows into a padded batch, returns per-token log-probs
(and entropies) of the responses, runs a mini-batch of micro-batches through the worker's loss
function (`train_step`), and steps the optimizer. The RL loss is built by the worker from
`mindspeed_rl.algorithms`.

Its memory and compute rules:

* Log-probs never materialize [rows, tokens, vocab] in fp32: the LM head runs a chunk of response
  tokens at a time (`log_probs.py`).
* Mixed precision by the book: `dtype` is the compute dtype. A trained engine keeps fp32 master
  weights and fp32 AdamW state and runs forward/backward under `torch.autocast(dtype)`; an
  inference-only engine (reference, reader) holds its parameters in `dtype`. Exports are cast to
  `dtype` (what rollout engines and readers hold).
* Optional token budget (`TrainSpec.max_tokens_per_micro_batch`): rows are sorted by length and
  split into sub-batches of at most that many padded tokens, so short rows are not padded to the
  longest one of their micro-batch (verl's `use_dynamic_bsz`). Results come back in the original
  order and the loss sees exactly the micro-batch it would have seen unsplit.
* Optional activation checkpointing (`TrainSpec.gradient_checkpointing`): transformers'
  `gradient_checkpointing_enable(use_reentrant=False)`; each decoder layer of a training forward
  keeps its input only and recomputes the rest in the backward. Inference runs under no_grad in
  eval mode, where it does nothing.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Iterable, Iterator, Sequence

import torch

from ...algorithms import last_token_scores
from ...algorithms.metrics import merge_metrics
from ..base import (Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, OptimConfig, TrainEngine, TrainSpec,
                   cast_buckets, flatten_parameters, hf_named_weights, load_named)
from ..batching import SequenceBatch, collate, forward_groups, join_groups, right_pad, unpad_rows
from .log_probs import head_log_probs, logits_log_probs
from .offload import is_fsdp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------- the model's side
class ResponseStates(torch.nn.Module):
    """The backbone of an HF model up to its final norm, sliced to the positions that predict the
    response tokens (P-1 .. P+R-2): [B, R, H]. A module so that DDP can wrap it: DDP must run the
    forward that uses the parameters, and the heads (`lm_head`, a critic's `score`) are then
    applied by hand outside it (their gradients still reach DDP's hooks in the same backward)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, prompt_width: int, width: int) -> torch.Tensor:
        return backbone_states(self.lm, input_ids, attention_mask, position_ids, prompt_width, width)


def backbone_states(lm: torch.nn.Module, input_ids, attention_mask, position_ids, prompt_width: int,
                    width: int) -> torch.Tensor:
    base = getattr(lm, lm.base_model_prefix)
    h = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
             use_cache=False).last_hidden_state
    return h[:, prompt_width - 1:prompt_width + width - 1]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside DDP and/or `ResponseStates`."""
    from torch.nn.parallel import DistributedDataParallel
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return model.lm if isinstance(model, ResponseStates) else model


def response_states(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Final hidden states [B, R, H] where each response token is predicted (an HF model, or DDP
    around `ResponseStates`)."""
    p, r = batch.prompt_width, batch.responses.shape[1]
    inner = getattr(model, "module", None)
    if isinstance(model, ResponseStates) or isinstance(inner, ResponseStates):
        return model(batch.input_ids, batch.attention_mask, batch.position_ids, p, r)
    return backbone_states(model, batch.input_ids, batch.attention_mask, batch.position_ids, p, r)


def predicting(batch: SequenceBatch) -> torch.Tensor:
    """The positions whose logits predict the response tokens (P-1 .. P+R-2), as the index tensor an HF
    forward's `logits_to_keep` takes: the head then reads a gathered [B, R, H] copy. A count instead
    (`logits_to_keep=R + 1`) hands it a strided slice, which torch's CPU matmul multiplies by copying
    the head's weight once per row (15x slower for 16 rows in bf16 here)."""
    p, r = batch.prompt_width, batch.responses.shape[1]
    return torch.arange(p - 1, p + r - 1, device=batch.input_ids.device)


def response_log_probs(model: torch.nn.Module, batch: SequenceBatch, temperature: float,
                       with_entropy: bool = False, chunk_tokens: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, R] of the responses (and entropies), fp32, with grad when enabled;
    0 at padding. The head runs on real response positions only, chunked (`head_log_probs`).

    `model`: an HF causal LM, DDP around `ResponseStates`, or an FSDP2 root (whose root
    parameters, the head's included, are gathered only inside its own forward: there the head runs
    in the forward on the R response positions via `logits_to_keep`, and the fp32 softmax is
    chunked by `logits_log_probs`)."""
    if is_fsdp(model):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False, logits_to_keep=predicting(batch))
        return logits_log_probs(out.logits, batch.responses, temperature, with_entropy,
                                mask=batch.response_mask, chunk_tokens=chunk_tokens)
    head = unwrap(model).get_output_embeddings()
    return head_log_probs(response_states(model, batch), head.weight, head.bias, batch.responses, temperature,
                          with_entropy, mask=batch.response_mask, chunk_tokens=chunk_tokens)


def response_logits(model: torch.nn.Module, batch: SequenceBatch, temperature: float) -> torch.Tensor:
    """fp32 logits [B, R, V] that predict each response token: positions P-1 .. P+R-2. Kept for
    callers that need the logits themselves; the head runs on those R positions only
    (`logits_to_keep`), not over the prompt. For log-probs use `response_log_probs`: no [B, R, V]
    fp32 tensor."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False, logits_to_keep=predicting(batch))
    logits = out.logits.float()
    return logits / temperature if temperature not in (0, 1.0) else logits


def _value_head(lm: torch.nn.Module):
    head = getattr(lm, "score", None) or getattr(lm, "classifier")
    drop = getattr(lm, "dropout", None)
    return (lambda h: head(drop(h))) if drop is not None else head


def response_values(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """A critic's value of each response token's state: positions P-1 .. P+R-2, as the logits above.

    V_t is read where the model has seen the prompt and the response up to token t-1, the state in
    which token t is chosen (verl's `values[:, -response_length - 1:-1]`). The 1-wide head runs on
    those positions only (an FSDP2 root: inside its forward, over all positions)."""
    p, r = batch.prompt_width, batch.responses.shape[1]
    if is_fsdp(model):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        return out.logits[:, p - 1:p + r - 1, 0].float()
    return _value_head(unwrap(model))(response_states(model, batch).contiguous())[..., 0].float()


def _sequence_states(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] at every position of the sequences (an HF model, or DDP around
    `ResponseStates`, asked for the T positions from the first)."""
    width = batch.input_ids.shape[1]
    inner = getattr(model, "module", None)
    if isinstance(model, ResponseStates) or isinstance(inner, ResponseStates):
        return model(batch.input_ids, batch.attention_mask, batch.position_ids, 1, width)
    return backbone_states(model, batch.input_ids, batch.attention_mask, batch.position_ids, 1, width)


def sequence_scores(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """A reward model's score of each row [B], fp32: its one-label head at the row's last real token.

    The head runs at every position and `algorithms.last_token_scores` reads it where the attention
    mask last says 1, so a row scores the same with its prompt left-padded and its response
    right-padded as alone (HF's own pooling looks for the last token that is not the pad id instead,
    which a response that holds the pad token fools). An FSDP2 root, whose head's parameters are
    gathered only in its own forward, runs that forward and hands the head's per-position output over
    through a hook."""
    if is_fsdp(model):
        head = getattr(model, "score", None) or getattr(model, "classifier")
        seen: list[torch.Tensor] = []
        hook = head.register_forward_hook(lambda _m, _i, out: seen.append(out))
        try:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False)
        finally:
            hook.remove()
        token = seen[-1][..., 0]
    else:
        token = _value_head(unwrap(model))(_sequence_states(model, batch).contiguous())[..., 0]
    return last_token_scores(token.float(), batch.attention_mask)


def pair_rows(data: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A reward model's training micro-batch (columns `prompts`, `chosen`, `rejected`) as 2B rows of one
    forward: every prompt with its chosen response, then every prompt with its rejected one; the loss
    reads `ModelOutput.scores[:B]` as chosen and `[B:]` as rejected."""
    prompts = list(data["prompts"])
    return prompts + prompts, list(data["chosen"]) + list(data["rejected"])


MODEL_KINDS = ("causal_lm", "value", "reward")


def load_model(spec: TrainSpec, stored: str) -> torch.nn.Module:
    """The HF model of `spec.model_kind`, parameters in `stored`: a causal LM (policy, reference), a critic
    (the checkpoint with a fresh one-output token head), or a reward model (a one-label sequence
    classifier; to train one, a causal LM's backbone gets a fresh head)."""
    from ...models import load_causal_lm, load_value_model
    from ...models.reward import init_reward_model, load_reward_model
    if spec.model_kind not in MODEL_KINDS:
        raise ValueError(f"model_kind={spec.model_kind!r}: expected one of {list(MODEL_KINDS)}")
    if spec.model_kind == "reward":
        load = init_reward_model if spec.optim is not None else load_reward_model
        return load(spec.model_path, stored, pad_token_id=spec.pad_token_id)
    model = (load_value_model if spec.model_kind == "value" else load_causal_lm)(spec.model_path, stored)
    if torch.device(spec.device).type == "cpu":   # short 16-bit attention as matmuls (models/cpu_attention.py)
        from ...models.cpu_attention import use_cpu_attention
        use_cpu_attention(model)
    return model


def compute_dtype_of(dtype, model: torch.nn.Module) -> torch.dtype:
    """`dtype` as a torch dtype (a name or a dtype); None: the dtype the model's parameters have."""
    if dtype is None:
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to `dtype`, buffers untouched (RoPE's `inv_freq` stays fp32)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def adamw_kernel(device: torch.device | str) -> dict:
    """AdamW's implementation on `device`: CUDA's fused kernel (one launch for every parameter's update, where
    the default `foreach` path issues several per parameter group), the multi-tensor `foreach` elsewhere."""
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}


def check_token_budget(budget: int | None) -> int | None:
    """`max_tokens_per_micro_batch` as an int, None when off (None or 0)."""
    if budget is None or budget == 0:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch={budget!r}: an integer >= 1 (or unset)")
    return budget


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant: the reentrant
    variant drops the gradients of a layer none of whose inputs require grad, and DDP's reducer
    refuses its second pass over the parameters. It acts in training mode only, so inference
    passes are unchanged."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support activation "
                         "checkpointing (transformers' supports_gradient_checkpointing is false); turn it off")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class TorchTrainEngine(TrainEngine):
    """`dtype`: the compute dtype (None: the model's). `max_tokens_per_micro_batch`: padded tokens per
    forward (None/0: off, each micro-batch is one forward as given). `gradient_checkpointing`: recompute
    each decoder layer in the backward of a trained model."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, optim: OptimConfig | None = None,
                 temperature: float = 1.0, device: torch.device | str = "cpu", process_group=None,
                 model_kind: str = "causal_lm", dtype: torch.dtype | str | None = None,
                 max_tokens_per_micro_batch: int | None = None, gradient_checkpointing: bool = False,
                 lora: dict | None = None):
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype_of(dtype, model)
        # LoRA (engines/train/lora.py): the base frozen in `dtype`, fp32 adapters the only masters
        self.lora = None
        if lora:
            from .lora import apply_lora
            self.lora = apply_lora(model, lora, self.compute_dtype)
        else:
            # a trained model keeps fp32 master weights (and so fp32 AdamW state) and computes in
            # `dtype` under autocast; an inference-only one holds `dtype` itself
            cast_parameters(model, torch.float32 if optim is not None else self.compute_dtype)
        self.model = model.to(self.device)
        self.module = model  # the bare model, also when wrapped in DDP
        # parameters in one buffer, in HF order (before DDP and the optimizer see them): weight sync
        # sends each bucket as one broadcast straight from it, and an inference copy receives into
        # it the same way. Checkpoints are torch.save of the state dict, which views do not hurt.
        # A LoRA engine sends merged transients instead: nothing to lay out.
        if self.lora is None:
            flatten_parameters(self.module)
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.model_kind = model_kind
        self.max_tokens = check_token_budget(max_tokens_per_micro_batch)
        self.optim_config = optim
        self.optimizer = None
        self.process_group = process_group
        self.version = 0
        if optim is not None:
            self.model.train()
            if gradient_checkpointing:   # before DDP: the layers it reaches are the model's own
                enable_gradient_checkpointing(self.module)
            if process_group is not None:
                from torch.nn.parallel import DistributedDataParallel
                self.model = DistributedDataParallel(ResponseStates(self.module), process_group=process_group)
            # only what trains has AdamW state: with LoRA, the adapters and the modules trained whole
            from .lora import trained_groups
            self.optimizer = torch.optim.AdamW(trained_groups(self.module, lora, optim.lr), betas=optim.betas,
                                               eps=optim.eps,
                                               weight_decay=optim.weight_decay, **adamw_kernel(self.device))
        else:
            self.module.eval()
            for p in self.module.parameters():
                p.requires_grad_(False)

    @classmethod
    def build(cls, spec: TrainSpec) -> "TorchTrainEngine":
        if spec.options:
            raise ValueError(f"torch backend options {sorted(spec.options)}: the torch backend takes none")
        torch.manual_seed(spec.seed)  # a value head is initialized from it
        # fp32 masters for a trained model; a LoRA base stays in `dtype` (its adapters are the masters)
        stored = "float32" if spec.optim is not None and not spec.lora else spec.dtype
        engine = cls(load_model(spec, stored), spec.pad_token_id, spec.optim, temperature=spec.temperature,
                     device=spec.device, process_group=spec.process_group if spec.optim is not None else None,
                     model_kind=spec.model_kind, dtype=spec.dtype,
                     max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
                     gradient_checkpointing=spec.gradient_checkpointing, lora=spec.lora)
        # between stages (engines/train/offload.py): the parameters and AdamW state wait on the host
        from .offload import OffloadOptions, Offloader
        engine.offloader = Offloader.for_engine(OffloadOptions.of(spec.offload, "torch"), lambda: engine.model,
                                                lambda: engine.optimizer, engine.device)
        return engine

    def autocast(self):
        """Forward (and so backward) in the compute dtype when it is not the parameters' own (a LoRA
        model's fp32 adapters compute in it too)."""
        held = torch.float32 if self.lora is not None else next(self.module.parameters()).dtype
        if self.compute_dtype == held:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def batch(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> SequenceBatch:
        b = collate(prompts, responses, self.pad_token_id)
        if self.device.type != "cpu":
            b = SequenceBatch(*(x.to(self.device) if torch.is_tensor(x) else x for x in
                                (b.input_ids, b.attention_mask, b.position_ids, b.responses, b.response_mask)),
                              prompt_width=b.prompt_width)
        return b

    def forward(self, batch: SequenceBatch, with_entropy: bool = False):
        """Per-token log-probs [B, R] (and entropies) of the responses, with grad when training."""
        with self.autocast():
            return response_log_probs(self.model, batch, self.temperature, with_entropy)

    def model_output(self, batch: SequenceBatch) -> ModelOutput:
        """What a loss function sees: log-probs and entropies of a causal LM, values of a value model, one
        score per row of a reward model."""
        if self.model_kind == "reward":
            with self.autocast():
                return ModelOutput(response_mask=batch.response_mask, scores=sequence_scores(self.model, batch))
        if self.model_kind == "value":
            with self.autocast():
                return ModelOutput(response_mask=batch.response_mask, values=response_values(self.model, batch))
        logp, entropy = self.forward(batch, with_entropy=True)
        return ModelOutput(response_mask=batch.response_mask, log_probs=logp, entropy=entropy)

    # ---- token budget
    def groups(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
               micro_batch_size: int) -> list[list[int]]:
        """Row indexes of each forward: `micro_batch_size` rows in order without a token budget;
        with one, length-sorted groups of at most `max_tokens_per_micro_batch` padded tokens."""
        return forward_groups(prompts, responses, micro_batch_size, self.max_tokens)

    def split_output(self, prompts, responses) -> ModelOutput:
        """`model_output` of the rows as one micro-batch, computed in token-budget groups: each group
        is its own (less padded) forward, and the [B, R] outputs are put back in row order with the
        micro-batch's own response mask, so a loss function sees exactly what the unsplit forward
        gives it (0 at padding, as there) whatever its aggregation (token-mean, seq-mean, ...)."""
        groups = self.groups(prompts, responses, len(prompts))
        if len(groups) == 1:
            return self.model_output(self.batch(prompts, responses))
        mask = right_pad(responses, self.pad_token_id)[1].to(self.device)
        outs = [self.model_output(self.batch([prompts[i] for i in g], [responses[i] for i in g])) for g in groups]
        return join_groups(groups, outs, mask)

    # ---- inference
    def adapters_in_use(self):
        """Held around the policy's forwards (and backwards): a LoRA reference pass, which turns the
        adapters off model-wide, waits for it (engines/train/lora.py); nothing without LoRA."""
        return self.lora.in_use() if self.lora is not None else contextlib.nullcontext()

    def _infer(self, prompts, responses, micro_batch_size: int, fn) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for g in self.groups(prompts, responses, micro_batch_size):
            b = self.batch([prompts[i] for i in g], [responses[i] for i in g])
            with self.autocast(), self.adapters_in_use():
                vals = fn(b)
            for i, r in zip(g, unpad_rows(vals, b.response_mask)):
                out[i] = r.cpu()
        return out

    @torch.no_grad()
    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """Inference: per-token log-probs, one 1-D tensor per row, micro-batch by micro-batch (or by
        token budget)."""
        return self._infer(prompts, responses, micro_batch_size,
                           lambda b: response_log_probs(self.module, b, self.temperature)[0])

    @torch.no_grad()
    def values(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """Inference of a critic: per-token values, one 1-D tensor per row."""
        return self._infer(prompts, responses, micro_batch_size, lambda b: response_values(self.module, b))

    @torch.no_grad()
    def scores(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """Inference of a reward model: one score per row (a [1] float32 tensor), at its last token."""
        if self.model_kind != "reward":
            raise NotImplementedError(f"{type(self).__name__} holds no reward model (model_kind={self.model_kind})")
        out: list[torch.Tensor | None] = [None] * len(prompts)
        for g in self.groups(prompts, responses, micro_batch_size):
            b = self.batch([prompts[i] for i in g], [responses[i] for i in g])
            with self.autocast():
                vals = sequence_scores(self.module, b)
            for i, v in zip(g, vals):
                out[i] = v.reshape(1).float().cpu()
        return out

    def train_output(self, data: dict) -> ModelOutput:
        """The model's output on a training micro-batch: a reward model's over its pairs (`pair_rows`),
        else over (prompts, responses), split by the token budget when there is one."""
        if self.model_kind == "reward":
            return self.model_output(self.batch(*pair_rows(data)))
        if self.max_tokens is None:
            return self.model_output(self.batch(data["prompts"], data["responses"]))
        return self.split_output(data["prompts"], data["responses"])

    def no_sync(self, sync: bool):
        """DDP all-reduces only on the last micro-batch of an update (gradient accumulation)."""
        if sync or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def train_step(self, micro_batches: Iterable[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without OptimConfig)")
        metrics: dict[str, float] = {}
        count = 0
        for mb in micro_batches:
            with self.no_sync(mb.last), self.adapters_in_use():
                loss, m = loss_fn(self.train_output(mb.data), mb)
                (loss * mb.loss_scale).backward()
            merge_metrics(metrics, m)  # _max maxed, _min minned, the rest summed
            count += 1
        metrics["micro_batches"] = float(count)
        metrics.update(self.optimizer_step())
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on an inference-only engine (built without OptimConfig)")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.optim_config.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(grad_norm)}

    def parameters(self) -> list[torch.Tensor]:
        return [p.data for _, p in self.module.named_parameters()]

    # ---- weights
    def export_weights(self, bucket_bytes: int, adapters: bool = True) -> Iterator[Bucket]:
        """Buckets in the compute dtype (what readers hold): fp32 masters are cast a bucket at a
        time, each bucket into one buffer laid out as on the wire (still one broadcast). A LoRA model
        exports its merged weights under the base's HF names, made a bucket at a time
        (`adapters=False`: the base alone, what the LoRA reference runs)."""
        if self.lora is not None:
            from .lora import merged_buckets
            return merged_buckets(self.module, self.compute_dtype, bucket_bytes, adapters)
        return cast_buckets(hf_named_weights(self.module), self.compute_dtype, bucket_bytes)

    def ipc_shareable_module(self) -> torch.nn.Module:
        """The module whose own (unsharded) parameters `export_weights` hands out, so colocated IPC
        weight sync may share their memory with readers instead of packing a copy
        (`ipc_sender.IPCSender.adopt`; sharded engines, which export gathered transients, lack this).
        None with LoRA: its exports are merged transients too."""
        return self.module if self.lora is None else None

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        load_named(self.module, named_tensors)
        self.version = int(version)

    def state_checksum(self) -> str:
        """Of the weights as exported (in the compute dtype): what a reader holds and compares."""
        from ..sync.weight_sync import Checksum
        digest = Checksum()
        for bucket in self.export_weights(64 << 20):
            digest.update(bucket)
        return digest.hexdigest()

    def receive_targets(self) -> dict[str, torch.Tensor] | None:
        """An inference copy's parameters by HF name (tied ones under each name); None for a trained
        engine, which is never a reader: its parameters belong to its optimizer and DDP."""
        if self.optimizer is not None:
            return None
        return {n: p.detach() for n, p in self.module.named_parameters(remove_duplicate=False)}

    # ---- checkpoints
    def state_dict(self) -> dict:
        """With LoRA the model's part is the adapters alone: the base is the checkpoint it loads from."""
        from .lora import adapter_state
        model = adapter_state(self.module) if self.lora is not None else self.module.state_dict()
        return {"model": model, "version": self.version,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None}

    def load_state_dict(self, state: dict) -> None:
        if self.lora is not None:
            from .lora import load_adapter_state
            load_adapter_state(self.module, state["model"])
        else:
            self.module.load_state_dict(state["model"])
        self.version = int(state["version"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            # a copy: torch keeps the given moment tensors, so two engines would share them
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))

    def _rank(self) -> int:
        if self.process_group is None:
            return 0
        import torch.distributed as dist
        return dist.get_rank(self.process_group)

    def save_checkpoint(self, directory: str) -> list[str]:
        """DDP ranks hold the same state: rank 0 writes `engine.pt` (atomically)."""
        if self._rank() != 0:
            return []
        os.makedirs(directory, exist_ok=True)
        from ...models.files import save_file  # a full disk names the file and leaves no .tmp
        return [save_file(self.state_dict(), os.path.join(directory, "engine.pt"))]

    def load_checkpoint(self, directory: str) -> None:
        from ...models.files import load_file  # a damaged or missing file is named, with the fix
        state = load_file(os.path.join(directory, "engine.pt"), map_location=self.device, what="engine state")
        try:
            self.load_state_dict(state)
        except RuntimeError as e:  # e.g. a checkpoint of another model size: not a size-mismatch dump
            first = str(e).strip().splitlines()[0][:300]
            raise RuntimeError(f"engine state {os.path.join(directory, 'engine.pt')} does not fit this model "
                               f"({first}); resume with the model it was saved with") from None
