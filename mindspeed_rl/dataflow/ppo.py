"""PPO with a critic as data: GRPO's stages plus critic inference and critic training.

The critic (a value head on the policy's backbone, verl's `AutoModelForTokenClassification`
critic) scores every response token; GAE turns the outcome reward and those values into per-token
advantages and returns; the actor trains on the advantages and the critic regresses the returns.
Both trained models get a version edge (actor_train -> actor_rollout, critic_train ->
critic_values), so the trainer syncs both without a line of PPO-specific code.
"""
from __future__ import annotations

from .dataset import DATASET_KEYS  # the columns the dataset puts into the dock
from .mfc import MFCDef
from .options import FULL, AlgorithmOptions, old_log_prob_mfcs, reference_mfcs, reward_mfcs, train_inputs


def ppo_mfcs(options: AlgorithmOptions = FULL) -> list[MFCDef]:
    """PPO's MFCs (verl's names for the columns)."""
    return [
        MFCDef("actor_rollout", "actor", "generate",
               ("prompts", "prompt_length"), ("responses", "response_length", "weight_version", "rollout_log_prob")),
        *reward_mfcs(options),
        *reference_mfcs(options),
        *old_log_prob_mfcs(options),
        MFCDef("critic_values", "critic", "inference",
               ("prompts", "responses"), ("values",), fn="values"),
        MFCDef("compute_advantage", "advantage", "compute",
               ("rm_scores", "values"), ("advantages", "returns"), fn="gae_advantage"),
        MFCDef("actor_train", "actor", "train_step",
               train_inputs(options, "prompts", "responses", "old_log_prob", "ref_log_prob", "rollout_log_prob",
                            "advantages"), ()),
        MFCDef("critic_train", "critic", "train_step",
               ("prompts", "responses", "values", "returns"), (), fn="value_train"),
    ]
