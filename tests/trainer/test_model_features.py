"""A model's features (token budget, checkpointing, LoRA, offload) reach its engine declaration, and the plan
refuses those its group's backend or device cannot give, before any worker starts."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.engines import register_train_backend, TorchTrainEngine
from mindspeed_rl.engines.registry import TRAIN_BACKENDS
from mindspeed_rl.planning import make_plan
from mindspeed_rl.planning.features import features_of
from mindspeed_rl.planning.plan import model_sections

from ..config.helpers import with_overrides


def _plan(overrides: dict):
    return make_plan(config_from_dict(with_overrides(overrides)), check_files=False)


def test_each_model_gets_its_own_sections_features():
    models = model_sections(config_from_dict(with_overrides({
        "actor_config.max_tokens_per_micro_batch": 512, "actor_config.gradient_checkpointing": True,
        "actor_config.lora.rank": 8, "critic_config.gradient_checkpointing": False,
        "critic_config.max_tokens_per_micro_batch": 256, "ref_config.offload": True})))
    actor = features_of(models, "actor", trained=True)
    assert actor["max_tokens_per_micro_batch"] == 512 and actor["gradient_checkpointing"] is True
    assert actor["lora"]["rank"] == 8 and "offload" not in actor
    assert features_of(models, "actor", trained=False) == {"max_tokens_per_micro_batch": 512}   # a reader
    assert features_of(models, "ref", trained=False) == {
        "max_tokens_per_micro_batch": 512, "offload": {"params": True, "optimizer": False, "fsdp_cpu_offload": False}}
    assert features_of(models, "critic", trained=True) == {"max_tokens_per_micro_batch": 256}
    assert features_of(model_sections(config_from_dict({})), "actor", trained=True) == {}


@pytest.mark.parametrize("overrides, words", [
    ({"actor_config.offload.params": True}, r"actor_config.offload=\{'params': True\}: worker group 'integrated' "
                                            r"runs on the cpu"),
    ({"ref_config.offload": True, "actor_config.kl_loss_coef": 0.01}, r"ref_config.offload=true: worker group"),
])
def test_offload_on_a_cpu_group_is_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        _plan(overrides)


def test_a_backend_without_a_feature_refuses_it_naming_those_that_have_it():
    register_train_backend("plain_plugin", TorchTrainEngine)   # a plugin that declares no features
    try:
        with pytest.raises(ConfigError, match=r"actor_config.gradient_checkpointing=True: the plain_plugin train "
                                              r"backend does not implement gradient_checkpointing; backends that "
                                              r"do: \['torch', 'fsdp'"):
            _plan({"actor_config.backend": "plain_plugin", "actor_config.gradient_checkpointing": True})
        _plan({"actor_config.backend": "plain_plugin"})   # nothing asked: nothing refused
    finally:
        TRAIN_BACKENDS.pop("plain_plugin")
