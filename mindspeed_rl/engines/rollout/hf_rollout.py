"""Rollout with HF transformers: batched sampling with a KV cache.

We drive the model's forward with a `DynamicCache` ourselves instead of `model.generate` because
sampling must be seeded per row: with a seed derived from (run seed, step, row), a row samples the
same tokens whichever micro-batch, mode or thread generates it, which is what makes blocking and
non-blocking runs identical (vLLM does the same with a seed per request). The draws are
counter-based (`sampling.py`: a hash of (seed, token index), then an inverse-CDF draw), so the
whole loop stays on the device: sampling, stop detection and lengths never sync with the host, but
for one check every few tokens that also drops finished rows from the batch (KV cache included).
With `cuda_graphs` (generate_config.cuda_graphs; on by default on CUDA) the decode runs in fixed shapes
instead, each step replayed as a CUDA graph (static_decode.py): the same tokens, without the launches.
The log-prob of each sampled token under the distribution it was drawn from (temperature, top-k,
top-p applied) comes back with it: the behaviour policy.
"""
from __future__ import annotations

import inspect
from typing import Iterator, Sequence

import torch

from ..base import (NamedTensors, Rollout, RolloutEngine, RolloutSpec, SamplingParams, flatten_parameters,
                   hf_named_weights, load_named)
from ..batching import left_pad, positions
from ..rw_lock import ReadWriteLock
from .sampling import filter_logits, row_uniforms, sample_next  # noqa: F401  (filter_logits: the engine's API)
from .static_decode import WIDTH_STEP, StaticDecoder, StaticDecoders, sampling_key


def default_check_every(device: torch.device) -> int:
    """How many tokens between the sampling loop's host syncs (the "who has finished" check). On the
    CPU a sync costs nothing, so every token: a batch stops as soon as its last row does. On an
    accelerator each sync stalls the queue of kernels, so every 8 tokens: at most 7 forwards are
    spent on finished rows (padding, dropped by the next check) while the device is never idle."""
    return 1 if torch.device(device).type == "cpu" else 8


