"""reward_model, rl_config.reward_weights / reward_fn and the reward-modeling keys: validation names the key."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import config_from_dict, check_config

from .helpers import error_of, with_overrides

ON = {"reward_model.enable": True, "reward_model.model_path": "/some/rm"}


def test_defaults_are_off_and_weights_train_on_the_model_alone():
    cfg = config_from_dict({})
    assert cfg.reward_model.enable is False and cfg.reward_model.model_path is None
    assert cfg.rl_config.reward_weights == {"model": 1.0, "rule": 0.0}
    check_config(config_from_dict(with_overrides(ON)))


@pytest.mark.parametrize("overrides,message", [
    ({**ON, "rl_config.reward_weights": {"model": 0.0, "rule": 0.0}}, "every weight is 0"),
    ({**ON, "rl_config.reward_weights": {"critic": 1.0}}, r"rl_config.reward_weights.critic: unknown reward source"),
    ({**ON, "rl_config.reward_weights": {"model": "high"}}, r"rl_config.reward_weights.model='high': must be a number"),
    ({**ON, "rl_config.reward_fn": None, "rl_config.reward_weights": {"model": 1.0, "rule": 0.5}},
     r"rl_config.reward_weights.rule=0.5 but rl_config.reward_fn is null"),
    ({"rl_config.reward_fn": None}, r"rl_config.reward_fn=null and reward_model.enable=false: nothing scores"),
    ({"reward_model.enable": True}, r"reward_model.model_path is empty; set it to a reward model"),
    ({**ON, "reward_model.dtype": "fp8"}, r"reward_model.dtype='fp8': must be one of"),
    ({**ON, "reward_model.micro_batch_size_per_device": 0}, r"reward_model.micro_batch_size_per_device=0"),
    ({"data.eval_size": -1}, r"data.eval_size=-1: must be >= 0"),
    ({"trainer.eval_interval": -2}, r"trainer.eval_interval=-2: must be >= 0"),
])
def test_errors_name_the_key(overrides, message):
    assert pytest.importorskip("re").search(message, error_of(overrides, "validate"))


RM = {"rl_config.algorithm": "reward_modeling", "rl_config.n_samples_per_prompt": 1,
      "reward_model.model_path": "builtin:tiny-qwen2", "rl_config.prompts_per_step": 64}


def test_reward_modeling_keys():
    check_config(config_from_dict(with_overrides(RM)))
    msg = error_of({**RM, "reward_model.mini_batch_size": 24, "reward_model.lr": 0.0,
                    "rl_config.n_samples_per_prompt": 2}, "validate")
    assert "reward_model.mini_batch_size=24 pairs does not divide rl_config.prompts_per_step=64" in msg
    assert "reward_model.lr=0.0: must be > 0" in msg
    assert "rl_config.n_samples_per_prompt=2: reward modeling reads each preference pair once" in msg
    assert "set the model to train from" in error_of({**RM, "reward_model.model_path": None}, "validate")
