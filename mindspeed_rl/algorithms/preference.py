"""Reward-model math: the Bradley-Terry pairwise loss, its accuracy and margin, where a sequence
classifier's score is read, and how a model score and a rule score combine into one reward.

A reward model gives one scalar per (prompt, response). Trained on preference pairs (the same prompt
with a `chosen` and a `rejected` response), Bradley-Terry models the probability that `chosen` is
preferred as sigmoid(r_chosen - r_rejected); its negative log-likelihood is the loss
(OpenRLHF's `PairWiseLoss`, InstructGPT's reward-model loss):

    loss     = mean_i -log sigmoid(c_i - r_i)
    accuracy = mean_i [c_i > r_i]          (a tie is not a win)
    margin   = mean_i (c_i - r_i)

`-logsigmoid` is computed by `F.logsigmoid`, which stays finite for large negative differences.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ..config.vocab import REWARD_SOURCES


def _pair(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = torch.as_tensor(chosen), torch.as_tensor(rejected)
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen and rejected scores must be two 1-D tensors of one shape [pairs]; got "
                         f"{tuple(chosen.shape)} and {tuple(rejected.shape)}")
    if chosen.numel() == 0:
        raise ValueError("no preference pairs: chosen and rejected scores are empty")
    return chosen, rejected


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """`-logsigmoid(chosen - rejected).mean()`: [pairs], [pairs] -> scalar (with grad)."""
    chosen, rejected = _pair(chosen, rejected)
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The fraction of pairs whose chosen response scores strictly higher."""
    chosen, rejected = _pair(chosen, rejected)
    return float((chosen.detach().float() > rejected.detach().float()).float().mean())


def preference_margin(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The mean of chosen - rejected."""
    chosen, rejected = _pair(chosen, rejected)
    return float((chosen.detach().float() - rejected.detach().float()).mean())


def last_token_scores(token_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's score of each row: its per-position output at the row's last real token.

    `token_scores` [B, T] (the one-label head applied at every position), `attention_mask` [B, T]
    (1 on real tokens). The last real token is the highest position the mask sets, so the rows may be
    padded on the left, on the right or both (a left-padded prompt and a right-padded response) and a
    row gets the same score whatever its padding. A row with no real token is refused.
    """
    if token_scores.shape != attention_mask.shape or token_scores.dim() != 2:
        raise ValueError(f"token_scores and attention_mask must share one [batch, tokens] shape; got "
                         f"{tuple(token_scores.shape)} and {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    empty = (~real.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have no real token (attention mask all 0): nothing to score")
    positions = torch.arange(real.shape[1], device=real.device).expand_as(real)
    last = torch.where(real, positions, torch.full_like(positions, -1)).max(-1).values
    return token_scores.gather(1, last.unsqueeze(1)).squeeze(1)


def combine_rewards(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> torch.Tensor:
    """The reward that trains: sum over sources of weight x score, [rows] each.

    `scores` maps a source of `REWARD_SOURCES` ("model": the reward model's score, "rule": the rule
    reward) to its [rows] scores; `weights` maps every source to its weight (a source with weight 0
    still needs no score). Raises ValueError for a source with a weight but no score."""
    unknown = sorted(set(weights) - set(REWARD_SOURCES))
    if unknown:
        raise ValueError(f"reward weights name {unknown}; the sources are {list(REWARD_SOURCES)}")
    total = None
    for source in REWARD_SOURCES:
        w = float(weights.get(source, 0.0))
        if w == 0.0:
            continue
        if source not in scores:
            raise ValueError(f"reward weight {source}={w} but no {source} score was computed")
        part = w * torch.as_tensor(scores[source]).float()
        total = part if total is None else total + part
    if total is None:
        some = next(iter(scores.values()), None)
        if some is None:
            raise ValueError("no reward source has a weight and no score was given")
        return torch.zeros_like(torch.as_tensor(some).float())
    return total
