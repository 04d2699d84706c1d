"""The megatron backend's CPU-checkable parts: HF Qwen2 <-> megatron-core conversion (names, fused QKV
layout, gated MLP, TP shards, PP stages), a decoder layer and a whole model computed in plain torch
from the megatron-layout tensors against HF's modules, the right-padded batch layout, and the
vocab-parallel log-softmax (one rank, and two gloo ranks with gradients).

The engine itself needs CUDA (mindspeed_rl/engines/train/megatron/engine.py says so); here it is only
checked to refuse the CPU clearly (test_megatron_engine.py runs it where a GPU and megatron-core are). Where megatron-core imports (not in CI), one more test builds its
real GPTModel on two gloo ranks (TP=2) from the converted weights and compares logits with HF's.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from mindspeed_rl.engines.train.megatron import convert as C
from mindspeed_rl.engines.train.megatron.tensors import right_padded, vocab_parallel_log_probs

from . import _mp_workers as W
from ._common import TINY_CONFIG

TIMEOUT_S = 180


def qwen2(seed: int = 0, **overrides):
    """A Qwen2 with every weight random (biases and norms too, so a swapped tensor shows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**{**TINY_CONFIG, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
    return model


TIED = {}                                                       # tiny: 2 heads, 1 KV head, tied, 2 layers
UNTIED = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=False,
              vocab_size=13)                                    # GQA with 2 groups, odd vocab, lm_head of its own
MHA = dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)


def hf_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


