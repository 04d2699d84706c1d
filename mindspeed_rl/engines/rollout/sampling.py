"""Seeded next-token sampling with no generator state: one counter-based uniform per row per token,
then an inverse-CDF draw over the row's filtered distribution.

Why counter-based: a row's tokens must depend only on its seed (run seed, step, row) and its own
logits, never on the other rows, the micro-batch or the thread, so that blocking and non-blocking
runs sample the same rollouts. A `torch.Generator` per row gives that, but it forces a loop over
rows on the host (353 ms per token for 64 rows at Qwen's 151,936-token vocabulary on an H100, where
the model's forward takes ~20 ms). Here row r's t-th uniform is the t-th output of SplitMix64 seeded
with `seeds[r]`: a pure function of (seed, t), computed for every row and token at once with int64
tensor ops on the rollout's device before the loop starts.

Why inverse CDF: it needs one uniform per row (not one per vocabulary entry, as a Gumbel-max or
`torch.multinomial`'s exponential race does), so a token costs a max, an exp and a cumsum over the
vocabulary plus a `searchsorted`: a handful of vectorized kernels on a GPU, and on the CPU cheaper
than one batched `torch.multinomial` call (benchmarks/rollout_sampling.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..base import SamplingParams

# SplitMix64 (Steele, Lea, Flood 2014; the seeder of xoshiro): constants as signed int64, since
# torch has no uint64 arithmetic; int64 multiplication and addition wrap like uint64 ones.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
UNIFORM_BITS = 24  # a float32 holds 24-bit integers exactly: u = k / 2**24, k in [0, 2**24)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits: torch's `>>` is arithmetic (copies the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(state: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function applied elementwise to int64 states (the bits of uint64 ones)."""
    z = (state ^ _shr(state, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def row_uniforms(seeds: Sequence[int], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, n] float32 in [0, 1): entry (r, t) is the (t+1)-th output of SplitMix64 seeded with
    `seeds[r] mod 2**63`, top 24 bits. A pure function of (seed, t), the same on every device."""
    s = torch.tensor([int(x) % 2**63 for x in seeds], dtype=torch.long, device=device)
    t = torch.arange(1, n + 1, dtype=torch.long, device=device)
    bits = _shr(splitmix64(s[:, None] + t[None, :] * _GOLDEN), 64 - UNIFORM_BITS)
    return bits.float() * 2.0 ** -UNIFORM_BITS


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


def inverse_cdf_draw(logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r draws the first token whose cumulative probability exceeds `uniforms[r]`, from
    softmax(logits[r]) (float32; -inf = filtered out). Returns (tokens, their log-probs under that
    softmax).

    The CDF is left unnormalized (cumsum of exp(x - max)), so its last entry is the softmax's
    denominator and the log-prob is x - max - log(total), which is log_softmax's formula. A filtered
    token adds exactly 0 to the CDF, so the search cannot stop on it; a scan that rounds in a
    different order (a GPU's parallel cumsum) could in principle step up by an ulp across one, and
    such a draw (as likely as a rounding error) is redirected to the row's most likely token, so a
    filtered-out token is never returned."""
    top, top_idx = logits.max(-1, keepdim=True)
    cdf = (logits - top).exp_().cumsum_(-1)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True)
    tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    picked = logits.gather(-1, tokens)
    allowed = picked > float("-inf")
    tokens = torch.where(allowed, tokens, top_idx)
    picked = torch.where(allowed, picked, top)
    return tokens.squeeze(-1), (picked - top - total.log()).squeeze(-1)


def sample_next(logits: torch.Tensor, params: SamplingParams,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token, its log-prob under the distribution it was drawn from) per row, from the rows'
    last-position logits [rows, vocab] and one uniform per row (`row_uniforms(...)[:, t]` at token
    t). Greedy (or temperature 0) takes the argmax and the log-prob under the untempered softmax;
    otherwise temperature, top-k and top-p apply, and the log-prob is that of the filtered
    distribution. Row i reads only `logits[i]` and `uniforms[i]`: no host sync, no other row."""
    if params.greedy or params.temperature == 0:
        x = logits.float()
        tokens = x.argmax(-1)
        return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(x, -1)
    x = logits.float()  # not modified below: it may be the model's own output
    if params.temperature != 1.0:  # a full pass over the vocabulary saved at the usual T = 1
        x = x / params.temperature
    return inverse_cdf_draw(filter_logits(x, params.top_p, params.top_k), uniforms)
