"""Rollout with HF transformers: batched sampling with a KV cache.

We drive the model's forward with a `DynamicCache` ourselves instead of `model.generate` because
sampling must use an explicit `torch.Generator` per micro-batch: with a seed derived from
(run seed, step, first row), a micro-batch samples the same tokens whichever mode or thread runs
it, which is what makes blocking and non-blocking runs identical. It is also faster on CPU.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import SamplingParams
from .batching import left_pad, positions


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering: tokens outside get -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    if params.greedy or params.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / params.temperature, params.top_p, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class HFRolloutEngine:
    def __init__(self, model: torch.nn.Module, pad_token_id: int, device: torch.device | str = "cpu"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_token_id = int(pad_token_id)
        self.device = torch.device(device)
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seed: int) -> list[torch.Tensor]:
        from transformers import DynamicCache

        gen = torch.Generator(device="cpu").manual_seed(int(seed) % (2**63))
        ids, attn = left_pad(prompts, self.pad_token_id)
        ids, attn = ids.to(self.device), attn.to(self.device)
        batch = ids.shape[0]
        stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions(attn),
                         past_key_values=DynamicCache(), use_cache=True)
        last_pos = positions(attn)[:, -1:]
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long)
        tokens = []
        for t in range(params.max_new_tokens):
            nxt = sample_next(out.logits[:, -1, :], params, gen).to(self.device)
            nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
            tokens.append(nxt)
            if stop.numel():
                hit = torch.isin(nxt, stop) & ~finished
                lengths[hit.cpu()] = t + 1
                finished |= hit
            if bool(finished.all()) or t + 1 == params.max_new_tokens:
                break
            attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos,
                             past_key_values=out.past_key_values, use_cache=True)
        resp = torch.stack(tokens, dim=1).cpu()
        return [resp[i, :int(n)].clone() for i, n in enumerate(lengths.tolist())]

    def named_parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.data) for n, p in self.model.named_parameters()]
