"""GRPO's graph and the values the trainer derives from it, exactly."""
import pytest

from mindspeed_rl.dataflow import (ALGORITHMS, GRPO_DATASET_KEYS, algorithm_graph, dataset_readers, describe,
                                   dock_columns, dock_consumers, get_algorithm, grpo_mfcs, known_algorithms,
                                   same_step_readers, topological_order, trained_models, version_edges,
                                   weight_sync_targets, worker_groups)
from mindspeed_rl.transfer_dock import GRPO_COLUMNS, GRPO_CONSUMERS

ORDER = ["actor_rollout", "rule_reward", "ref_log_prob", "actor_log_prob", "compute_advantage", "actor_train"]


@pytest.fixture(scope="module")
def g():
    return algorithm_graph("grpo")


def test_registry():
    assert known_algorithms() == ["grpo", "ppo", "remax", "reward_modeling"] and "grpo" in ALGORITHMS
    mfcs, keys = get_algorithm("GRPO")
    assert keys == GRPO_DATASET_KEYS == ("prompts", "prompt_length", "labels")
    assert [m.name for m in mfcs] == ORDER
    with pytest.raises(ValueError, match="unknown algorithm 'dpo'; known algorithms: grpo"):
        get_algorithm("dpo")


def test_order_columns_consumers(g):
    assert g.graph["name"] == "grpo"
    assert [m.name for m in topological_order(g)] == ORDER
    assert dock_consumers(g) == ORDER
    assert dock_columns(g) == ["prompts", "prompt_length", "labels", "responses", "response_length",
                               "weight_version", "rollout_log_prob", "rm_scores", "ref_log_prob", "old_log_prob",
                               "advantages"]
    # every derived column and consumer exists in MindSpeed-RL's fixed GRPO dock (but the rollout's version
    # and log-probs, which MindSpeed-RL does not keep)
    assert set(dock_columns(g)) - set(GRPO_COLUMNS) == {"weight_version", "rollout_log_prob"}
    assert set(dock_consumers(g)) <= set(GRPO_CONSUMERS)


def test_data_edges(g):
    data = {(u, v): d["keys"] for u, v, d in g.edges(data=True) if d["kind"] == "data"}
    assert data == {
        ("actor_rollout", "rule_reward"): ("responses",),
        ("actor_rollout", "ref_log_prob"): ("responses",),
        ("actor_rollout", "actor_log_prob"): ("responses", "rollout_log_prob"),
        ("actor_rollout", "actor_train"): ("response_length", "responses"),
        ("rule_reward", "compute_advantage"): ("rm_scores",),
        ("ref_log_prob", "actor_train"): ("ref_log_prob",),
        ("actor_log_prob", "actor_train"): ("old_log_prob",),
        ("compute_advantage", "actor_train"): ("advantages",),
    }
    assert dataset_readers(g) == {"actor_rollout": ("prompt_length", "prompts"),
                                  "rule_reward": ("labels", "prompts"), "ref_log_prob": ("prompts",),
                                  "actor_log_prob": ("prompts",), "actor_train": ("prompts",)}


def test_versions_and_weight_sync(g):
    assert version_edges(g) == [("actor_train", "actor_rollout", "actor")]
    assert trained_models(g) == {"actor": "actor_train"}
    assert weight_sync_targets(g) == {"actor": ["actor_rollout", "actor_log_prob"]}
    assert same_step_readers(g, "actor_train") == ["actor_rollout", "actor_log_prob"]


def test_placement_defaults(g):
    assert worker_groups(g) == {name: [name] for name in ORDER}
    assert [m.name for m in grpo_mfcs() if m.get_n_samples] == ["compute_advantage"]


def test_describe(g):
    text = describe(g)
    assert "actor_rollout -> actor_train: response_length, responses" in text
    assert "dataset -> rule_reward: labels, prompts" in text
    assert "actor_train -> actor_rollout: weights of actor" in text
    assert "weight sync after actor_train: actor_rollout, actor_log_prob" in text
