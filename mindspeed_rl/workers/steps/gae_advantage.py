"""PPO's advantage step: GAE over the outcome reward placed on each response's last token, against the
critic's values. The rows' per-token values and their lengths become padded matrices here; the recursion
itself is `algorithms.gae_advantages`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...algorithms import gae_advantages, outcome_token_rewards
from ...engines.batching import unpad_rows
from ..compute import Output, as_scalars, compute_step, rows_to_matrix
from ..impls import Impl, compute_count


def _token_matrix(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows -> ([B, width] values, [B, width] mask)."""
    width = max(1, max(int(r.numel()) for r in rows))
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        mask[i, :int(r.numel())] = 1.0
    return rows_to_matrix(rows, width), mask


def gae_advantage(batch: dict, rows: list[int], *, gamma: float, lam: float) -> Output:
    """GAE with the outcome reward on each response's last token; lengths come from the values rows."""
    v, mask = _token_matrix(batch["values"])
    rewards = outcome_token_rewards(as_scalars(batch["rm_scores"]), mask)
    adv, ret = gae_advantages(rewards, v, mask, gamma, lam)
    n = int(mask.sum())
    return Output({"advantages": unpad_rows(adv, mask), "returns": unpad_rows(ret, mask)},
                  {"returns_sum": float((ret * mask).sum()), "returns_tokens": float(n)})


@compute_step("gae_advantage", "compute", ("rm_scores", "values"), ("advantages", "returns"),
              doc="GAE over the outcome reward on the last token, whitened over the micro-batch")
class GAEAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc), "gamma": cfg.rl_config.gamma, "lam": cfg.rl_config.lam}

    def __call__(self, batch, rows):
        return gae_advantage(batch, rows, gamma=self.args["gamma"], lam=self.args["lam"])
