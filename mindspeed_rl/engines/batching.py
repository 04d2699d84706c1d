"""Rows (variable-length 1-D token tensors) to padded model batches and back.

Layout as verl: prompts left-padded to the longest prompt, responses right-padded to the longest
response, so every response starts at the same column and `[batch, response_len]` tensors with a
response mask line up for the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor       # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor    # [B, P + R]
    responses: torch.Tensor       # [B, R]
    response_mask: torch.Tensor   # [B, R] float, 1 on real response tokens
    prompt_width: int             # P

    @property
    def response_lengths(self) -> list[int]:
        return self.response_mask.sum(-1).long().tolist()


def left_pad(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = int(r.numel())
        if n:
            ids[i, width - n:] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - n:] = 1
    return ids, mask


def right_pad(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(int(r.numel()) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = int(r.numel())
        if n:
            ids[i, :n] = torch.as_tensor(r, dtype=torch.long)
            mask[i, :n] = 1.0
    return ids, mask


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def collate(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int) -> SequenceBatch:
    p_ids, p_mask = left_pad(prompts, pad_id)
    r_ids, r_mask = right_pad(responses, pad_id)
    attn = torch.cat([p_mask, r_mask.long()], dim=1)
    return SequenceBatch(input_ids=torch.cat([p_ids, r_ids], dim=1), attention_mask=attn,
                         position_ids=positions(attn), responses=r_ids, response_mask=r_mask,
                         prompt_width=p_ids.shape[1])


def unpad_rows(values: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """[B, R] values -> B 1-D tensors of each row's real (masked-in) length."""
    lengths = mask.sum(-1).long().tolist()
    return [values[i, :n].contiguous() for i, n in enumerate(lengths)]


def padded_tokens(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
    """Tokens a forward over these rows computes in `collate`'s layout: rows x (widest prompt +
    widest response), padding included."""
    if not prompt_lens:
        return 0
    return len(prompt_lens) * (max(prompt_lens) + max(1, max(response_lens)))


def token_budget_groups(prompt_lens: Sequence[int], response_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indexes split into groups whose padded forward (`padded_tokens`) stays within
    `max_tokens`, so no forward pads short rows to a long one (verl's dynamic batch size, with
    `collate`'s padded layout instead of packing).

    Rows are taken longest first (prompt + response; ties by index) and a group closes when the
    next row would take it over the budget; a row over the budget on its own is a group alone.
    Sorting puts rows of similar length together, which is what keeps the padding low. Each
    group lists its rows in ascending index order; every index appears exactly once.

        token_budget_groups([2, 2, 2], [8, 1, 7], 20) -> [[0, 2], [1]]   (2 x 10 = 20, then 1 x 3)
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        trial = cur + [i]
        if cur and padded_tokens([prompt_lens[j] for j in trial], [response_lens[j] for j in trial]) > max_tokens:
            groups.append(sorted(cur))
            trial = [i]
        cur = trial
    if cur:
        groups.append(sorted(cur))
    return groups


def forward_groups(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], micro_batch_size: int,
                   max_tokens: int | None) -> list[list[int]]:
    """Row indexes of each forward over these rows: `micro_batch_size` rows in order without a token
    budget; with one (`max_tokens`), `token_budget_groups` (length-sorted, at most that many padded
    tokens each)."""
    if max_tokens is None:
        n = len(prompts)
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    return token_budget_groups([int(p.numel()) for p in prompts], [int(r.numel()) for r in responses], max_tokens)


def join_groups(groups: Sequence[Sequence[int]], outputs: Sequence, response_mask: torch.Tensor):
    """The `ModelOutput`s of forwards over `groups` (row indexes) as one output over all the rows, in
    row order, with `response_mask` (the rows' own [B, R] mask, as one padded forward has it): each
    group's [b, r] tensors are right-padded with 0 to R, as one forward pads them, so a loss sees
    the same tensors whatever its aggregation. Gradients flow back to each group's forward."""
    from .base import ModelOutput

    width = response_mask.shape[1]
    device = response_mask.device
    parts: dict[str, list[torch.Tensor]] = {}
    for out in outputs:
        for key in ("log_probs", "entropy", "values"):
            t = getattr(out, key)
            if t is not None:
                parts.setdefault(key, []).append(torch.nn.functional.pad(t, (0, width - t.shape[1])))
    order = torch.tensor([i for g in groups for i in g], device=device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return ModelOutput(response_mask=response_mask, **{k: torch.cat(v)[inverse] for k, v in parts.items()})
