"""`GRPOTransferDock`: the dock with MindSpeed-RL's GRPO columns and consumers fixed.

For people porting MindSpeed-RL code. The trainer builds its dock from the dataflow graph instead,
so these lists are a convenience, not the source of truth.
"""
from __future__ import annotations

from typing import Any, Sequence

from .dock import TransferDock

GRPO_COLUMNS = (
    "prompts", "prompt_length", "responses", "response_length", "input_ids", "labels", "rm_scores",
    "token_level_rewards", "old_log_prob", "ref_log_prob", "advantages", "returns",
)
GRPO_CONSUMERS = (
    "actor_rollout", "rule_reward", "reward_scores", "ref_log_prob", "actor_log_prob", "compute_advantage",
    "actor_train", "grpo_metrics",
)


class GRPOTransferDock(TransferDock):
    """A `TransferDock` with GRPO's columns and consumers; more can be added by arguments."""

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int = 1,
        extra_columns: Sequence[str] = (),
        extra_consumers: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(
            columns=[*GRPO_COLUMNS, *extra_columns],
            consumers=[*GRPO_CONSUMERS, *extra_consumers],
            prompts_num=prompts_num,
            n_samples_per_prompt=n_samples_per_prompt,
            **kwargs,
        )
