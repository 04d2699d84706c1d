"""models/cpu_attention.py: on the CPU in 16 bits, short attention as matmuls equals transformers' SDPA (causal,
a padding mask in either form, grouped K/V heads, gradients); fp32, long or off-CPU calls are SDPA's own."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.cpu_attention import SHORT_KV, cpu_attention, use_cpu_attention


def _qkv(q_len: int, k_len: int, dtype=torch.bfloat16, heads=6, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, heads, q_len, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(3, kv_heads, k_len, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(3, kv_heads, k_len, 16, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _module(groups: int):
    m = torch.nn.Module()
    m.num_key_value_groups, m.is_causal = groups, True
    return m


def _sdpa(module, q, k, v, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0]


def _padding(k_len: int, q_len: int):
    seen = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None].repeat(3, 1, 1, 1)
    seen[0, :, :, :2] = False   # row 0 is left-padded by two
    seen[0, :, :2, :2] |= torch.eye(2, dtype=torch.bool)   # a padded query sees itself (no empty row)
    return seen


@pytest.mark.parametrize("form", ["causal", "bool", "additive", "decode"])
def test_matmul_attention_equals_sdpa_in_bf16_with_gradients(form):
    q_len = 1 if form == "decode" else 12
    q, k, v = _qkv(q_len, 12)
    mask = None if form in ("causal", "decode") else _padding(12, q_len)
    if form == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill_(~mask, torch.finfo(torch.bfloat16).min)
    got = cpu_attention(_module(3), q, k, v, mask, scaling=0.25)[0]
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = _sdpa(_module(3), *ref_in, mask)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
    (got * w).sum().backward()
    (want * w).sum().backward()
    for a, b in zip((q, k, v), ref_in):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0, atol=5e-2)


@pytest.mark.parametrize("dtype,k_len", [(torch.float32, 12), (torch.bfloat16, SHORT_KV + 1)])
def test_fp32_and_long_calls_are_sdpas_own(dtype, k_len):
    q, k, v = _qkv(k_len, k_len, dtype)
    got = cpu_attention(_module(3), q, k, v, None, scaling=0.25)[0]
    assert torch.equal(got, _sdpa(_module(3), q, k, v, None))


def test_a_cpu_model_switches_and_gives_sdpas_logits_in_fp32():
    from mindspeed_rl.models import load_causal_lm
    sdpa = load_causal_lm("builtin:tiny-qwen2")
    mine = load_causal_lm("builtin:tiny-qwen2")
    assert use_cpu_attention(mine) and mine.config._attn_implementation == "mindspeed_cpu_attention"
    ids = torch.randint(3, mine.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(mine(input_ids=ids).logits, sdpa(input_ids=ids).logits)   # fp32: SDPA's own path
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(mine(input_ids=ids).logits.float(), sdpa(input_ids=ids).logits.float(),
                                       rtol=0, atol=5e-2)
