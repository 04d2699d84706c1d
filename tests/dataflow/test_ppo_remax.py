"""PPO's and ReMax's graphs: what the trainer derives from their MFC lists (no trainer code per algorithm)."""
from __future__ import annotations

from mindspeed_rl.dataflow import (algorithm_graph, dock_columns, same_step_readers, topological_order,
                                   trained_models, version_edges, weight_sync_targets)


def test_ppo_has_two_trained_models_each_with_its_version_edge():
    g = algorithm_graph("ppo")
    assert trained_models(g) == {"actor": "actor_train", "critic": "critic_train"}
    assert version_edges(g) == [("actor_train", "actor_rollout", "actor"),
                                ("critic_train", "critic_values", "critic")]
    assert weight_sync_targets(g) == {"actor": ["actor_rollout", "actor_log_prob"], "critic": ["critic_values"]}
    # the critic must not step its optimizer before this step's values are all computed
    assert same_step_readers(g, "critic_train") == ["critic_values"]
    order = [m.name for m in topological_order(g)]
    assert order.index("critic_values") < order.index("compute_advantage") < order.index("critic_train")
    assert {"values", "returns", "advantages"} <= set(dock_columns(g))


def test_remax_greedy_baseline_is_its_own_stage_reading_the_actor():
    g = algorithm_graph("remax")
    assert trained_models(g) == {"actor": "actor_train"}
    assert weight_sync_targets(g) == {"actor": ["actor_rollout", "actor_greedy_rollout", "actor_log_prob"]}
    assert g.edges["actor_greedy_rollout", "greedy_reward"]["keys"] == ("greedy_responses",)
    assert g.edges["greedy_reward", "compute_advantage"]["keys"] == ("reward_baselines",)
    assert "values" not in dock_columns(g) and "returns" not in dock_columns(g)
