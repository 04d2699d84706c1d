"""The names a config value may take where code above the config switches on them, each written once.

`checks.py` refuses any other value (its message lists the tuple), `algorithms/` switches on the
same tuples and names them in its own errors, and tests/config/test_docs.py checks that
docs/configs.md lists exactly them. They live here, in layer 1, because the config is the lowest
layer that reads them (lower layers never import higher ones: algorithms/ imports them from here,
not the other way round). Pure Python: importing this imports nothing else.
"""
from __future__ import annotations

# actor_config.loss_agg_mode / critic_config.loss_agg_mode: how per-token losses become one number
# (algorithms/losses.py `agg_loss`)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# actor_config.kl_loss_type: the per-token KL estimator (algorithms/kl.py `kl_penalty`), every accepted
# name grouped by the estimator it selects: k1 = kl, abs, k2 = mse, k3 = low_var_kl (J. Schulman,
# "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html)
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

# actor_config.kl_ctrl: how the KL coefficient moves (algorithms/kl.py `make_kl_controller`)
KL_CONTROLLER_KINDS = ("fixed", "adaptive")

# rl_config.reward_weights: the sources of the reward that trains, each weighted (algorithms/preference.py
# `combine_rewards`): the reward model's score (reward_model.enable) and the rule reward (rl_config.reward_fn)
REWARD_SOURCES = ("model", "rule")

# generate_config.agent.syntax: how a tool call and its result are written (agent/syntax.py)
AGENT_SYNTAXES = ("tags", "json")
