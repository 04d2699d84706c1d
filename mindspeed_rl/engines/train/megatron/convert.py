"""HF Qwen2 <-> megatron-core GPTModel: the config, the weight names and layouts, TP shards, PP stages.

Pure torch: nothing here imports megatron, so all of it runs (and is tested) on a CPU. The engine
(`engine.py`) feeds what this module returns to megatron-core; the tests check it against HF's own
Qwen2 modules and against megatron's documented split of the fused QKV projection.

What was followed (read in megatron-core 0.16.1, the release PyPI gives Python 3.11; the same code is in
NVIDIA/Megatron-LM main):

* fused QKV layout -- `megatron/core/transformer/attention.py`, `SelfAttention.get_query_key_value_tensors`:
  `linear_qkv` maps [sq, b, h] to [sq, b, ng * (np/ng + 2) * hn], which is viewed as
  [sq, b, ng, (np/ng + 2) * hn] and split on the last dim into [np/ng * hn, hn, hn]: the output rows
  are grouped per query group g as [the np/ng query heads of g, key head g, value head g]. Query head
  j of group g is head g * np/ng + j, the head that reads key/value head g, as in HF's `repeat_kv`.
  mbridge's Qwen2 bridge (mbridge/core/llm_bridge.py `_weight_to_hf_format`, vendored in verl)
  undoes it the same way: `qkv.view(num_kv_heads, -1)` then q/k/v slices of each row.
* gated MLP -- `megatron/core/transformer/mlp.py`: with `gated_linear_unit` the fc1 output is
  `torch.chunk(x, 2, dim=-1)` -> act(first half) * second half, so fc1 = cat([gate_proj, up_proj]).
  Under TP each rank's fc1 holds [its gate rows; its up rows] (`apply_swiglu_sharded_factory` chunks a
  local fc1 shard in two when writing a distributed checkpoint).
* TP splits -- `megatron/core/tensor_parallel/layers.py`: `ColumnParallelLinear` (linear_qkv,
  linear_fc1, output_layer) splits the output dim (dim 0 of the weight, and the bias),
  `RowParallelLinear` (linear_proj, linear_fc2) the input dim (dim 1), `VocabParallelEmbedding` the
  (padded) vocab rows; norms are replicated. The QKV split is a plain contiguous chunk of the
  interleaved rows: whole query groups per rank when tp divides ng; when tp > ng megatron splits a
  group across ranks and all-gathers it in `get_query_key_value_tensors` (the comment there).
* layer specs -- `megatron/core/models/gpt/gpt_layer_specs.py`: `get_gpt_layer_local_spec` keeps
  separate norms (`input_layernorm.weight`, `pre_mlp_layernorm.weight`);
  `get_gpt_layer_with_transformer_engine_spec` fuses them into TE's LayerNormLinear
  (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`), the names
  the local spec's `sharded_state_dict_keys_map` maps to.
* PP -- `megatron/core/transformer/transformer_layer.py` `get_transformer_layer_offset` and
  `transformer_block.py` `get_num_layers_to_build`: contiguous layer ranges, evenly split unless
  `num_layers_in_first/last_pipeline_stage` is set; a stage's module names its layers 0.. locally.
  The embedding lives on the first stage, `decoder.final_layernorm` and `output_layer` on the last;
  with tied embeddings and pp > 1 the last stage holds its own `output_layer.weight`, a copy of the
  embedding that megatron keeps equal by all-reducing the two grads (`finalize_model_grads`).
* vocab padding -- Megatron-LM `megatron/training/tokenizer/tokenizer.py` `_vocab_size_with_padding`:
  round the vocab up to a multiple of `make_vocab_size_divisible_by * tp`. Padded rows are zero here
  and are dropped on the way back; the engine masks their logits out of the log-softmax so log-probs
  equal HF's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

LOCAL, TE = "local", "te"          # megatron layer specs: separate norms / TE fused norm+linear
LAYER_SPECS = (LOCAL, TE)          # the weight layouts the converters write and read
AUTO = "auto"                      # the option's default: te where transformer_engine is installed (setup.py)
LAYER_SPEC_OPTIONS = (AUTO, LOCAL, TE)

# HF names of one decoder layer, in the order `Qwen2DecoderLayer.named_parameters()` gives them
HF_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                 "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
HF_EMBED, HF_NORM, HF_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
MC_EMBED, MC_NORM, MC_HEAD = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                              "output_layer.weight")
_IGNORED_HF = ("rotary_emb.inv_freq",)   # a buffer some checkpoints carry; recomputed from rope_theta


def _norm_names(layer_spec: str) -> tuple[str, str]:
    if layer_spec == LOCAL:
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"
    if layer_spec == TE:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    raise ValueError(f"layer_spec={layer_spec!r}; use one of {LAYER_SPECS} (megatron's local or "
                     f"Transformer Engine layer spec)")


def mcore_layer_keys(layer_spec: str = LOCAL) -> tuple[str, ...]:
    """megatron-core names of one decoder layer's weights (under `decoder.layers.<i>.`)."""
    in_norm, mlp_norm = _norm_names(layer_spec)
    return ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
            in_norm, mlp_norm)


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class Qwen2Dims:
    """The numbers of a Qwen2 checkpoint that the conversion needs."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    eps: float
    rope_theta: float
    max_position_embeddings: int
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: Any) -> "Qwen2Dims":
        """From a transformers `Qwen2Config` (or its dict / config.json). Refuses what the megatron
        GPTModel built here would compute differently: rope scaling, sliding-window attention."""
        get = (config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type")
        if model_type not in (None, "qwen2"):
            raise ValueError(f"model_type={model_type!r}: the megatron conversion is written for qwen2 "
                             f"(q/k/v biases, no o_proj bias, RMSNorm, SwiGLU, RoPE)")
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
        if rope_type not in (None, "default"):
            raise ValueError(f"rope_type={rope_type!r}: only plain RoPE converts (megatron's GPTModel "
                             f"rotary_base); rope scaling is not mapped")
        theta = get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, Mapping) else None) or 10000.0
        if get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True: sliding-window attention is not mapped to megatron")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(num_layers=int(get("num_hidden_layers")), hidden_size=hidden,
                   ffn_hidden_size=int(get("intermediate_size")), num_heads=heads,
                   num_kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), vocab_size=int(get("vocab_size")),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   eps=float(get("rms_norm_eps")), rope_theta=float(theta),
                   max_position_embeddings=int(get("max_position_embeddings")),
                   initializer_range=float(get("initializer_range", 0.02) or 0.02))


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: up to a multiple of divisible_by * tp."""
    multiple = int(make_vocab_size_divisible_by) * int(tp)
    if multiple < 1:
        raise ValueError(f"make_vocab_size_divisible_by * tp = {multiple}; must be >= 1")
    return -(-int(vocab_size) // multiple) * multiple


def transformer_config_kwargs(dims: Qwen2Dims, *, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                              num_layers_in_first_pipeline_stage: int | None = None,
                              num_layers_in_last_pipeline_stage: int | None = None) -> dict:
    """Keyword arguments of megatron-core's `TransformerConfig` for this Qwen2.

    Dropouts are 0 (Qwen2 trains without them; RL log-probs must equal the rollout's), fusions off
    (the engine may turn CUDA fusions on), softmax in fp32.
    """
    kw = dict(num_layers=dims.num_layers, hidden_size=dims.hidden_size, ffn_hidden_size=dims.ffn_hidden_size,
              num_attention_heads=dims.num_heads, num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim,
              normalization="RMSNorm", layernorm_epsilon=dims.eps,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu,   # SwiGLU
              add_bias_linear=False, add_qkv_bias=True,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=dims.initializer_range,
              attention_softmax_in_fp32=True, rotary_interleaved=False, qk_layernorm=False,
              bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
              apply_rope_fusion=False, persist_layer_norm=False,
              tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
              params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    if pp > 1:
        kw["pipeline_dtype"] = dtype
    if num_layers_in_first_pipeline_stage is not None:
        kw["num_layers_in_first_pipeline_stage"] = int(num_layers_in_first_pipeline_stage)
    if num_layers_in_last_pipeline_stage is not None:
        kw["num_layers_in_last_pipeline_stage"] = int(num_layers_in_last_pipeline_stage)
    pp_layer_range(dims.num_layers, pp, 0, num_layers_in_first_pipeline_stage,
                   num_layers_in_last_pipeline_stage)  # refuses a split megatron would refuse
    return kw


def gpt_model_kwargs(dims: Qwen2Dims, *, tp: int = 1, make_vocab_size_divisible_by: int = 128) -> dict:
    """Keyword arguments of megatron-core's `GPTModel` (besides config, layer spec, pre/post_process)."""
    return dict(vocab_size=padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, tp),
                max_sequence_length=dims.max_position_embeddings, position_embedding_type="rope",
                rotary_percent=1.0, rotary_base=int(dims.rope_theta) if float(dims.rope_theta).is_integer()
                else dims.rope_theta,
                share_embeddings_and_output_weights=dims.tie_word_embeddings, parallel_output=True)


# ------------------------------------------------------------------------------- tensor layouts
def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Qwen2Dims) -> torch.Tensor:
    """HF q/k/v projections (weights [out, h] or biases [out]) -> megatron's fused, per-group
    interleaved `linear_qkv`: for each query group g, [q heads of g, k_g, v_g]."""
    ng, hd = dims.num_kv_heads, dims.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, dims.heads_per_group * hd, *rest)
    k = k.reshape(ng, hd, *rest)
    v = v.reshape(ng, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_from_mcore(qkv: torch.Tensor, dims: Qwen2Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `qkv_to_mcore`: megatron's fused `linear_qkv` -> HF (q, k, v)."""
    ng, hd, per = dims.num_kv_heads, dims.head_dim, dims.heads_per_group
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (per + 2) * hd, *rest)
    q, k, v = torch.split(g, [per * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fc1_to_mcore(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def fc1_from_mcore(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocab {rows} is smaller than the checkpoint's {t.shape[0]} rows")
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


# ----------------------------------------------------------------------------- state-dict names
def layer_to_mcore(hf_layer: Mapping[str, torch.Tensor], dims: Qwen2Dims,
                   layer_spec: str = LOCAL) -> dict[str, torch.Tensor]:
    """One HF decoder layer (keys of `HF_LAYER_KEYS`) -> megatron names under `decoder.layers.<i>.`."""
    in_norm, mlp_norm = _norm_names(layer_spec)
    a = "self_attn."
    return {
        "self_attention.linear_qkv.weight": qkv_to_mcore(hf_layer[a + "q_proj.weight"], hf_layer[a + "k_proj.weight"],
                                                         hf_layer[a + "v_proj.weight"], dims),
        "self_attention.linear_qkv.bias": qkv_to_mcore(hf_layer[a + "q_proj.bias"], hf_layer[a + "k_proj.bias"],
                                                       hf_layer[a + "v_proj.bias"], dims),
        "self_attention.linear_proj.weight": hf_layer[a + "o_proj.weight"],
        "mlp.linear_fc1.weight": fc1_to_mcore(hf_layer["mlp.gate_proj.weight"], hf_layer["mlp.up_proj.weight"]),
        "mlp.linear_fc2.weight": hf_layer["mlp.down_proj.weight"],
        in_norm: hf_layer["input_layernorm.weight"],
        mlp_norm: hf_layer["post_attention_layernorm.weight"],
    }


def layer_to_hf(mc_layer: Mapping[str, torch.Tensor], dims: Qwen2Dims, layer_spec: str = LOCAL) -> dict[str, torch.Tensor]:
    """The inverse of `layer_to_mcore`, keys in `HF_LAYER_KEYS` order."""
    in_norm, mlp_norm = _norm_names(layer_spec)
    qw, kw, vw = qkv_from_mcore(mc_layer["self_attention.linear_qkv.weight"], dims)
    qb, kb, vb = qkv_from_mcore(mc_layer["self_attention.linear_qkv.bias"], dims)
    gate, up = fc1_from_mcore(mc_layer["mlp.linear_fc1.weight"])
    vals = (qw, qb, kw, kb, vw, vb, mc_layer["self_attention.linear_proj.weight"], gate, up,
            mc_layer["mlp.linear_fc2.weight"], mc_layer[in_norm], mc_layer[mlp_norm])
    return dict(zip(HF_LAYER_KEYS, vals))


def hf_to_mcore(hf: Mapping[str, torch.Tensor], dims: Qwen2Dims, *, layer_spec: str = LOCAL,
                padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """A whole HF Qwen2 state dict -> a whole (TP=1, PP=1) megatron GPTModel state dict.

    The vocab rows are zero-padded to `padded_vocab` (default: no padding). With tied embeddings
    there is no `output_layer.weight` (megatron reuses the embedding); an HF `lm_head.weight` is then
    ignored. A missing or unknown HF name is an error naming it.
    """
    vocab = padded_vocab or dims.vocab_size
    used = {HF_EMBED, HF_NORM}
    out = {MC_EMBED: _pad_rows(hf[HF_EMBED], vocab)}
    for i in range(dims.num_layers):
        pre = f"model.layers.{i}."
        try:
            layer = {k: hf[pre + k] for k in HF_LAYER_KEYS}
        except KeyError as e:
            raise KeyError(f"HF checkpoint has no {e.args[0]!r} (layer {i} of {dims.num_layers})") from None
        used.update(pre + k for k in HF_LAYER_KEYS)
        out.update({f"decoder.layers.{i}.{k}": t for k, t in layer_to_mcore(layer, dims, layer_spec).items()})
    out[MC_NORM] = hf[HF_NORM]
    if HF_HEAD in hf:
        used.add(HF_HEAD)
    if not dims.tie_word_embeddings:
        if HF_HEAD not in hf:
            raise KeyError(f"HF checkpoint has no {HF_HEAD!r} but tie_word_embeddings is False")
        out[MC_HEAD] = _pad_rows(hf[HF_HEAD], vocab)
    unknown = [k for k in hf if k not in used and not k.endswith(_IGNORED_HF)]
    if unknown:
        raise ValueError(f"HF weights {unknown[:5]} have no megatron counterpart in the Qwen2 conversion")
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], dims: Qwen2Dims, *, layer_spec: str = LOCAL,
                tied_lm_head: bool = True) -> dict[str, torch.Tensor]:
    """A whole megatron state dict -> HF names in `Qwen2ForCausalLM.named_parameters()` order, vocab
    padding dropped. With tied embeddings `lm_head.weight` is the embedding (under both names a
    reader needs) unless `tied_lm_head=False`. TE's `_extra_state` entries are skipped."""
    out = {HF_EMBED: mc[MC_EMBED][:dims.vocab_size]}
    for i in range(dims.num_layers):
        pre = f"decoder.layers.{i}."
        layer = {k: mc[pre + k] for k in mcore_layer_keys(layer_spec)}
        out.update({f"model.layers.{i}.{k}": t for k, t in layer_to_hf(layer, dims, layer_spec).items()})
    out[HF_NORM] = mc[MC_NORM]
    if not dims.tie_word_embeddings:
        out[HF_HEAD] = mc[MC_HEAD][:dims.vocab_size]
    elif tied_lm_head:
        out[HF_HEAD] = out[HF_EMBED]
    return out


# ---------------------------------------------------------------------------------------- TP
COLUMN, ROW, FC1, REPLICATED = "column", "row", "fc1", "replicated"


def tp_rule(name: str) -> str:
    """How megatron shards a weight over TP ranks (see the module doc)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", MC_EMBED, MC_HEAD)):
        return COLUMN
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return FC1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ROW
    return REPLICATED  # norms (incl. TE's fused layer_norm_weight), linear_proj/fc2 biases (none here)


def _check_div(name: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(f"{name}: dim of size {size} does not split over tp={tp}")


def shard_tensor(name: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s part of the whole megatron tensor `name` (a copy, contiguous)."""
    rule = tp_rule(name)
    if tp == 1 or rule == REPLICATED:
        return t.clone()
    if rule == COLUMN:
        _check_div(name, t.shape[0], tp)
        return t.chunk(tp, dim=0)[rank].clone()
    if rule == ROW:
        _check_div(name, t.shape[1], tp)
        return t.chunk(tp, dim=1)[rank].clone()
    gate, up = fc1_from_mcore(t)  # FC1: keep each rank's [gate; up] pairing
    _check_div(name, gate.shape[0], tp)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def unshard_tensor(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole megatron tensor from every TP rank's shard, in rank order."""
    rule = tp_rule(name)
    if len(shards) == 1 or rule == REPLICATED:
        return shards[0]
    if rule == COLUMN:
        return torch.cat(list(shards), dim=0)
    if rule == ROW:
        return torch.cat(list(shards), dim=1)
    pairs = [fc1_from_mcore(s) for s in shards]
    return torch.cat([torch.cat([g for g, _ in pairs]), torch.cat([u for _, u in pairs])], dim=0)


def shard_state_dict(mc: Mapping[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """A whole megatron state dict -> one per TP rank."""
    return [{k: shard_tensor(k, t, tp, r) for k, t in mc.items()} for r in range(tp)]


def unshard_state_dict(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: unshard_tensor(k, [s[k] for s in shards]) for k in shards[0]}


# ---------------------------------------------------------------------------------------- PP
def pp_layer_range(num_layers: int, pp: int, stage: int, first: int | None = None,
                   last: int | None = None) -> range:
    """The global layers of PP stage `stage`: megatron's `get_transformer_layer_offset` and
    `get_num_layers_to_build` without virtual stages (an even split unless `first`/`last`, the
    config's num_layers_in_first/last_pipeline_stage, are given)."""
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} outside 0..{pp - 1}")
    if pp == 1:
        return range(num_layers)
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"num_layers={num_layers} does not split evenly over pp={pp}; set "
                             f"num_layers_in_first/last_pipeline_stage")
        n = num_layers // pp
        return range(stage * n, (stage + 1) * n)
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
        raise ValueError(f"num_layers={num_layers} with first={first}, last={last}: the layers left "
                         f"({middle_layers}) do not split evenly over the {middle_stages} middle stage(s)")
    per = middle_layers // middle_stages if middle_stages else 0
    if stage == 0 and first is not None:
        return range(0, first)
    if stage == pp - 1 and last is not None:
        return range(num_layers - last, num_layers)
    offset = (first or 0) + (stage - (1 if first is not None else 0)) * per
    return range(offset, offset + per)


def global_to_stage(layer: int, num_layers: int, pp: int, first: int | None = None,
                    last: int | None = None) -> tuple[int, int]:
    """Global layer index -> (stage, index inside that stage's `decoder.layers`)."""
    for s in range(pp):
        r = pp_layer_range(num_layers, pp, s, first, last)
        if layer in r:
            return s, layer - r.start
    raise ValueError(f"layer {layer} outside 0..{num_layers - 1}")


def stage_to_global(stage: int, local: int, num_layers: int, pp: int, first: int | None = None,
                    last: int | None = None) -> int:
    r = pp_layer_range(num_layers, pp, stage, first, last)
    if not 0 <= local < len(r):
        raise ValueError(f"stage {stage} has {len(r)} layers; local index {local} is outside")
    return r.start + local


def _split_layer_name(name: str) -> tuple[int, str] | None:
    if not name.startswith("decoder.layers."):
        return None
    idx, rest = name[len("decoder.layers."):].split(".", 1)
    return int(idx), rest


def split_pipeline(mc: Mapping[str, torch.Tensor], dims: Qwen2Dims, pp: int, first: int | None = None,
                   last: int | None = None) -> list[dict[str, torch.Tensor]]:
    """A whole megatron state dict -> one per PP stage, with stage-local layer names: the embedding on
    stage 0, the final norm and output layer on the last (with tied embeddings and pp > 1, the last
    stage's `output_layer.weight` is the embedding, as megatron initializes it)."""
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
    for name, t in mc.items():
        parsed = _split_layer_name(name)
        if parsed is not None:
            s, local = global_to_stage(parsed[0], dims.num_layers, pp, first, last)
            stages[s][f"decoder.layers.{local}.{parsed[1]}"] = t
        elif name == MC_EMBED:
            stages[0][name] = t
        else:
            stages[pp - 1][name] = t
    if dims.tie_word_embeddings and pp > 1:
        stages[pp - 1][MC_HEAD] = mc[MC_EMBED]
    return stages


def merge_pipeline(stages: Sequence[Mapping[str, torch.Tensor]], dims: Qwen2Dims, first: int | None = None,
                   last: int | None = None) -> dict[str, torch.Tensor]:
    """The inverse of `split_pipeline` (the tied copy on the last stage is dropped)."""
    pp = len(stages)
    out: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(stages):
        for name, t in sd.items():
            parsed = _split_layer_name(name)
            if parsed is not None:
                g = stage_to_global(s, parsed[0], dims.num_layers, pp, first, last)
                out[f"decoder.layers.{g}.{parsed[1]}"] = t
            elif name == MC_HEAD and dims.tie_word_embeddings:
                continue
            else:
                out[name] = t
    return out


def hf_to_mcore_rank(hf: Mapping[str, torch.Tensor], dims: Qwen2Dims, *, tp: int, tp_rank: int, pp: int,
                     pp_rank: int, layer_spec: str = LOCAL, make_vocab_size_divisible_by: int = 128,
                     first: int | None = None, last: int | None = None) -> dict[str, torch.Tensor]:
    """What one (TP rank, PP stage) of a GPTModel loads from an HF checkpoint, under its `state_dict()`
    names. Reads only the HF tensors that stage needs (`hf` may be a lazy mapping over safetensors
    files); equal to splitting and sharding `hf_to_mcore` of the whole checkpoint (a test checks it)."""
    vocab = padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, tp)
    layers = pp_layer_range(dims.num_layers, pp, pp_rank, first, last)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out[MC_EMBED] = _pad_rows(hf[HF_EMBED], vocab)
    for local, g in enumerate(layers):
        layer = {k: hf[f"model.layers.{g}.{k}"] for k in HF_LAYER_KEYS}
        out.update({f"decoder.layers.{local}.{k}": t for k, t in layer_to_mcore(layer, dims, layer_spec).items()})
    if pp_rank == pp - 1:
        out[MC_NORM] = hf[HF_NORM]
        if not dims.tie_word_embeddings:
            out[MC_HEAD] = _pad_rows(hf[HF_HEAD], vocab)
        elif pp > 1:
            out[MC_HEAD] = _pad_rows(hf[HF_EMBED], vocab)  # the last stage's copy of the tied embedding
    return {k: shard_tensor(k, t, tp, tp_rank) for k, t in out.items()}


def hf_shapes(dims: Qwen2Dims, tied_lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight `mcore_to_hf` gives, in its order (a PP stage that receives a
    weight it does not hold allocates the buffer from this)."""
    h, hd, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q, kv = dims.num_heads * hd, dims.num_kv_heads * hd
    layer = dict(zip(HF_LAYER_KEYS, ((q, h), (q,), (kv, h), (kv,), (kv, h), (kv,), (h, q), (f, h), (f, h),
                                     (h, f), (h,), (h,))))
    out = {HF_EMBED: (dims.vocab_size, h)}
    for i in range(dims.num_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    out[HF_NORM] = (h,)
    if not dims.tie_word_embeddings or tied_lm_head:
        out[HF_HEAD] = (dims.vocab_size, h)
    return out


def iter_hf_layers(mc_layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]], dims: Qwen2Dims,
                   layer_spec: str = LOCAL) -> Iterator[tuple[str, torch.Tensor]]:
    """(global layer index, whole megatron layer) pairs -> HF (name, tensor) pairs, a layer at a time
    (the engine's export gathers one layer over TP and PP, converts it, and lets it go)."""
    for i, layer in mc_layers:
        for k, t in layer_to_hf(layer, dims, layer_spec).items():
            yield f"model.layers.{i}.{k}", t
