"""GRPO as data: the list of its model function calls (stage names as in MindSpeed-RL).

One step: the actor generates n responses per prompt; a rule reward scores them against the
reference answers; the frozen reference model (only when the loss has a KL term:
`AlgorithmOptions.use_reference`) and the actor (before the update) give per-token log-probs;
advantages are normalized within each prompt's n responses; the actor trains.
Everything else (dock columns, consumers, order, weight syncs) is derived by `build_graph`.
"""
from __future__ import annotations

from .dataset import DATASET_KEYS  # the columns the dataset puts into the dock
from .mfc import MFCDef
from .options import FULL, AlgorithmOptions, old_log_prob_mfcs, reference_mfcs, reward_mfcs, train_inputs


def grpo_mfcs(options: AlgorithmOptions = FULL) -> list[MFCDef]:
    """GRPO's MFCs. To add a stage or a column, add or edit one line here."""
    return [
        MFCDef("actor_rollout", "actor", "generate",
               ("prompts", "prompt_length"), ("responses", "response_length", "weight_version", "rollout_log_prob")),
        *reward_mfcs(options),
        *reference_mfcs(options),
        *old_log_prob_mfcs(options),
        MFCDef("compute_advantage", "advantage", "compute",
               ("rm_scores",), ("advantages",), get_n_samples=True, fn="grpo_advantage"),
        MFCDef("actor_train", "actor", "train_step",
               train_inputs(options, "prompts", "responses", "response_length", "old_log_prob", "ref_log_prob",
                            "rollout_log_prob", "advantages"), ()),
    ]
