"""Attention on the CPU in 16 bits: plain matmuls and a softmax for short sequences, SDPA otherwise.

torch's fused SDPA kernel for the CPU is slow in bf16 at the lengths an RL step on the CPU has (a few dozen to a
hundred tokens): its backward took 25 ms per SmolLM2 layer for 16 rows x 74 tokens, six times its forward, and an
update of 16 rows 3.6-4.2 s where the same attention as two matmuls and a softmax takes 3.2 s (2 cores, bf16
autocast); a decode of 64 rows 7.3 s against 6.3 s. The matmul form holds the [rows, heads, queries, keys]
probabilities for the backward, which grows with the square of the length, so it is used only up to
`SHORT_KV` keys, on the CPU, in 16 bits; every other call (fp32, longer, any accelerator) goes to transformers'
SDPA as before. The same attention either way: causal (or the given mask), grouped K/V heads repeated,
softmax in fp32.

`use_cpu_attention(model)` registers it with transformers (`ATTENTION`, with SDPA's masks) and switches a model
that will run on the CPU to it.
"""
from __future__ import annotations

import torch

ATTENTION = "mindspeed_cpu_attention"
SHORT_KV = 128   # keys up to which the matmul form runs (planning/memory_terms.py counts its probabilities)


def cpu_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, Q, D], key/value [B, H_kv, K, D], SDPA's mask (None:
    causal, boolean: True where a query sees a key, or additive); returns ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    B, H, Q, D = query.shape
    K = key.shape[2]
    if query.device.type != "cpu" or query.dtype == torch.float32 or K > SHORT_KV:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = H // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else D ** -0.5)
    low = torch.finfo(scores.dtype).min
    if attention_mask is None:
        if Q > 1:   # causal: query i sees keys up to K - Q + i
            seen = torch.ones(Q, K, dtype=torch.bool, device=query.device).tril(K - Q)
            scores = scores.masked_fill(~seen, low)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[:, :, :, :K], low)
    else:
        scores = scores + attention_mask[:, :, :, :K]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def use_cpu_attention(model: torch.nn.Module) -> bool:
    """Switch an HF model that runs on the CPU to `cpu_attention`; False (unchanged) where transformers cannot
    switch its attention, or it is not SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not model._can_set_attn_implementation():
        return False
    AttentionInterface.register(ATTENTION, cpu_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTENTION)
    return True
