"""ReMax's advantage: REINFORCE with the greedy response's reward as the baseline.

ReMax (Li et al. 2023, arXiv:2310.10505) drops PPO's critic. For each prompt it samples one
response and also decodes one *greedy* response; the greedy response's reward is the baseline
subtracted from the sampled response's return:

    G_t = sum_{k >= t} r_k                 (reward-to-go, no discount)
    A_t = G_t - b                          (b = reward of the greedy response to the same prompt)

The baseline depends only on the prompt, not on the sampled tokens, so subtracting it leaves the
policy gradient unbiased while removing most of its prompt-to-prompt variance ("this prompt is
easy, every answer scores high"). With an outcome reward on the last token
(``outcome_token_rewards``) every real token gets ``A = score - b``.

Follows verl's ``compute_remax_outcome_advantage``.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .functional import float_dtype


def remax_advantages(
    token_rewards: torch.Tensor,
    baselines: torch.Tensor,
    mask: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantages and returns: ``[batch, len], [batch], [batch, len] -> ([batch, len], [batch, len])``.

    ``returns`` is the reward-to-go of the masked token rewards, a reverse cumulative sum along
    the response, ``(r * mask).flip(-1).cumsum(-1).flip(-1)``; ``advantages = returns -
    baselines[:, None] * mask``. Not whitened: the baseline already centres the advantage, and ReMax
    keeps its scale. As in verl, a padding slot in the middle of a response keeps the reward-to-go of
    the tokens after it and gets no baseline subtracted; padding after the last token gets 0 in both.

    Token rewards in padding slots are replaced by 0 with ``torch.where`` before summing, so a
    NaN/inf there cannot spread back through the cumulative sum into the real tokens.

    Computed under ``torch.no_grad``: advantages and returns are fixed weights, not differentiated.

    Raises:
        ValueError: ``token_rewards`` and ``mask`` are not one 2-D shape, or ``baselines`` is not
            ``[batch]``.
    """
    if token_rewards.shape != mask.shape or token_rewards.dim() != 2:
        raise ValueError(
            "token_rewards and mask must share one 2-D [batch, response_len] shape; got "
            f"{tuple(token_rewards.shape)} and {tuple(mask.shape)}. Turn a [batch] score into token "
            "rewards with outcome_token_rewards first"
        )
    if baselines.dim() != 1 or baselines.shape[0] != token_rewards.shape[0]:
        raise ValueError(
            f"baselines must be [batch] = [{token_rewards.shape[0]}] (the greedy response's reward, one "
            f"per row), got shape {tuple(baselines.shape)}"
        )

    with torch.no_grad():
        dtype = float_dtype(token_rewards, baselines)
        rewards, baselines = token_rewards.to(dtype), baselines.to(dtype)
        mask_f = mask.to(dtype)
        kept = torch.where(mask != 0, rewards, torch.zeros_like(rewards)) * mask_f
        returns = kept.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - baselines.unsqueeze(-1) * mask_f
    return advantages, returns
