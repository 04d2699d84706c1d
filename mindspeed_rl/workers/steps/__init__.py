"""The built-in compute steps, one module each, named after the step: a module holds the step's declaration
(`compute.compute_step`), its class (`impls.Impl`: arguments from the config, the call on a micro-batch) and the
function that computes it, so a step is read and changed in one place. Importing this one list registers every
built-in in `compute.FUNCTIONS`, in its order (each base before its subclasses, which also import their base's
module themselves: agent_generate -> generate, value_train and reward_train -> policy_train); the package imports
it (`workers/__init__.py`), so whatever reads FUNCTIONS through `workers` finds the built-ins. A user's steps
register the same way from a `trainer.plugins` module.
"""
from . import (generate, log_probs, values, rule_reward, grpo_advantage, gae_advantage, remax_advantage,  # noqa: F401
               policy_train, value_train, agent_generate, reward_model_score, combine_reward, reward_train)

BUILTIN_STEP_MODULES = (generate, log_probs, values, rule_reward, grpo_advantage, gae_advantage, remax_advantage,
                        policy_train, value_train, agent_generate, reward_model_score, combine_reward, reward_train)