# ------------------------------------------------------------------------------------ config
def test_dims_config_and_vocab_padding():
    model = qwen2(**UNTIED)
    d = C.Qwen2Dims.from_hf(model.config)
    assert (d.num_layers, d.hidden_size, d.ffn_hidden_size, d.num_heads, d.num_kv_heads, d.head_dim) == (4, 64, 128, 4, 2, 16)
    assert (d.vocab_size, d.tie_word_embeddings, d.eps, d.rope_theta) == (13, False, 1e-6, 10000.0)
    assert C.Qwen2Dims.from_hf(model.config.to_dict()) == d
    kw = C.transformer_config_kwargs(d, tp=2, pp=2, dtype=torch.bfloat16)
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 16 and kw["normalization"] == "RMSNorm"
    assert kw["gated_linear_unit"] and kw["activation_func"] is F.silu
    assert kw["add_qkv_bias"] and not kw["add_bias_linear"] and kw["layernorm_epsilon"] == 1e-6
    assert kw["bf16"] and kw["pipeline_dtype"] is torch.bfloat16 and kw["hidden_dropout"] == 0.0
    g = C.gpt_model_kwargs(d, tp=2)
    assert g["vocab_size"] == 256 and g["position_embedding_type"] == "rope" and g["rotary_base"] == 10000
    assert not g["share_embeddings_and_output_weights"]
    # Megatron-LM's _vocab_size_with_padding: up to a multiple of divisible_by * tp
    assert C.padded_vocab_size(151936, 128, 1) == 151936 and C.padded_vocab_size(151643, 128, 8) == 152576
    assert C.padded_vocab_size(13, 1, 1) == 13 and C.padded_vocab_size(13, 4, 2) == 16
    with pytest.raises(ValueError, match="rope_type='linear'"):
        C.Qwen2Dims.from_hf({**model.config.to_dict(), "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        C.Qwen2Dims.from_hf({**model.config.to_dict(), "use_sliding_window": True})
    with pytest.raises(ValueError, match="does not split evenly over pp=3"):
        C.transformer_config_kwargs(C.Qwen2Dims.from_hf(qwen2().config), pp=3)


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("overrides", [TIED, UNTIED, MHA], ids=["tied-gqa1", "untied-gqa2", "mha"])
@pytest.mark.parametrize("layer_spec", C.LAYER_SPECS)
def test_hf_megatron_hf_round_trip_is_exact(overrides, layer_spec):
    model = qwen2(**overrides)
    hf = hf_weights(model)
    d = C.Qwen2Dims.from_hf(model.config)
    mc = C.hf_to_mcore(hf, d, layer_spec=layer_spec, padded_vocab=C.padded_vocab_size(d.vocab_size))
    assert mc[C.MC_EMBED].shape[0] == 128 and not mc[C.MC_EMBED][d.vocab_size:].any()
    assert (C.MC_HEAD in mc) == (not d.tie_word_embeddings)
    assert set(mc) == {C.MC_EMBED, C.MC_NORM, *([C.MC_HEAD] if C.MC_HEAD in mc else [])} | {
        f"decoder.layers.{i}.{k}" for i in range(d.num_layers) for k in C.mcore_layer_keys(layer_spec)}
    back = C.mcore_to_hf(mc, d, layer_spec=layer_spec)
    assert list(back) == list(hf)  # HF's named_parameters order, lm_head under its name when tied too
    for n in hf:
        assert torch.equal(back[n], hf[n]), n
    assert list(C.hf_shapes(d).items()) == [(n, tuple(t.shape)) for n, t in hf.items()]


def test_unknown_or_missing_hf_weights_are_named():
    model = qwen2()
    d = C.Qwen2Dims.from_hf(model.config)
    hf = hf_weights(model)
    with pytest.raises(ValueError, match="model.extra.weight"):
        C.hf_to_mcore({**hf, "model.extra.weight": torch.zeros(1)}, d)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.up_proj.weight.*layer 1"):
        C.hf_to_mcore(hf, d)


# ------------------------------------------------------------------- megatron's QKV split, in torch
def megatron_qkv_split(mixed: torch.Tensor, ng: int, per: int, hn: int):
    """megatron-core SelfAttention.get_query_key_value_tensors (attention.py), no output gate:
    [sq, b, ng*(np/ng+2)*hn] -> view [sq, b, ng, (np/ng+2)*hn] -> split [np/ng*hn, hn, hn] on dim 3
    -> query reshaped to [sq, b, np, hn]; key and value are [sq, b, ng, hn]."""
    mixed = mixed.view(*mixed.shape[:-1], ng, (per + 2) * hn)
    q, k, v = torch.split(mixed, [per * hn, hn, hn], dim=3)
    return q.reshape(q.shape[0], q.shape[1], -1, hn), k, v


@pytest.mark.parametrize("overrides", [TIED, UNTIED, MHA], ids=["gqa1", "gqa2", "mha"])
def test_fused_qkv_matches_megatrons_split(overrides):
    model = qwen2(**overrides)
    d = C.Qwen2Dims.from_hf(model.config)
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, 3, d.hidden_size, generator=torch.Generator().manual_seed(1))  # [sq, b, h]
    w = C.qkv_to_mcore(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, d)
    b = C.qkv_to_mcore(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, d)
    with torch.no_grad():
        q, k, v = megatron_qkv_split(F.linear(x, w, b), d.num_kv_heads, d.heads_per_group, d.head_dim)
        hq = attn.q_proj(x).view(5, 3, d.num_heads, d.head_dim)
        hk = attn.k_proj(x).view(5, 3, d.num_kv_heads, d.head_dim)
        hv = attn.v_proj(x).view(5, 3, d.num_kv_heads, d.head_dim)
    torch.testing.assert_close(q, hq, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, hk, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, hv, rtol=0, atol=1e-6)
    # under TP each rank splits its own chunk of rows with ng/tp groups: the heads line up in rank order
    tp = d.num_kv_heads
    if tp > 1:
        parts = [megatron_qkv_split(F.linear(x, C.shard_tensor("x.linear_qkv.weight", w, tp, r),
                                             C.shard_tensor("x.linear_qkv.bias", b, tp, r)).detach(),
                                    d.num_kv_heads // tp, d.heads_per_group, d.head_dim) for r in range(tp)]
        torch.testing.assert_close(torch.cat([p[0] for p in parts], dim=2), hq, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.cat([p[1] for p in parts], dim=2), hk, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------- TP
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_unshard_round_trip(tp):
    model = qwen2(**{**UNTIED, "num_key_value_heads": 4})
    d = C.Qwen2Dims.from_hf(model.config)
    mc = C.hf_to_mcore(hf_weights(model), d, padded_vocab=C.padded_vocab_size(d.vocab_size, 4, tp))
    shards = C.shard_state_dict(mc, tp)
    name = "decoder.layers.0."
    for r, s in enumerate(shards):
        assert s[name + "self_attention.linear_qkv.weight"].shape[0] == mc[name + "self_attention.linear_qkv.weight"].shape[0] // tp
        assert s[name + "self_attention.linear_proj.weight"].shape[1] == d.num_heads * d.head_dim // tp
        assert s[name + "mlp.linear_fc2.weight"].shape[1] == d.ffn_hidden_size // tp
        assert torch.equal(s[name + "input_layernorm.weight"], mc[name + "input_layernorm.weight"])
        gate, up = C.fc1_from_mcore(mc[name + "mlp.linear_fc1.weight"])
        rows = d.ffn_hidden_size // tp  # each rank: [its gate rows; its up rows]
        assert torch.equal(s[name + "mlp.linear_fc1.weight"],
                           torch.cat([gate[r * rows:(r + 1) * rows], up[r * rows:(r + 1) * rows]]))
    back = C.unshard_state_dict(shards)
    assert list(back) == list(mc) and all(torch.equal(back[k], mc[k]) for k in mc)
    with pytest.raises(ValueError, match="does not split over tp=3"):
        C.shard_tensor("decoder.layers.0.mlp.linear_fc2.weight", mc[name + "mlp.linear_fc2.weight"], 3, 0)


# ---------------------------------------------------------------------------------------- PP
def test_pp_layer_ranges_follow_megatron():
    assert [list(C.pp_layer_range(8, 4, s)) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # num_layers_in_first/last_pipeline_stage: the rest split evenly over the middle stages
    assert [list(C.pp_layer_range(10, 4, s, first=1, last=3)) for s in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [list(C.pp_layer_range(7, 3, s, first=3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(C.pp_layer_range(5, 2, s, last=1)) for s in range(2)] == [[0, 1, 2, 3], [4]]
    for g in range(10):
        s, local = C.global_to_stage(g, 10, 4, 1, 3)
        assert C.stage_to_global(s, local, 10, 4, 1, 3) == g
    with pytest.raises(ValueError, match="does not split evenly"):
        C.pp_layer_range(7, 2, 0)
    with pytest.raises(ValueError, match="do not split evenly"):
        C.pp_layer_range(10, 4, 0, first=2, last=3)


@pytest.mark.parametrize("overrides", [TIED, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_rank_weights_are_the_split_and_shard_of_the_whole(overrides, tp, pp):
    model = qwen2(**overrides)
    hf = hf_weights(model)
    d = C.Qwen2Dims.from_hf(model.config)
    whole = C.hf_to_mcore(hf, d, padded_vocab=C.padded_vocab_size(d.vocab_size, 128, tp))
    stages = C.split_pipeline(whole, d, pp)
    if pp > 1:
        assert C.MC_EMBED in stages[0] and C.MC_EMBED not in stages[-1]
        assert C.MC_NORM in stages[-1] and "decoder.layers.0.input_layernorm.weight" in stages[-1]
        assert torch.equal(stages[-1][C.MC_HEAD], whole[C.MC_EMBED] if d.tie_word_embeddings else whole[C.MC_HEAD])
    merged = C.merge_pipeline(stages, d)
    assert set(merged) == set(whole) and all(torch.equal(merged[k], whole[k]) for k in whole)
    for s in range(pp):
        for r in range(tp):
            got = C.hf_to_mcore_rank(hf, d, tp=tp, tp_rank=r, pp=pp, pp_rank=s)
            want = {k: C.shard_tensor(k, t, tp, r) for k, t in stages[s].items()}
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), (s, r)


# ----------------------------------------------- numerics: megatron-layout tensors in plain torch
def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, positions, theta):
    """Non-interleaved RoPE (megatron's rotary_interleaved=False, HF's rotate_half). x: [s, b, n, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb = torch.cat([positions[:, None].float() * inv[None]] * 2, dim=-1)      # [s, hd]
    cos, sin = emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def megatron_layer(x: torch.Tensor, shards: list[dict], d: C.Qwen2Dims, layer_spec: str = C.LOCAL) -> torch.Tensor:
    """One decoder layer from megatron-layout TP shards ([sq, b, h] in and out): fused QKV, megatron's
    split, RoPE, causal GQA attention, row-parallel linear_proj summed over ranks; then fc1 ->
    chunk -> silu(gate) * up -> fc2 summed over ranks."""
    in_norm, mlp_norm = (("input_layernorm.weight", "pre_mlp_layernorm.weight") if layer_spec == C.LOCAL else
                         ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"))
    tp = len(shards)
    s = x.shape[0]
    pos = torch.arange(s)
    h = _rms(x, shards[0][in_norm], d.eps)
    attn = 0
    for sh in shards:
        q, k, v = megatron_qkv_split(F.linear(h, sh["self_attention.linear_qkv.weight"], sh["self_attention.linear_qkv.bias"]),
                                     d.num_kv_heads // tp, d.heads_per_group, d.head_dim)
        q, k = _rope(q, pos, d.rope_theta), _rope(k, pos, d.rope_theta)
        k, v = k.repeat_interleave(d.heads_per_group, dim=2), v.repeat_interleave(d.heads_per_group, dim=2)
        o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                           is_causal=True)                 # [b, n, s, hd]
        attn = attn + F.linear(o.permute(2, 0, 1, 3).reshape(s, x.shape[1], -1), sh["self_attention.linear_proj.weight"])
    x = x + attn
    h = _rms(x, shards[0][mlp_norm], d.eps)
    mlp = 0
    for sh in shards:
        gate, up = torch.chunk(F.linear(h, sh["mlp.linear_fc1.weight"]), 2, dim=-1)
        mlp = mlp + F.linear(F.silu(gate) * up, sh["mlp.linear_fc2.weight"])
    return x + mlp


def _layer_shards(mc: dict, i: int, tp: int) -> list[dict]:
    pre = f"decoder.layers.{i}."
    layer = {k[len(pre):]: t for k, t in mc.items() if k.startswith(pre)}
    return [{k: C.shard_tensor(k, t, tp, r) for k, t in layer.items()} for r in range(tp)]


@pytest.mark.parametrize("overrides, tp", [(TIED, 1), (UNTIED, 1), (UNTIED, 2), (MHA, 4)],
                         ids=["gqa1-tp1", "gqa2-tp1", "gqa2-tp2", "mha-tp4"])
@pytest.mark.parametrize("layer_spec", C.LAYER_SPECS)
def test_decoder_layer_from_megatron_tensors_matches_hf(overrides, tp, layer_spec):
    model = qwen2(**overrides)
    d = C.Qwen2Dims.from_hf(model.config)
    mc = C.hf_to_mcore(hf_weights(model), d, layer_spec=layer_spec)
    b, s = 2, 7
    x = torch.randn(b, s, d.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s).expand(b, s)
    mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None].expand(b, 1, s, s)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            want = layer(x, attention_mask=mask, position_ids=pos,
                         position_embeddings=model.model.rotary_emb(x, pos))
            got = megatron_layer(x.transpose(0, 1), _layer_shards(mc, i, tp), d, layer_spec).transpose(0, 1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides, tp", [(TIED, 1), (UNTIED, 2)], ids=["tied-tp1", "untied-tp2"])
def test_whole_model_logits_and_log_probs_from_megatron_tensors(overrides, tp):
    """Embedding -> layers -> final norm -> output layer (the embedding when tied), vocab-sharded over
    TP with megatron's padded rows, then the engine's vocab-parallel log-softmax: equal to HF."""
    model = qwen2(**overrides)
    d = C.Qwen2Dims.from_hf(model.config)
    vocab = C.padded_vocab_size(d.vocab_size, 8, tp)
    mc = C.hf_to_mcore(hf_weights(model), d, padded_vocab=vocab)
    ids = torch.randint(0, d.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        x = F.embedding(ids, mc[C.MC_EMBED]).transpose(0, 1)
        for i in range(d.num_layers):
            x = megatron_layer(x, _layer_shards(mc, i, tp), d)
        x = _rms(x, mc[C.MC_NORM], d.eps).transpose(0, 1)
        head = mc[C.MC_EMBED] if d.tie_word_embeddings else mc[C.MC_HEAD]
        logits = [F.linear(x, C.shard_tensor(C.MC_HEAD, head, tp, r)) for r in range(tp)]
        ref = model(input_ids=ids).logits
    full = torch.cat(logits, -1)
    torch.testing.assert_close(full[..., :d.vocab_size], ref, rtol=0, atol=1e-5)
    assert not full[..., d.vocab_size:].any()  # zero rows give zero logits: they must be masked
    targets = torch.roll(ids, -1, dims=1)
    logp, ent = vocab_parallel_log_probs(full, targets, vocab_size=d.vocab_size, with_entropy=True)
    want = torch.log_softmax(ref, -1)
    torch.testing.assert_close(logp, want.gather(-1, targets[..., None])[..., 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, -(want.exp() * want).sum(-1), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------ engine's batch layout
def test_right_padded_rows_give_each_rows_own_log_probs():
    model = qwen2()
    prompts = [torch.tensor([1, 5, 6]), torch.tensor([3]), torch.tensor([7, 8, 9, 10, 4])]
    responses = [torch.tensor([4, 2]), torch.tensor([5, 6, 7, 2]), torch.tensor([], dtype=torch.long)]
    rows = right_padded(prompts, responses, pad_id=0, multiple_of=4)
    assert rows.tokens.shape == (3, 8) and rows.tokens[1, :5].tolist() == [3, 5, 6, 7, 2]
    assert rows.index.tolist() == [[2, 3, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0]]
    assert rows.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert torch.equal(rows.targets[:, :-1], rows.tokens[:, 1:])
    with torch.no_grad():
        logits = model(input_ids=rows.tokens, position_ids=rows.position_ids).logits  # causal mask only
        logp, _ = vocab_parallel_log_probs(logits, rows.targets)
        got = logp.gather(1, rows.index)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if not r.numel():
                continue
            alone = torch.log_softmax(model(input_ids=torch.cat([p, r])[None]).logits[0], -1)
            want = alone[len(p) - 1:len(p) + len(r) - 1].gather(-1, r[:, None])[:, 0]
            torch.testing.assert_close(got[i, :len(r)], want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="empty prompt"):
        right_padded([torch.tensor([], dtype=torch.long)], [torch.tensor([1])], 0)


def test_vocab_parallel_log_probs_one_rank_with_padding_and_grads():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 16, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 13, (3, 4), generator=g)
    w1, w2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    logp, ent = vocab_parallel_log_probs(logits * 0.5, targets, vocab_size=13, with_entropy=True)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ref_in = logits.detach().clone().requires_grad_()
    ls = torch.log_softmax(ref_in[..., :13] * 0.5, -1)
    ref_logp, ref_ent = ls.gather(-1, targets[..., None])[..., 0], -(ls.exp() * ls).sum(-1)
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad, ref_in.grad, rtol=0, atol=1e-5)
    assert not logits.grad[..., 13:].any()


def _vocab_parallel_rank(rank: int, world: int, port: int) -> dict:
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(5)
        full = torch.randn(3, 4, 16, generator=g) * 3
        targets = torch.randint(0, 13, (3, 4), generator=g)
        w1, w2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
        local = full[..., rank * 8:(rank + 1) * 8].clone().requires_grad_()
        logp, ent = vocab_parallel_log_probs(local, targets, vocab_start=rank * 8, vocab_size=13,
                                             group=dist.group.WORLD, with_entropy=True)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        return {"logp": logp.detach(), "ent": ent.detach(), "grad": local.grad}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_log_probs_two_gloo_ranks(tmp_path):
    from mindspeed_rl.engines.sync.weight_sync import free_port
    port = free_port()
    r0, r1 = W.run_procs([(_vocab_parallel_rank, (r, 2, port)) for r in range(2)], tmp_path, TIMEOUT_S)
    g = torch.Generator().manual_seed(5)
    full = (torch.randn(3, 4, 16, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 13, (3, 4), generator=g)
    w1, w2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    ls = torch.log_softmax(full[..., :13], -1)
    logp, ent = ls.gather(-1, targets[..., None])[..., 0], -(ls.exp() * ls).sum(-1)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    for r in (r0, r1):
        torch.testing.assert_close(r["logp"], logp.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(r["ent"], ent.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([r0["grad"], r1["grad"]], -1), full.grad, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ the engine on CPU
def test_engine_refuses_what_it_cannot_run(tmp_path):
    from mindspeed_rl.engines.base import TrainSpec
    from mindspeed_rl.engines.train.megatron.engine import MegatronTrainEngine
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['zero'\]"):
        MegatronTrainEngine.build(TrainSpec(model_path=str(tmp_path), options={"zero": 1}))
    with pytest.raises(ValueError, match="layer_spec='fused'"):
        MegatronTrainEngine.build(TrainSpec(model_path=str(tmp_path), options={"layer_spec": "fused"}))
    with pytest.raises(NotImplementedError, match="critic"):
        MegatronTrainEngine.build(TrainSpec(model_path=str(tmp_path), model_kind="value", device="cuda:0"))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        MegatronTrainEngine.build(TrainSpec(model_path=str(tmp_path), device="cpu"))
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ImportError, match="needs torch_npu"):
            MegatronTrainEngine.build(TrainSpec(model_path=str(tmp_path), device="npu:0"))


@pytest.fixture(params=[True, False], ids=["te-installed", "te-absent"])
def te_installed(request, monkeypatch):
    """`importlib.util.find_spec` as it answers with transformer_engine installed or not (a spec found or None);
    every other name is looked up for real. Nothing is imported: the resolution only looks the package up."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "transformer_engine":
            return importlib.machinery.ModuleSpec(name, None) if request.param else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return request.param


def test_layer_spec_auto_takes_te_where_installed_on_cuda(te_installed):
    from mindspeed_rl.engines.train.megatron import setup as S
    assert S.resolve_layer_spec(C.AUTO, "cuda") == (C.TE if te_installed else C.LOCAL)
    # TE is a CUDA library: an NPU (MindSpeed's adaptor) and the CPU get megatron's local layers
    assert S.resolve_layer_spec(C.AUTO, "npu") == S.resolve_layer_spec(C.AUTO, "cpu") == C.LOCAL
    # what is asked for explicitly is built, installed or not
    assert [S.resolve_layer_spec(s, k) for s in (C.LOCAL, C.TE) for k in ("cuda", "npu")] == [C.LOCAL] * 2 + [C.TE] * 2
    with pytest.raises(ValueError, match="layer_spec='fused'"):
        S.resolve_layer_spec("fused", "cuda")


def test_the_engine_options_default_to_auto_and_resolve_it(te_installed, tmp_path):
    from mindspeed_rl.engines.base import TrainSpec
    from mindspeed_rl.engines.registry import train_backend
    from mindspeed_rl.engines.train.megatron import setup as S
    from mindspeed_rl.engines.train.megatron.engine import OPTIONS
    parsed = train_backend("megatron").parse_options({})    # the config's options, checked by MegatronOptions
    assert parsed["layer_spec"] == OPTIONS["layer_spec"] == C.AUTO
    assert train_backend("megatron").parse_options({"layer_spec": "local"})["layer_spec"] == C.LOCAL
    with pytest.raises(ValueError, match="layer_spec='fused'"):
        train_backend("megatron").parse_options({"layer_spec": "fused"})
    opts = S.checked_options(TrainSpec(model_path=str(tmp_path), device="cuda:0", options=parsed), OPTIONS)
    assert opts["layer_spec"] == (C.TE if te_installed else C.LOCAL)   # what the model and the converters get
    opts = S.checked_options(TrainSpec(model_path=str(tmp_path), device="cuda:0", options={"layer_spec": "local"}),
                             OPTIONS)
    assert opts["layer_spec"] == C.LOCAL


# --------------------------------------------- real megatron-core, where it imports (not in CI)
def _megatron_rank(rank: int, world: int, port: int, overrides: dict) -> dict:
    """megatron-core's GPTModel (local spec) on a gloo rank, TP = world, from converted HF weights.

    Two CPU shims, this process only: megatron's rotary embedding moves inv_freq to
    torch.cuda.current_device(), and its attention forks the CUDA RNG tracker around dropout (0 here);
    the causal mask is passed explicitly because megatron's default one is allocated on "cuda"."""
    import contextlib
    import datetime
    import warnings

    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        parallel_state.initialize_model_parallel(world, 1)
        hf = qwen2(**overrides)
        d = C.Qwen2Dims.from_hf(hf.config)
        config = TransformerConfig(**C.transformer_config_kwargs(d, tp=world), use_cpu_initialization=True)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         **C.gpt_model_kwargs(d, tp=world)).eval()
        weights = C.hf_to_mcore_rank(hf_weights(hf), d, tp=world, tp_rank=rank, pp=1, pp_rank=0)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        ids = torch.randint(0, d.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=torch.arange(9).expand(2, 9),
                        attention_mask=torch.ones(9, 9, dtype=torch.bool).triu(1)[None, None])
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out.contiguous())
            return {"logits": torch.cat(parts, -1)[..., :d.vocab_size], "ref": hf(input_ids=ids).logits}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                    or importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("overrides", [{**TIED, "num_attention_heads": 4, "num_key_value_heads": 2}, UNTIED],
                         ids=["tied", "untied"])
def test_real_megatron_gpt_model_matches_hf(overrides, tmp_path):
    from mindspeed_rl.engines.sync.weight_sync import free_port
    port = free_port()
    results = W.run_procs([(_megatron_rank, (r, 2, port, overrides)) for r in range(2)], tmp_path, TIMEOUT_S)
    for r in results:
        torch.testing.assert_close(r["logits"], r["ref"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_log_probs_equal_one_call_in_values_and_gradients(with_entropy):
    """16-bit logits taken to fp32 two rows at a time (checkpointed) against one fp32 call, temperature 0.7."""
    from mindspeed_rl.engines.train.megatron.tensors import chunked_vocab_parallel_log_probs
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 6, 16, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 13, (5, 6), generator=g)
    w = torch.randn(5, 6, generator=g)
    got, ent = chunked_vocab_parallel_log_probs(logits, targets, chunk_rows=2, temperature=0.7, vocab_size=13,
                                                with_entropy=with_entropy)
    ((got * w).sum() + (ent.sum() if with_entropy else 0)).backward()
    ref_in = logits.detach().clone().requires_grad_()
    want, want_ent = vocab_parallel_log_probs(ref_in.float() / 0.7, targets, vocab_size=13, with_entropy=with_entropy)
    ((want * w).sum() + (want_ent.sum() if with_entropy else 0)).backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if with_entropy:
        torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits.grad.float(), ref_in.grad.float(), rtol=0, atol=1e-6)
