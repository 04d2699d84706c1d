"""GRPO's group-relative advantage (outcome reward: one scalar per response).

GRPO drops PPO's value network. For each prompt it samples a *group* of responses, scores each
with one scalar reward, and uses "how much better than my siblings" as the advantage:

    A_i = (r_i - mean(group)) / (std(group) + eps)        (norm_by_std=True, the GRPO paper)
    A_i =  r_i - mean(group)                              (norm_by_std=False, Dr. GRPO)

The same scalar is then given to every real token of the response (``broadcast_to_tokens``).

Follows verl's ``compute_grpo_outcome_advantage`` exactly:

* ``std`` is the *unbiased* (Bessel-corrected, n-1) standard deviation, ``torch.std``'s default.
* ``eps`` is added to the std, not inside a square root.
* A group with a single response has no siblings to compare against; verl then uses mean 0 and
  std 1, so that response's advantage is its raw reward, ``r / (1 + eps)`` (not 0).
* A group whose rewards are all equal has std 0 and every advantage is ``0 / eps = 0``: such a
  group carries no learning signal, which is the intended behaviour.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence, Union

import torch

GroupIndex = Union[torch.Tensor, Sequence[Hashable]]


def group_keys(group_index: GroupIndex) -> list:
    """The group label of each row as a plain Python list (tensor ints, numpy values, uid strings)."""
    if isinstance(group_index, torch.Tensor):
        return group_index.reshape(-1).tolist()
    if hasattr(group_index, "tolist"):  # numpy arrays: turn np.int64 etc. into Python scalars
        return list(group_index.tolist())
    return list(group_index)


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: GroupIndex,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Group-normalised advantage of each response: ``[batch] -> [batch]``.

    Args:
        rewards: one scalar reward per response, shape ``[batch]``. (verl sums token-level rewards
            first; do that before calling if your rewards are per token.)
        group_index: for each row, which prompt it answers; any hashable labels (ints, uid strings)
            as a list, numpy array or tensor. Rows of one group need not be adjacent.
        eps: added to the group std so an all-equal group divides by ``eps`` instead of 0.
        norm_by_std: divide by the group std (GRPO) or only subtract the group mean (Dr. GRPO).

    Returns:
        Advantages, shape ``[batch]``, same floating dtype as ``rewards``, detached from the graph:
        the advantage is a fixed weight on the policy gradient, never something to differentiate.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch] (one scalar per response), got shape {tuple(rewards.shape)}")
    keys = group_keys(group_index)
    if len(keys) != rewards.shape[0]:
        raise ValueError(f"group_index has {len(keys)} entries but rewards has {rewards.shape[0]} rows")

    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()

    rows_of_group: dict = defaultdict(list)
    for row, key in enumerate(keys):
        rows_of_group[key].append(row)

    advantages = torch.empty_like(rewards)
    with torch.no_grad():
        for rows in rows_of_group.values():
            rows_t = torch.tensor(rows, device=rewards.device)
            group = rewards[rows_t]
            if len(rows) == 1:
                # No siblings: verl's convention, the reward passes through (up to the 1 + eps).
                mean, std = group.new_tensor(0.0), group.new_tensor(1.0)
            else:
                mean, std = group.mean(), group.std(correction=1)  # unbiased (n - 1), as torch.std defaults
            centred = group - mean
            advantages[rows_t] = centred / (std + eps) if norm_by_std else centred
    return advantages


def broadcast_to_tokens(scalar_per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give each response's scalar to all its real tokens: ``[batch], [batch, len] -> [batch, len]``.

    ``scalar_per_row[:, None] * mask``, as verl does; padding positions get 0, so a padded token
    pushes no gradient even before the loss masks it out.
    """
    if scalar_per_row.dim() != 1 or mask.dim() != 2 or scalar_per_row.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expected scalar_per_row [batch] and mask [batch, len] with equal batch, got "
            f"{tuple(scalar_per_row.shape)} and {tuple(mask.shape)}"
        )
    return scalar_per_row.unsqueeze(-1) * mask.to(scalar_per_row.dtype)
