"""A new algorithm is one module with its MFC list plus one `register_algorithm` line."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import (ALGORITHMS, MFCDef, algorithm_graph, get_algorithm, known_algorithms,
                                   register_algorithm)
from mindspeed_rl.planning import make_plan

from ..config.helpers import with_overrides


def reinforce_mfcs(options) -> list[MFCDef]:
    """GRPO without the old log-probs: rollout, rule reward, group advantage, train on the rollout's log-probs."""
    return [
        MFCDef("actor_rollout", "actor", "generate", ("prompts", "prompt_length"),
               ("responses", "response_length", "weight_version", "rollout_log_prob")),
        MFCDef("rule_reward", "reward", "compute", ("prompts", "responses", "labels"), ("rm_scores",),
               fn="rule_reward"),
        MFCDef("compute_advantage", "advantage", "compute", ("rm_scores",), ("advantages",), get_n_samples=True,
               fn="grpo_advantage"),
        MFCDef("actor_train", "actor", "train_step", ("prompts", "responses", "rollout_log_prob", "advantages"), (),
               input_key_remap={"rollout_log_prob": "old_log_prob"}),
    ]


@pytest.fixture
def reinforce():
    register_algorithm("Reinforce", reinforce_mfcs)
    yield "reinforce"
    ALGORITHMS.pop("reinforce")


def test_a_registered_algorithm_builds_and_plans(reinforce):
    assert reinforce in known_algorithms()
    mfcs, keys = get_algorithm("REINFORCE")
    assert [m.name for m in mfcs] == ["actor_rollout", "rule_reward", "compute_advantage", "actor_train"]
    assert keys == ("prompts", "prompt_length", "labels")
    assert algorithm_graph(reinforce).graph["name"] == reinforce
    plan = make_plan(config_from_dict(with_overrides({"rl_config.algorithm": reinforce})), check_files=False)
    assert [m.name for m in plan.order] == [m.name for m in mfcs]


@pytest.mark.parametrize("args, message", [
    (("", reinforce_mfcs), "name='' must be a non-empty string"),
    (("x", "not a function"), "must be a function of AlgorithmOptions"),
    (("x", reinforce_mfcs, "prompts"), "dataset_keys='prompts' must be a sequence of column names"),
])
def test_register_algorithm_refuses_a_bad_entry(args, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        register_algorithm(*args)
    assert "x" not in ALGORITHMS
