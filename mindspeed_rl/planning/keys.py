"""The config keys the plan's messages name from more than one place, each spelled once here, so a message
names a key as the config spells it wherever the plan refuses or notes it. A key one function names stays
beside its message."""
from __future__ import annotations

# model name (dataflow) -> its config section
SECTION_OF = {"actor": "actor_config", "ref": "ref_config", "critic": "critic_config"}
REWARD_SECTION = "reward_model"
ACTOR = SECTION_OF["actor"]

ALGORITHM_KEY = "rl_config.algorithm"
PROMPTS_PER_STEP_KEY = "rl_config.prompts_per_step"
PARTIAL_ROLLOUT_KEY = "rl_config.partial_rollout"
SIMULATE_KEY = "trainer.simulate_cost_s_per_row"
ROLLOUT_BACKEND_KEY = "generate_config.backend"
ROLLOUT_MICRO_BATCH_KEY = "generate_config.micro_batch_size_per_device"
TRAIN_BACKEND_KEY = f"{ACTOR}.backend"
OFF_POLICY_KEY = f"{ACTOR}.off_policy_correction"
LORA_RANK_KEY = f"{ACTOR}.lora.rank"
TOKEN_BUDGET_KEY = f"{ACTOR}.max_tokens_per_micro_batch"
PLACEMENT_MODE_KEY = "placement.mode"
GROUPS_KEY = "placement.groups"
MESH_KEY = "placement.mfcs"


def path_key(model: str) -> str:
    """The key of a model's checkpoint path (actor_config.model_path, reward_model.model_path, ...)."""
    return f"{REWARD_SECTION if model == 'reward' else SECTION_OF[model]}.model_path"
