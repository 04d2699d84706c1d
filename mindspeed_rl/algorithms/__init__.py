"""GRPO / PPO / ReMax math as small pure torch functions, following verl's ``core_algos.py`` conventions.

Per-token tensors are ``[batch, response_len]`` with a response mask (1 = real token, 0 = padding).

* ``functional``: masked reductions and whitening, log-probs / entropy from logits, and
  ``outcome_token_rewards`` (one score per response, placed on its last token).
* ``grpo``: group-relative advantages (no critic).
* ``ppo``: GAE advantages and returns, and the clipped value loss for the critic.
* ``remax``: reward-to-go minus the greedy response's reward (no critic).
* ``losses``: loss aggregation and the clipped policy loss shared by all of them.
* ``kl``: KL penalty estimators and coefficient controllers.
* ``off_policy``: behaviour importance weights (none / TIS / decoupled) for training on stale rollouts.
* ``metrics``: the metric naming rule (``_max`` maxed, ``_min`` minned, the rest summed) every layer
  combines reports with.
* ``dapo``: DAPO's overlong reward shaping, the dynamic-sampling group filter, truncated responses.
* ``preference``: reward models: the Bradley-Terry pairwise loss, accuracy and margin, the score at a
  sequence's last token, and model + rule rewards combined by weight.
"""
from .functional import (
    entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_token_rewards,
)
from .dapo import constant_groups, overlong_penalty, truncated
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
from .off_policy import OFF_POLICY_CORRECTIONS, behaviour_weights, corrected_policy_loss
from .ppo import gae_advantages, value_loss
from .preference import (REWARD_SOURCES, bradley_terry_loss, combine_rewards, last_token_scores,
                         preference_accuracy, preference_margin)
from .remax import remax_advantages

__all__ = [
    "AGG_MODES",
    "KL_CONTROLLER_KINDS",
    "KL_KINDS",
    "OFF_POLICY_CORRECTIONS",
    "REWARD_SOURCES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "behaviour_weights",
    "bradley_terry_loss",
    "broadcast_to_tokens",
    "combine_rewards",
    "constant_groups",
    "corrected_policy_loss",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "last_token_scores",
    "log_probs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "preference_accuracy",
    "preference_margin",
    "remax_advantages",
    "truncated",
    "value_loss",
]
