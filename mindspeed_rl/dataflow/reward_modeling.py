"""Reward modeling as data: one train_step MFC over a preference dataset (ReaLHF expresses reward
modeling and SFT the same way: a graph of one MFC, run by the same trainer as RL).

A row of the dock is one preference pair: the prompt and two responses, `chosen` and `rejected`
(`data/preferences.py` tokenizes them into these columns). `rm_train` trains the `reward` model (a
one-label sequence classifier) with the Bradley-Terry loss on the two scores (`algorithms/preference.py`);
`rl_config.prompts_per_step` counts pairs and `n_samples_per_prompt` is 1. The model is trained and
read by nothing else, so its version edge is a self-loop and no weights move between workers.
"""
from __future__ import annotations

from .mfc import MFCDef
from .options import FULL, AlgorithmOptions

PROMPTS, CHOSEN, REJECTED = "prompts", "chosen", "rejected"
DATASET_KEYS = (PROMPTS, CHOSEN, REJECTED)  # token ids, no padding: the pair's prompt, the preferred response, the other


def reward_modeling_mfcs(options: AlgorithmOptions = FULL) -> list[MFCDef]:
    """Reward modeling's one MFC (the options of RL graphs change nothing here)."""
    return [MFCDef("rm_train", "reward", "train_step", DATASET_KEYS, (), fn="reward_train")]