def prompt_mask(attn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The prefill's 4D additive attention mask [B, 1, P, P] of left-padded prompts: a token sees the real
    tokens at or before it (0), nothing else (the dtype's lowest value). A padding position sees itself, so
    no row of the softmax is empty (an all-masked row is NaN, and NaN times a zero weight is still NaN in
    the next layer). Built here because transformers, given a 2D mask, asks on every forward whether any
    row is padded (`masking_utils.fast_all`), a host sync per token; a 4D mask it takes as it is."""
    P = attn.shape[1]
    causal = torch.ones((P, P), dtype=torch.bool, device=attn.device).tril()
    seen = causal[None] & attn.bool()[:, None, :]
    seen |= torch.eye(P, dtype=torch.bool, device=attn.device)[None]
    return decode_mask_values(seen, dtype)[:, None]


def decode_mask_values(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `seen`, the dtype's lowest value elsewhere (an additive mask)."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)


def last_logits_only(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """The forward keyword that computes the prompt's logits at its last position only (the prefill
    of 64 rows x 128 tokens would otherwise hold 2.5 GB of bf16 logits at a 151,936-token vocabulary):
    `logits_to_keep` in transformers >= 4.50, absent before. Given as the position's index, not as a
    count: a count makes the head read a strided [B, 1, H] slice of the hidden states, which torch's
    CPU matmul does by copying the head's weight once per row (a bf16 [64, 576, 49152] copy, 4.7 s
    for SmolLM2's 64-row prefill on 2 cores, against 15 ms for the same product on a gathered copy)."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": torch.tensor([ids.shape[1] - 1], device=ids.device)}


class ResponseBuilder:
    """A batch's responses as they are sampled, a token per running row per step: a row ends with its
    first stop token (what is sampled after it is padding), and the batch is done when every row has
    ended or `max_new_tokens` is reached. Shared by the engines that drive their own sampling loop.

    Everything per row (tokens, log-probs, lengths, finished) stays on the device: `add` never syncs
    with the host. Every `check_every` tokens `compaction()` syncs once to learn which rows still
    sample, so the loop can drop the finished ones from its batch (their KV cache, mask, positions,
    draws): finished rows stop costing compute. `rows` maps the running batch to the original rows,
    so the output is in the original order whatever was dropped."""

    def __init__(self, batch: int, params: SamplingParams, pad_token_id: int, device: torch.device,
                 check_every: int | None = None):
        n = params.max_new_tokens
        self.stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        self.tokens = torch.full((batch, n), pad_token_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros((batch, n), dtype=torch.float32, device=device)
        self.lengths = torch.full((batch,), n, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.rows = torch.arange(batch, device=device)  # original row of each running row
        self.max_new_tokens = n
        self.pad_token_id = pad_token_id
        self.check_every = check_every or default_check_every(device)
        self.t = 0  # tokens sampled so far per row: the next token's index

    def add(self, tokens: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """Record one step of the running rows; returns the tokens to feed back (padding for rows
        that had ended). No host sync."""
        t, rows = self.t, self.rows
        ended = self.finished[rows]
        tokens = torch.where(ended, torch.full_like(tokens, self.pad_token_id), tokens)
        self.tokens[rows, t] = tokens
        self.log_probs[rows, t] = log_probs.float()
        if self.stop.numel():
            hit = torch.isin(tokens, self.stop) & ~ended
            self.lengths[rows] = torch.where(hit, t + 1, self.lengths[rows])
            self.finished[rows] = ended | hit
        self.t += 1
        return tokens

    @property
    def complete(self) -> bool:
        """`max_new_tokens` reached, or every row ended at the last check (host-side: no sync)."""
        return self.t == self.max_new_tokens or self.rows.numel() == 0

    def compaction(self) -> torch.Tensor | None:
        """Every `check_every` tokens (the loop's only host sync), when rows have ended since the last
        check: the positions in the running batch of the rows that still sample, which the caller
        keeps of its own per-row state; `rows` shrinks to them (empty: `complete`). None otherwise."""
        if not self.stop.numel() or self.t % self.check_every or self.t == self.max_new_tokens:
            return None
        keep = (~self.finished[self.rows]).nonzero().squeeze(1)
        if keep.numel() == self.rows.numel():
            return None
        self.rows = self.rows[keep]
        return keep

    def rollout(self) -> Rollout:
        resp, lp = self.tokens.cpu(), self.log_probs.cpu()
        n = self.lengths.cpu().numpy().tolist()   # one copy to the host, then no per-element reads
        return Rollout([resp[i, :k].clone() for i, k in enumerate(n)], [lp[i, :k].clone() for i, k in enumerate(n)])


class HFRolloutEngine(RolloutEngine):
    concurrent_generate = True  # each call has its own cache and draws; the weights are only read
    partial_rollout = True      # every forward reads the weights under `_steps`: a paused update waits for one step

    def __init__(self, model: torch.nn.Module, pad_token_id: int, device: torch.device | str = "cpu",
                 check_every: int | None = None, cuda_graphs: bool | None = None, max_seq_len: int = 0):
        self.device = torch.device(device)
        self.check_every = check_every   # tokens between the loop's host syncs; None: by device
        # the static decode (fixed shapes, a CUDA graph per batch bucket on CUDA): None = on CUDA only; True
        # elsewhere runs the same fixed-shape loop eagerly
        self.static = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.max_seq_len = int(max_seq_len)   # the static buffers' length when a batch fits: shared by every call
        self.width_step = WIDTH_STEP          # the static decode's width buckets (static_decode.py)
        self._decoders = StaticDecoders()
        self.model = model.to(self.device).eval()
        if self.static:   # a decode step reads each K/V head once per group, not once per query head
            from .gqa_decode import use_gqa_decode
            use_gqa_decode(self.model)
        elif self.device.type == "cpu":   # short 16-bit attention as matmuls (models/cpu_attention.py)
            from ...models.cpu_attention import use_cpu_attention
            use_cpu_attention(self.model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        # one buffer, in HF order: a sync from a flattened trainer lands in one broadcast per bucket
        flatten_parameters(self.model)
        self.pad_token_id = int(pad_token_id)
        self.weight_version = 0
        self._steps = ReadWriteLock()   # forwards read, `paused` writes

    @classmethod
    def build(cls, spec: RolloutSpec) -> "HFRolloutEngine":
        from ...models import load_causal_lm
        return cls(load_causal_lm(spec.model_path, spec.dtype), spec.pad_token_id, spec.device,
                   cuda_graphs=spec.cuda_graphs, max_seq_len=spec.max_seq_len)

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' forward into `cache`: (the last position's logits [B, vocab], the positions [B, P])."""
        pos = positions(attn)
        dtype = next(self.model.parameters()).dtype
        with self._steps.reading():
            out = self.model(input_ids=ids, attention_mask=prompt_mask(attn, dtype), position_ids=pos,
                             past_key_values=cache, use_cache=True, **last_logits_only(self.model, ids))
        return out.logits[:, -1, :], pos

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> Rollout:
        from transformers import DynamicCache

        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; one seed per row")
        ids, attn = left_pad(prompts, self.pad_token_id)
        ids, attn = ids.to(self.device), attn.to(self.device)
        draws = row_uniforms(seeds, params.max_new_tokens, self.device)
        if self.static:
            return self._generate_static(ids, attn, params, draws)
        cache = DynamicCache()
        logits, pos = self._prefill(ids, attn, cache)
        dtype = next(self.model.parameters()).dtype
        last_pos = pos[:, -1:]
        # the decode steps' mask, [B, 1, 1, P + max_new_tokens], allocated once: the prompt's padding masked,
        # every new token's column opened (set to 0) in place before the forward that first reads it
        P = attn.shape[1]
        mask = decode_mask_values(torch.cat([attn.bool(), attn.new_zeros((attn.shape[0], params.max_new_tokens),
                                                                         dtype=torch.bool)], 1), dtype)[:, None, None]
        responses = ResponseBuilder(ids.shape[0], params, self.pad_token_id, self.device, self.check_every)
        while True:
            nxt = responses.add(*sample_next(logits, params, draws[:, responses.t]))
            keep = responses.compaction()
            if responses.complete:
                return responses.rollout()
            if keep is not None:  # drop the rows that have ended: the rest sample as they would in the full batch
                nxt, mask, last_pos, draws = nxt[keep], mask[keep], last_pos[keep], draws[keep]
                cache.batch_select_indices(keep)
            width = P + responses.t
            mask[..., width - 1] = 0
            last_pos = last_pos + 1
            with self._steps.reading():
                logits = self.model(input_ids=nxt[:, None], attention_mask=mask[..., :width], position_ids=last_pos,
                                    past_key_values=cache, use_cache=True).logits[:, -1, :]

    def _generate_static(self, ids: torch.Tensor, attn: torch.Tensor, params: SamplingParams,
                         draws: torch.Tensor) -> Rollout:
        """The decode in fixed buffers (static_decode.py), sized by the run's longest prompt + response when the
        batch fits it, so that every call of a rollout reuses one decoder and its captured graphs."""
        from transformers import DynamicCache

        B, P = ids.shape
        length = max(self.max_seq_len, P + params.max_new_tokens)
        weights = next(self.model.parameters()).data_ptr()   # graphs read the weights where they were captured
        key = (B, length, sampling_key(params), weights)
        decoder = self._decoders.take(key, lambda: StaticDecoder(
            self.model, B, length, params, self.pad_token_id, self.device,
            self.check_every or default_check_every(self.device), capture=self.device.type == "cuda",
            width_step=self.width_step))

        def prefill():
            cache = DynamicCache()
            logits, _ = self._prefill(ids, attn, cache)
            return logits, [(layer.keys, layer.values) for layer in cache.layers]

        try:
            return decoder.run(prefill, attn, positions(attn)[:, -1:], draws, step_guard=self._steps.reading)
        finally:
            self._decoders.give(key, decoder)

    def sleep(self) -> None:
        """The static decode's buffers and graphs go (a trainer sharing the device gets them); the next
        generate stage builds and captures them again."""
        self._decoders.clear()

    def paused(self):
        """Every generate call in flight stops before its next forward (prefill or decode step) until the
        update is in (`RolloutEngine.paused`)."""
        return self._steps.writing()

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
        from ..sync.weight_sync import checksum
        return checksum(self.named_weights())
