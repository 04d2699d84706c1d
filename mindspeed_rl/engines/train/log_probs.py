"""Per-token log-probs (and entropies) of response tokens, computed a chunk of tokens at a time.

Log-probs never materialize [rows, tokens, vocab] in fp32. The backbone gives hidden states; the LM
head runs only at the positions that predict a real response token (not the prompt, not the right
padding), a chunk of tokens at a time: head matmul in the compute dtype, then fp32
log-softmax/entropy of that chunk only (`head_log_probs`). With gradients and more than one chunk,
each chunk is checkpointed, so the backward recomputes its logits instead of keeping every chunk's
alive: peak memory is one chunk of fp32 logits, not vocab x length.

`head_log_probs` runs the LM head itself (every engine whose backbone gives hidden states);
`logits_log_probs` takes logits a model already computed in its compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...algorithms import entropy_from_logits, log_probs_from_logits

# fp32 logits of one chunk of tokens: the most `head_log_probs` holds at once. On the CPU 128 MiB (Qwen2.5's
# 151,936-token vocabulary: 220 tokens a chunk); on an accelerator 1 GiB (1,766 tokens): a 220-token chunk's
# head matmul is too small to run at a card's speed, and each chunk costs its own launches and recompute
LOGITS_CHUNK_BYTES = 128 << 20
ACCELERATOR_LOGITS_CHUNK_BYTES = 1 << 30


def logits_chunk_bytes(device: torch.device | str) -> int:
    """The fp32 logits one chunk may hold on `device` (the CPU: LOGITS_CHUNK_BYTES; else the accelerators')."""
    return LOGITS_CHUNK_BYTES if torch.device(device).type == "cpu" else ACCELERATOR_LOGITS_CHUNK_BYTES


def chunk_tokens_for(vocab: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * int(vocab)))


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-prob of each label (and entropy) from one chunk's logits [n, V] in any dtype.

    The cast to fp32 happens here, on the chunk: the vocabulary's softmax needs fp32 (bf16 keeps 8
    bits of mantissa), but only of the tokens at hand."""
    z = logits.float()
    if temperature not in (0, 1.0):
        z = z / temperature
    return log_probs_from_logits(z, labels), (entropy_from_logits(z) if with_entropy else None)


def _head_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                temperature: float, with_entropy: bool):
    """One chunk: the LM head in the compute dtype (autocast decides), then `token_log_probs`."""
    return token_log_probs(F.linear(hidden, weight, bias), labels, temperature, with_entropy)


class _CastHead(torch.autograd.Function):
    """`F.linear` with the head's weight (and bias) already cast to the compute dtype (`low`, `low_bias`), its
    gradients returned to the fp32 masters (`weight`, `bias`) in fp32. Each chunk's gradient is the matmul autocast
    would run (compute dtype) taken to fp32, and the chunks add up in fp32 on the master: autocast's one cached cast
    would sum them in the compute dtype first. The cast is not repeated by each checkpointed recompute."""

    @staticmethod
    def forward(ctx, hidden, weight, low, bias, low_bias):
        x = hidden.to(low.dtype)
        ctx.save_for_backward(x, low)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(x, low, low_bias)

    @staticmethod
    def backward(ctx, grad):
        x, low = ctx.saved_tensors
        grad = grad.to(low.dtype)
        g_hidden = (grad @ low).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        g_weight = (grad.t() @ x).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        g_bias = grad.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[3] else None
        return g_hidden, g_weight, None, g_bias, None


def _cast_head_chunk(hidden: torch.Tensor, weight: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None,
                     low_bias: torch.Tensor | None, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """One chunk of `head_log_probs` under autocast, the head's weight cast once for all chunks (`_CastHead`)."""
    return token_log_probs(_CastHead.apply(hidden, weight, low, bias, low_bias), labels, temperature, with_entropy)


def _autocast_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast `weight` to in a matmul here, None if it would not cast it (autocast off, the
    weight already in it, or a DTensor, whose sharded head the mesh engine leaves to autocast)."""
    kind = weight.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    from torch.distributed.tensor import DTensor
    return None if weight.dtype == dtype or isinstance(weight, DTensor) else dtype


def _logits_chunk(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    return token_log_probs(logits, labels, temperature, with_entropy)


def _chunked(fn, inputs: torch.Tensor, labels: torch.Tensor, consts: tuple, n: int, mask: torch.Tensor | None,
             with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `fn(inputs[chunk], *consts[:-2], labels[chunk], *consts[-2:])` over chunks of `n` tokens of
    the [B, R, ...] `inputs`, only where `mask` is set, and scatter the results back to [B, R]
    (0 elsewhere). With gradients and more than one chunk each chunk is checkpointed: its logits are
    freed after the forward and recomputed in the backward, so the graph holds no vocab-sized
    tensor (one chunk alone is bounded by `n` already and keeps its graph: no recompute)."""
    B, R = labels.shape
    flat = inputs.reshape(B * R, *inputs.shape[2:])
    lab = labels.reshape(-1)
    idx = None
    if mask is not None:
        idx = mask.reshape(-1).nonzero().squeeze(-1)
        flat, lab = flat[idx], lab[idx]
    total = flat.shape[0]
    grad = torch.is_grad_enabled() and (inputs.requires_grad or any(
        torch.is_tensor(c) and c.requires_grad for c in consts))
    ckpt = grad and total > n
    head, tail = consts[:-2], consts[-2:]
    logps, ents = [], []
    for s in range(0, max(total, 1), n):   # at least once: an empty selection still gives [0] with grad
        args = (flat[s:s + n], *head, lab[s:s + n], *tail)
        lp, ent = checkpoint(fn, *args, use_reentrant=False) if ckpt else fn(*args)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)
    ent = torch.cat(ents) if with_entropy else None
    if idx is not None:
        logp = logp.new_zeros(B * R).index_copy(0, idx, logp)
        ent = ent.new_zeros(B * R).index_copy(0, idx, ent) if ent is not None else None
    return logp.view(B, R), (ent.view(B, R) if ent is not None else None)


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, mask: torch.Tensor | None = None,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of `labels` (and entropies) from final hidden states [B, R, H] and the LM
    head's `weight` [V, H] (and `bias`), a chunk of tokens at a time; `mask` [B, R] (the response
    mask) skips padding: its positions get 0. Equals `log_softmax(lm_head(hidden).float())` gathered
    at the labels within float tolerance, gradients included, without its [B, R, V] fp32 tensor."""
    n = chunk_tokens or chunk_tokens_for(weight.shape[0], logits_chunk_bytes(weight.device))
    low = _autocast_dtype(weight)
    if low is None:
        return _chunked(_head_chunk, hidden, labels, (weight, bias, temperature, with_entropy), n, mask, with_entropy)
    # under autocast each chunk (and each checkpointed recompute) would cast the fp32 master again: once here
    low_bias = bias.detach().to(low) if bias is not None else None
    return _chunked(_cast_head_chunk, hidden, labels, (weight, weight.detach().to(low), bias, low_bias, temperature,
                                                       with_entropy), n, mask, with_entropy)


def logits_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, mask: torch.Tensor | None = None,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `head_log_probs` for logits a model already computed [B, R, V] (in its compute dtype: an
    FSDP root whose head must run inside its forward): the fp32 cast and the softmax go a chunk at a
    time, so only one chunk is ever fp32."""
    n = chunk_tokens or chunk_tokens_for(logits.shape[-1], logits_chunk_bytes(logits.device))
    return _chunked(_logits_chunk, logits, labels, (temperature, with_entropy), n, mask, with_entropy)
