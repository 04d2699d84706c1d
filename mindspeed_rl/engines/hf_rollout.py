"""Rollout with HF transformers: batched sampling with a KV cache.

We drive the model's forward with a `DynamicCache` ourselves instead of `model.generate` because
sampling must use an explicit `torch.Generator` per row: with a seed derived from (run seed,
step, row), a row samples the same tokens whichever micro-batch, mode or thread generates it,
which is what makes blocking and non-blocking runs identical (vLLM does the same with a seed per
request). It is also faster on CPU. The log-prob of each sampled token under the distribution it
was drawn from (temperature, top-k, top-p applied) comes back with it: the behaviour policy.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from .base import (NamedTensors, Rollout, RolloutEngine, RolloutSpec, SamplingParams, flatten_parameters,
                   hf_named_weights, load_named)
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


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token, its log-prob under the distribution it was drawn from) per row; row i draws with
    `generators[i]` alone, so its tokens do not depend on the other rows of the batch."""
    if params.greedy or params.temperature == 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        logp = torch.log_softmax(filter_logits(logits.float() / params.temperature, params.top_p, params.top_k), -1)
        probs = logp.exp().cpu()
        tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
        tokens = tokens.to(logits.device)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class ResponseBuilder:
    """A batch's responses as they are sampled, a token per row per step: a row ends with its first
    stop token (what is sampled after it is padding), and the batch is done when every row has ended
    or `max_new_tokens` is reached. Shared by the engines that drive their own sampling loop."""

    def __init__(self, batch: int, params: SamplingParams, pad_token_id: int, device: torch.device):
        self.stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long)
        self.max_new_tokens = params.max_new_tokens
        self.pad_token_id = pad_token_id
        self.tokens: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []

    def add(self, tokens: torch.Tensor, log_probs: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Record one step; returns (the tokens to feed back, padding for rows that had ended; done)."""
        t = len(self.tokens)
        tokens = torch.where(self.finished, torch.full_like(tokens, self.pad_token_id), tokens)
        self.tokens.append(tokens)
        self.log_probs.append(log_probs)
        if self.stop.numel():
            hit = torch.isin(tokens, self.stop) & ~self.finished
            self.lengths[hit.cpu()] = t + 1
            self.finished |= hit
        return tokens, bool(self.finished.all()) or t + 1 == self.max_new_tokens

    def rollout(self) -> Rollout:
        resp = torch.stack(self.tokens, dim=1).cpu()
        lp = torch.stack(self.log_probs, dim=1).float().cpu()
        n = self.lengths.tolist()
        return Rollout([resp[i, :k].clone() for i, k in enumerate(n)], [lp[i, :k].clone() for i, k in enumerate(n)])


class HFRolloutEngine(RolloutEngine):
    concurrent_generate = True  # each call has its own cache and generators; the weights are only read

    def __init__(self, model: torch.nn.Module, pad_token_id: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # one buffer, in HF order: a sync from a flattened trainer lands in one broadcast per bucket
        flatten_parameters(self.model)
        self.pad_token_id = int(pad_token_id)
        self.weight_version = 0

    @classmethod
    def build(cls, spec: RolloutSpec) -> "HFRolloutEngine":
        from ..models import load_causal_lm
        return cls(load_causal_lm(spec.model_path, spec.dtype), spec.pad_token_id, spec.device)

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> Rollout:
        from transformers import DynamicCache

        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; one seed per row")
        gens = [torch.Generator(device="cpu").manual_seed(int(s) % (2**63)) for s in seeds]
        ids, attn = left_pad(prompts, self.pad_token_id)
        ids, attn = ids.to(self.device), attn.to(self.device)
        batch = ids.shape[0]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions(attn),
                         past_key_values=DynamicCache(), use_cache=True)
        last_pos = positions(attn)[:, -1:]
        responses = ResponseBuilder(batch, params, self.pad_token_id, self.device)
        while True:
            nxt, done = responses.add(*sample_next(out.logits[:, -1, :], params, gens))
            if done:
                return responses.rollout()
            attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos,
                             past_key_values=out.past_key_values, use_cache=True)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        load_named(self.model, named_tensors)
        self.weight_version = int(version)

    def receive_targets(self) -> dict[str, torch.Tensor]:
        """Its parameters by HF name, tied ones under each name (`lm_head.weight` is the embedding's
        storage: a sync writes it under either name with the same bytes, as `update_weights` would).
        The worker holds the weights' write lock while a sync writes into them, so no generate
        reads a half-received tensor."""
        return {n: p.detach() for n, p in self.model.named_parameters(remove_duplicate=False)}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_named_weights(self.model)

    def state_checksum(self) -> str:
        from .weight_sync import checksum
        return checksum(self.named_weights())
