"""DAPO's pieces (Yu et al. 2025, arXiv:2503.14476) as pure functions: overlong reward shaping, the
dynamic-sampling group filter, and which responses were cut by the length limit.

* **Overlong shaping** ("soft overlong punishment", DAPO eq. 13). A response of length L against a
  limit ``max_len`` and a buffer of ``buffer_len`` tokens gets, on top of its reward,

      0                                                   L <= max_len - buffer_len
      (max_len - buffer_len - L) / buffer_len * factor    max_len - buffer_len < L <= max_len
      -factor                                             L > max_len

  so the penalty grows linearly from 0 to ``-factor`` over the last ``buffer_len`` tokens before
  the limit (verl's ``overlong_buffer``: ``min(-(L - (max_len - buffer)) / buffer * factor, 0)``).
  Why: a response cut by the limit is scored like a finished one although it never answered; the
  soft penalty tells the policy "shorter" before it hits the wall, without the noise of a flat -1.
* **Dynamic sampling** (DAPO section 3.2). A group whose rewards are all equal has advantage 0 on
  every row (``grpo.py``): it costs a full forward/backward and moves nothing, so the effective
  batch shrinks as accuracy goes to 0 or 1. ``constant_groups`` says which groups carry no signal;
  the trainer retires them from the dock and draws more prompts instead.
* **Truncated rows.** ``truncated`` marks responses that hit the length limit without a stop token:
  what overlong filtering drops from the loss (DAPO's "overlong filtering"), and the
  ``response/truncated_fraction`` metric.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence

import torch

from .grpo import GroupIndex, group_keys


def overlong_penalty(lengths: torch.Tensor | Sequence[int], max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong penalty per response: ``[batch] lengths -> [batch]`` float32, each in
    ``[-penalty_factor, 0]`` (see the module doc for the formula).

    ``buffer_len = 0`` turns it off (all zeros). Raises ValueError for ``buffer_len`` outside
    ``[0, max_len]``, ``max_len < 1`` or a negative ``penalty_factor``.
    """
    if max_len < 1:
        raise ValueError(f"overlong_penalty: max_len={max_len}; it must be >= 1 (the response length limit)")
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"overlong_penalty: buffer_len={buffer_len}; it must be in [0, max_len={max_len}] "
                         "(the last tokens before the limit over which the penalty grows)")
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty: penalty_factor={penalty_factor}; it must be >= 0")
    lengths = torch.as_tensor(lengths).reshape(-1).to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, min=-float(penalty_factor), max=0.0)


def constant_groups(rewards: torch.Tensor, group_index: GroupIndex, atol: float = 0.0) -> list[Hashable]:
    """The groups whose rewards are all equal (max - min <= ``atol``), in order of first appearance:
    the groups dynamic sampling drops. A group of one row is constant (it has no sibling to differ
    from, and GRPO then gives it its raw reward, not a comparison).

    Args:
        rewards: one scalar per row, ``[batch]``.
        group_index: each row's group (prompt) label, as ``grpo_advantages`` takes it.
        atol: rewards this close count as equal (0: exactly equal, verl's ``std == 0``).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch] (one scalar per response), got shape {tuple(rewards.shape)}")
    keys = group_keys(group_index)
    if len(keys) != rewards.shape[0]:
        raise ValueError(f"group_index has {len(keys)} entries but rewards has {rewards.shape[0]} rows")
    if atol < 0:
        raise ValueError(f"atol={atol}; it must be >= 0")
    values: dict = defaultdict(list)
    for key, r in zip(keys, rewards.detach().double().tolist()):
        values[key].append(r)
    return [k for k, v in values.items() if max(v) - min(v) <= atol]


def truncated(responses: Sequence[torch.Tensor], max_len: int, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """``[batch]`` bool: the response reached ``max_len`` tokens and its last token is no stop token
    (it was cut by the limit, not finished). A response that ends exactly at the limit with a stop
    token is finished."""
    stops = set(int(s) for s in stop_token_ids)
    out = []
    for r in responses:
        r = torch.as_tensor(r).reshape(-1)
        out.append(int(r.numel()) >= max_len and (r.numel() == 0 or int(r[-1]) not in stops))
    return torch.tensor(out, dtype=torch.bool)
