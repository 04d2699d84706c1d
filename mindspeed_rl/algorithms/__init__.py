"""GRPO / PPO math as small pure torch functions, following verl's ``core_algos.py`` conventions.

Per-token tensors are ``[batch, response_len]`` with a response mask (1 = real token, 0 = padding).
"""
from .functional import entropy_from_logits, log_probs_from_logits, masked_mean, masked_sum
from .grpo import broadcast_to_tokens, grpo_advantages
from .kl import (
    KL_CONTROLLER_KINDS,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)
from .losses import AGG_MODES, agg_loss, policy_loss

__all__ = [
    "AGG_MODES",
    "KL_CONTROLLER_KINDS",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "log_probs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "policy_loss",
]
