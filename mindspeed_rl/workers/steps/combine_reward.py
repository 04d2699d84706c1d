"""The combined reward step (compute): the reward that trains, rl_config.reward_weights' sum of the reward
model's and (when the graph has a rule) the rule reward's scores. Its metrics give each source's sum beside
the total's, so a run shows what each source contributes whatever its weight.
"""
from __future__ import annotations

from ...algorithms import combine_rewards
from ..compute import Output, as_scalars, compute_step, scalar_rows
from ..impls import Impl, compute_count


def combine_reward(batch: dict, rows: list[int], *, weights: dict) -> Output:
    """`rm_scores` = the weighted sum of `model_scores` and (when the graph has a rule) `rule_scores`.

    Metrics: `reward_sum`/`reward_rows`/`reward_max_count` of the sum (the driver's `reward/mean`), and
    `model_reward_sum`, `rule_reward_sum` of each source alone, whatever its weight."""
    scores = {"model": as_scalars(batch["model_scores"])}
    if "rule_scores" in batch:
        scores["rule"] = as_scalars(batch["rule_scores"])
    total = combine_rewards(scores, weights)
    metrics = {"reward_sum": float(total.sum()), "reward_rows": float(len(rows)),
               "reward_max_count": float((total >= 1.0).sum())}
    for source, t in scores.items():
        metrics[f"{source}_reward_sum"] = float(t.sum())
    return Output({"rm_scores": scalar_rows(total)}, metrics)


@compute_step("combine_reward", "compute", ("model_scores",), ("rm_scores",), optional=("rule_scores",),
              doc="rl_config.reward_weights' sum of the reward model's and the rule reward's scores")
class CombineReward(Impl):
    """rl_config.reward_weights over the model's and the rule's scores."""

    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc), "weights": dict(cfg.rl_config.reward_weights)}

    def __call__(self, batch, rows):
        return combine_reward(batch, rows, weights=self.args["weights"])
