"""One pipeline stage of a HF decoder-only model and the tensor-parallel plan of its layers: the module
the mesh backend (mesh_train.py) runs on each rank, and how its layers are split between stages."""
from __future__ import annotations

import torch
from torch import nn


def qwen2_tp_plan() -> dict:
    """Megatron's TP plan of a Qwen2/Llama decoder layer (module path inside the layer -> style)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def split_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the pp stages; the first `n_layers % pp` stages take one more."""
    if n_layers < pp:
        raise ValueError(f"pp={pp} stages but the model has {n_layers} decoder layers; use pp <= {n_layers}")
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


class StageModule(nn.Module):
    """One pipeline stage of a HF decoder-only model (Qwen2, Llama layout), with the HF parameter
    names: ``model.embed_tokens`` (first stage), ``model.layers.<global index>``, ``model.norm``
    and ``lm_head`` / ``score`` (last stage).

    forward(x, attention_mask, position_ids, labels=None): x is input ids on the first stage, hidden
    states after it; the last stage returns the head's output at the response positions
    `response_slice` = (prompt_width P, response width R): positions P-1 .. P+R-2, as
    `torch_train.response_logits` reads them. A causal LM given `labels` (the [rows, R] responses)
    returns [rows, R, 2] log-probs and entropies instead of logits (`log_probs`); without them,
    fp32 logits (the mesh rollout backend samples from them)."""

    def __init__(self, hf: nn.Module, layers: range, first: bool, last: bool, kind: str):
        super().__init__()
        base = getattr(hf, hf.base_model_prefix)
        self.config = hf.config
        self.first, self.last, self.kind = first, last, kind
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.model.rotary_emb = base.rotary_emb
        if last:
            self.model.norm = base.norm
            if kind == "value":
                self.score = hf.score
            else:
                self.lm_head = hf.lm_head
        self.response_slice: tuple[int, int] | None = None
        self.temperature = 1.0
        self.with_entropy = True   # log-probs mode: compute entropies too (training)
        self.checkpoint_layers = False   # activation checkpointing of each decoder layer (training forwards)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.model.embed_tokens(x) if self.first else x
        cfg = self.config
        kw = dict(config=cfg, inputs_embeds=h, attention_mask=attention_mask, past_key_values=None,
                  position_ids=position_ids)
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pe = self.model.rotary_emb(h, position_ids)
        recompute = self.checkpoint_layers and self.training and torch.is_grad_enabled()
        for i, layer in self.model.layers.items():
            kw = dict(attention_mask=masks[layer_types[int(i)]], position_embeddings=pe, position_ids=position_ids)
            if recompute:   # keep the layer's input only; the backward runs it again (TP and FSDP hooks too)
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, **kw)
            else:
                h = layer(h, **kw)
        if not self.last:
            return h
        p, r = self.response_slice
        h = self.model.norm(h[:, p - 1:p + r - 1])
        if self.kind == "value":  # a copy, not a view: FSDP2 warns on a root module returning a view
            return self.score(h)[..., 0].float().clone()
        if labels is not None:
            return self.log_probs(h, labels, attention_mask[:, p:p + r])
        logits = self.lm_head(h).float()
        return logits / self.temperature if self.temperature not in (0, 1.0) else logits

    def log_probs(self, h: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows, R, 2]: log-prob of each label and entropy (0 unless `with_entropy`), fp32, 0 at
        padding; the head runs on the real response tokens only, a chunk at a time
        (`log_probs.head_log_probs`): no [rows, R, vocab] fp32 tensor leaves or stays in the stage."""
        from .log_probs import head_log_probs

        logp, ent = head_log_probs(h, self.lm_head.weight, self.lm_head.bias, labels, self.temperature,
                                   self.with_entropy, mask=mask)
        return torch.stack([logp, ent if ent is not None else torch.zeros_like(logp)], dim=-1)
