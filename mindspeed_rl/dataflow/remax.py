"""ReMax (REINFORCE with a greedy baseline) as data.

Besides the sampled response, the actor answers each prompt greedily (its own MFC, reading the
same rollout engine), the rule reward scores both, and the advantage of every token is the sampled
response's reward-to-go minus the greedy response's reward (Li et al., 2023). No critic: the
greedy answer is the baseline. The greedy pass reuses `generate` and `rule_reward` through key
remaps, so ReMax needs no new worker code beyond its advantage function.
"""
from __future__ import annotations

from .dataset import DATASET_KEYS  # the columns the dataset puts into the dock
from .mfc import MFCDef
from .options import FULL, AlgorithmOptions, old_log_prob_mfcs, reference_mfcs, reward_mfcs, train_inputs


def remax_mfcs(options: AlgorithmOptions = FULL) -> list[MFCDef]:
    """ReMax's MFCs."""
    return [
        MFCDef("actor_rollout", "actor", "generate",
               ("prompts", "prompt_length"), ("responses", "response_length", "weight_version", "rollout_log_prob")),
        MFCDef("actor_greedy_rollout", "actor", "generate",
               ("prompts", "prompt_length"), ("greedy_responses",), fn="generate_greedy",
               output_key_remap={"responses": "greedy_responses"}),
        *reward_mfcs(options),
        *reward_mfcs(options, responses="greedy_responses", out="reward_baselines", prefix="greedy_"),
        *reference_mfcs(options),
        *old_log_prob_mfcs(options),
        MFCDef("compute_advantage", "advantage", "compute",
               ("rm_scores", "reward_baselines", "response_length"), ("advantages",),
               fn="remax_advantage"),
        MFCDef("actor_train", "actor", "train_step",
               train_inputs(options, "prompts", "responses", "old_log_prob", "ref_log_prob", "rollout_log_prob",
                            "advantages"), ()),
    ]
