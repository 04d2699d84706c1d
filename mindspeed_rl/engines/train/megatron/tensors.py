"""The megatron backend's pure-torch pieces: rows right-padded for a causal model without an attention
mask, and log-probs (with entropies) from vocab-sharded logits with exact gradients. They run anywhere
(tests/engines/test_megatron_convert.py checks them on the CPU)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


@dataclass
class RightPadded:
    """Rows laid out for a causal model without an attention mask (see the module doc)."""
    tokens: torch.Tensor          # [B, S] long: prompt then response, then pad
    position_ids: torch.Tensor    # [B, S] long: 0.. along each row (pads continue counting; unseen by real tokens)
    targets: torch.Tensor         # [B, S] long: tokens shifted left by one (the token each column predicts)
    index: torch.Tensor           # [B, R] long: the column predicting each response token (0 on padding)
    response_mask: torch.Tensor   # [B, R] float: 1 on real response tokens

    def to(self, device) -> "RightPadded":
        return RightPadded(*(t.to(device) for t in (self.tokens, self.position_ids, self.targets, self.index,
                                                    self.response_mask)))

    @property
    def rows(self) -> int:
        """Real rows (`tokens` may carry dummy rows after them, see `padded_to`)."""
        return self.index.shape[0]

    def padded_to(self, rows: int, width: int, pad_id: int) -> "RightPadded":
        """The same rows in a [rows, width] token block: pipeline stages exchange activations of one
        shape for every micro-batch, so with pp > 1 a step's micro-batches are padded to the largest.
        Extra columns are right padding (causal: unseen by real tokens); extra rows are all padding and
        are cut off before the loss (`index` and `response_mask` keep the real rows only)."""
        b, s = self.tokens.shape
        if rows < b or width < s:
            raise ValueError(f"cannot pad a [{b}, {s}] batch to [{rows}, {width}]")
        tokens = torch.full((rows, width), int(pad_id), dtype=self.tokens.dtype, device=self.tokens.device)
        tokens[:b, :s] = self.tokens
        targets = torch.full_like(tokens, int(pad_id))
        targets[:, :-1] = tokens[:, 1:]
        positions = torch.arange(width, device=tokens.device).expand(rows, width).contiguous()
        return RightPadded(tokens, positions, targets, self.index, self.response_mask)


def right_padded(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int,
                 multiple_of: int = 1) -> RightPadded:
    """Prompt + response of each row from column 0, right-padded to the longest row (rounded up to
    `multiple_of`). Response token t of row i is predicted by column len(prompt_i) + t - 1."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: need as many, at least one")
    lengths = [(int(p.numel()), int(r.numel())) for p, r in zip(prompts, responses)]
    if any(p == 0 for p, _ in lengths):
        raise ValueError("an empty prompt: the first response token would have no position predicting it")
    width = max(p + r for p, r in lengths)
    width = -(-width // multiple_of) * multiple_of
    rwidth = max(1, max(r for _, r in lengths))
    tokens = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
    index = torch.zeros((len(prompts), rwidth), dtype=torch.long)
    mask = torch.zeros((len(prompts), rwidth), dtype=torch.float32)
    for i, ((p, r), pr, rs) in enumerate(zip(lengths, prompts, responses)):
        tokens[i, :p] = torch.as_tensor(pr, dtype=torch.long)
        tokens[i, p:p + r] = torch.as_tensor(rs, dtype=torch.long)
        index[i, :r] = torch.arange(p - 1, p + r - 1)
        mask[i, :r] = 1.0
    targets = torch.cat([tokens[:, 1:], torch.full((len(prompts), 1), int(pad_id), dtype=torch.long)], dim=1)
    positions = torch.arange(width).expand(len(prompts), width).contiguous()
    return RightPadded(tokens, positions, targets, index, mask)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group in the forward, identity in the backward: every rank then computes the same
    loss from the sum, so each rank's local term gets the loss's gradient once (megatron's
    `reduce_from_tensor_model_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _AllReduceSum.apply(x, group)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                             vocab_size: int | None = None, group=None,
                             with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target and the entropy, from this rank's slice of the vocab.

    logits: [..., V_local] float, this rank's columns vocab_start .. vocab_start + V_local of the
    (padded) vocab; targets: [...] global token ids; vocab_size: the real vocab (columns at or past
    it are megatron's padding and get no probability); group: the TP group (None: one rank holds the
    whole vocab). Equal to `log_softmax(logits_full[..., :vocab_size])` at the targets, with gradients.
    """
    x = logits.float()
    local = x.shape[-1]
    valid = None
    if vocab_size is not None and vocab_start + local > vocab_size:
        valid = torch.arange(vocab_start, vocab_start + local, device=x.device) < vocab_size
        x = x.masked_fill(~valid, torch.finfo(x.dtype).min)
    m = x.detach().amax(dim=-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    # Only rank-local terms of x (and the constant m) are summed over the group, and the sums feed
    # only computations every rank repeats: that is what makes the identity backward of `_sum` exact.
    # (Entropy as sum(p * x) with p = exp(x - lse) would put the summed lse back into a local term.)
    e = (x - m.unsqueeze(-1)).exp()
    s = _sum(e.sum(-1), group)
    lse = m + s.log()
    inside = (targets >= vocab_start) & (targets < vocab_start + local)
    picked = x.gather(-1, (targets - vocab_start).clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum(torch.where(inside, picked, torch.zeros_like(picked)), group)
    logp = target_logit - lse
    if not with_entropy:
        return logp, None
    ex = e * (x if valid is None else torch.where(valid, x, torch.zeros_like(x)))
    return logp, lse - _sum(ex.sum(-1), group) / s     # H = lse - sum(p x), sum(p x) = sum(e x) / sum(e)


def chunked_vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, chunk_rows: int,
                                     temperature: float = 1.0, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_log_probs` over `chunk_rows` rows of `logits` [B, S, V_local] at a time, each chunk's logits
    divided by `temperature` and taken to fp32 only inside it: the model's 16-bit logits are the one full-size
    tensor (at 16 rows x 3,072 x 76k a fp32 copy is 15 GB). With gradients each chunk is checkpointed (its fp32
    working set freed after the forward, recomputed in the backward; the TP all-reduces run again there, on every
    rank in the same order). The same values and gradients as one call."""
    from torch.utils.checkpoint import checkpoint

    def one(x: torch.Tensor, t: torch.Tensor):
        x = x.float()
        if temperature not in (0.0, 1.0):
            x = x / temperature
        return vocab_parallel_log_probs(x, t, **kwargs)

    grad = torch.is_grad_enabled() and logits.requires_grad
    chunk_rows = max(1, int(chunk_rows))
    if logits.shape[0] <= chunk_rows:
        return one(logits, targets)
    outs = [checkpoint(one, logits[i:i + chunk_rows], targets[i:i + chunk_rows], use_reentrant=False) if grad
            else one(logits[i:i + chunk_rows], targets[i:i + chunk_rows]) for i in range(0, logits.shape[0], chunk_rows)]
    logp = torch.cat([o[0] for o in outs])
    ent = torch.cat([o[1] for o in outs]) if outs[0][1] is not None else None
    return logp, ent
