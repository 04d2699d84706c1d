"""ReMax's advantage step: each sampled response's reward-to-go minus the reward of the greedy response to the
same prompt (its baseline, from the `generate_greedy` rollout). The per-token layout is built from the rows'
lengths here; the arithmetic is `algorithms.remax_advantages`.
"""
from __future__ import annotations

import torch

from ...algorithms import outcome_token_rewards, remax_advantages
from ...engines.batching import unpad_rows
from ..compute import Output, as_scalars, compute_step
from ..impls import Impl, compute_count


def remax_advantage(batch: dict, rows: list[int]) -> Output:
    """Reward-to-go of the sampled response minus the greedy response's reward, per token."""
    lengths = [int(torch.as_tensor(x).reshape(-1)[0]) for x in batch["response_length"]]
    width = max(1, max(lengths))
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    baselines = as_scalars(batch["reward_baselines"])
    adv, ret = remax_advantages(outcome_token_rewards(as_scalars(batch["rm_scores"]), mask), baselines, mask)
    return Output({"advantages": unpad_rows(adv, mask), "returns": unpad_rows(ret, mask)},
                  {})


@compute_step("remax_advantage", "compute", ("rm_scores", "reward_baselines", "response_length"),
              ("advantages", "returns"), doc="reward-to-go minus the greedy response's reward")
class ReMaxAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc)}

    def __call__(self, batch, rows):
        return remax_advantage(batch, rows)
