"""Decode attention for grouped-query models without copying K/V per query head.

Given a mask, transformers' SDPA path repeats every layer's K/V once per query head of a group
(`repeat_kv`) before attending: for Qwen2.5's 7:1 grouping a decode step copies the whole cache seven
times per layer. One query token needs no copy: a group's query heads become the query positions of
their shared K/V head ([B, H, 1, D] -> [B, H_kv, H / H_kv, D]), which SDPA attends with the same mask
(it broadcasts over them) in one call per layer. Query head h reads K/V head h // (H / H_kv), as
`repeat_kv` lays them out, so the result is the same attention. A prefill (more than one query token)
goes to transformers' SDPA as before.

`use_gqa_decode(model)` registers the function under `ATTENTION` with transformers' attention and mask
interfaces and switches the model to it (a model with no grouping keeps its attention).
"""
from __future__ import annotations

import torch

ATTENTION = "mindspeed_gqa_decode"


def gqa_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, Q, D], key/value [B, H_kv, W, D], an additive or
    boolean mask broadcastable to [B, 1, Q, W]; returns ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, Q, D = query.shape
    kv_heads = key.shape[1]
    if Q != 1 or H == kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    mask = attention_mask[:, :, :, : key.shape[2]] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, kv_heads, H // kv_heads, D), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        is_causal=False)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def use_gqa_decode(model: torch.nn.Module) -> bool:
    """Switch a grouped-query HF model's attention to `gqa_decode_attention`; False (unchanged) for a model
    whose query and K/V heads are as many, or whose attention transformers cannot switch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if kv_heads == heads or not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    AttentionInterface.register(ATTENTION, gqa_decode_attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTENTION)
    return True
