"""The config decides which stages exist: no KL term, no reference stage (verl's use_reference_policy)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import (AlgorithmOptions, algorithm_graph, dock_columns, get_algorithm, known_algorithms,
                                   options_from_config, uses_kl_loss)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_without_reference_no_ref_stage_and_train_does_not_read_it(algorithm):
    full = algorithm_graph(algorithm)
    g = algorithm_graph(algorithm, AlgorithmOptions(use_reference=False))
    assert set(full.nodes) - set(g.nodes) == {"ref_log_prob"}
    assert "ref_log_prob" not in dock_columns(g)
    assert "ref_log_prob" not in g.nodes["actor_train"]["mfc"].input_keys
    assert "ref_log_prob" in full.nodes["actor_train"]["mfc"].input_keys
    assert "ref" not in {m.model_name for m in get_algorithm(algorithm, AlgorithmOptions(False))[0]}


def test_every_algorithm_builds_both_ways():
    """With a reference the graph has a ref_log_prob stage where the algorithm reads one; without, none."""
    for name in known_algorithms():
        with_ref = set(algorithm_graph(name, AlgorithmOptions(use_reference=True)).nodes)
        without = set(algorithm_graph(name, AlgorithmOptions(use_reference=False)).nodes)
        assert without and "ref_log_prob" not in without
        assert with_ref - without <= {"ref_log_prob"}


@pytest.mark.parametrize("use_kl_loss,coef,adaptive,expected", [
    (True, 0.0, False, False), (True, 0.0, True, False), (False, 0.1, False, False), (True, 0.001, False, True),
    (True, 0.001, True, True)])
def test_reference_needed_only_for_a_kl_term(use_kl_loss, coef, adaptive, expected):
    cfg = config_from_dict({"actor_config": {"use_kl_loss": use_kl_loss, "kl_loss_coef": coef,
                                             "kl_ctrl": "adaptive" if adaptive else "fixed"}})
    assert options_from_config(cfg).use_reference is expected
    assert uses_kl_loss(use_kl_loss, coef) is expected


def _loss_inputs(with_ref: bool):
    from mindspeed_rl.engines import OptimConfig
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from tests.engines._common import PAD, random_rows, tiny_qwen2
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig())
    prompts, responses = random_rows(3, [2, 3, 1], seed=1), random_rows(3, [2, 1, 3], seed=2)
    old = engine.log_probs(prompts, responses, 8)
    batch = {"prompts": prompts, "responses": responses, "old_log_prob": old,
             "advantages": [torch.tensor([a]) for a in (1.0, -1.0, 0.5)]}
    if with_ref:
        batch["ref_log_prob"] = [o.clone() for o in old]
    return engine, batch


def test_loss_without_kl_needs_no_ref_log_prob_and_reports_no_kl():
    from mindspeed_rl.workers.steps.policy_train import PolicyLossConfig, policy_loss_fn
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_c=3.0, agg="token-mean", use_kl_loss=True,
                             kl_type="k3", entropy_coeff=0.0)
    from mindspeed_rl.engines import MicroBatch

    def step(engine, batch, kl_coef):
        return engine.train_step([MicroBatch(batch, 1.0, last=True)], policy_loss_fn(cfg, kl_coef))
    engine, batch = _loss_inputs(with_ref=False)
    out = step(engine, batch, 0.0)
    assert "kl" not in out and out["micro_batches"] == 1.0
    with pytest.raises(ValueError, match="has a KL term .* but the train MFC gets no ref_log_prob"):
        step(engine, batch, 0.01)
    engine, batch = _loss_inputs(with_ref=True)
    out = step(engine, batch, 0.01)
    assert out["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference equals the policy here


# ------------------------------------------------------------------ the reward model's MFCs (issue 27)
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_reward_model_mfc_only_when_enabled(algorithm):
    off = algorithm_graph(algorithm, AlgorithmOptions(use_reference=False))
    on = algorithm_graph(algorithm, AlgorithmOptions(use_reference=False, reward_model=True))
    added = set(on.nodes) - set(off.nodes)
    greedy = {"greedy_reward_model", "combine_greedy_reward"} if algorithm == "remax" else set()
    assert added == {"reward_model", "combine_reward"} | greedy
    assert "reward_model" not in off.nodes and "model_scores" not in dock_columns(off)
    rm = on.nodes["reward_model"]["mfc"]
    assert (rm.model_name, rm.interface_type.value, rm.input_keys, rm.output_keys) == \
        ("reward", "inference", ("prompts", "responses"), ("model_scores",))
    # the rule still runs (its mean is logged) and the combined score is what the advantage reads
    assert on.nodes["rule_reward"]["mfc"].output_keys == ("rule_scores",)
    assert on.nodes["combine_reward"]["mfc"].input_keys == ("model_scores", "rule_scores")
    assert on.nodes["combine_reward"]["mfc"].output_keys == ("rm_scores",)
    assert ("combine_reward", "compute_advantage") in on.edges
    # never trained: no version edge, nothing to sync, nothing to checkpoint
    from mindspeed_rl.dataflow import trained_models, weight_sync_targets
    assert "reward" not in trained_models(on) and "reward" not in weight_sync_targets(on)
    # without a rule reward: the model's score alone
    alone = algorithm_graph(algorithm, AlgorithmOptions(use_reference=False, reward_model=True, rule_reward=False))
    assert "rule_reward" not in alone.nodes
    assert alone.nodes["combine_reward"]["mfc"].input_keys == ("model_scores",)


def test_remax_scores_its_greedy_answer_with_the_reward_model_too():
    g = algorithm_graph("remax", AlgorithmOptions(use_reference=False, reward_model=True))
    greedy = g.nodes["greedy_reward_model"]["mfc"]
    assert greedy.input_keys == ("prompts", "greedy_responses") and greedy.output_keys == ("greedy_model_scores",)
    assert greedy.arg_name("greedy_responses") == "responses" and greedy.column_of("model_scores") == "greedy_model_scores"
    combine = g.nodes["combine_greedy_reward"]["mfc"]
    assert combine.output_keys == ("reward_baselines",) and combine.arg_name("greedy_rule_scores") == "rule_scores"


def test_reward_modeling_is_one_train_step_over_the_pairs():
    from mindspeed_rl.dataflow import trained_models, weight_sync_targets
    g = algorithm_graph("reward_modeling")
    assert list(g.nodes) == ["rm_train"] and g.graph["dataset_keys"] == ("prompts", "chosen", "rejected")
    m = g.nodes["rm_train"]["mfc"]
    assert m.is_trainable and m.model_name == "reward" and m.fn == "reward_train"
    assert trained_models(g) == {"reward": "rm_train"} and weight_sync_targets(g) == {"reward": []}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_an_on_policy_update_has_no_old_log_prob_stage(algorithm):
    g = algorithm_graph(algorithm, AlgorithmOptions(recompute_log_prob=False))
    assert "actor_log_prob" not in g.nodes and "old_log_prob" not in dock_columns(g)
    assert "old_log_prob" not in g.nodes["actor_train"]["mfc"].input_keys
    assert "actor_log_prob" in algorithm_graph(algorithm).nodes


@pytest.mark.parametrize("overrides, recompute", [
    ({}, True),                                                             # 4 optimizer steps a step
    ({"actor_config.ppo_mini_batch_size": 16}, False),                      # one: on-policy
    ({"actor_config.ppo_mini_batch_size": None}, False),                    # null: the whole step, one
    ({"actor_config.ppo_mini_batch_size": 16, "rl_config.max_weight_staleness": 1}, True),
    ({"actor_config.ppo_mini_batch_size": 16, "actor_config.off_policy_correction": "tis"}, True),
    ({"actor_config.ppo_mini_batch_size": 16, "rl_config.dynamic_sampling": True}, True),
    ({"actor_config.ppo_mini_batch_size": 16, "actor_config.recompute_log_prob": True}, True),
])
def test_the_old_log_probs_are_recomputed_unless_the_update_is_on_policy(overrides, recompute):
    from tests.config.helpers import with_overrides
    assert options_from_config(config_from_dict(with_overrides(overrides))).recompute_log_prob is recompute


def test_the_loss_without_old_log_probs_takes_the_updates_own():
    """The policy loss of an on-policy update: ratio 1 on every token, the plain policy gradient."""
    from mindspeed_rl.engines import ModelOutput
    from mindspeed_rl.workers.steps.policy_train import PolicyLossConfig, policy_loss_fn
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = ModelOutput(response_mask=mask, log_probs=logp, entropy=torch.zeros(1, 3))
    mb = type("MB", (), {"data": {"advantages": [torch.tensor([2.0])]}})()
    loss, m = policy_loss_fn(PolicyLossConfig(0.2, 0.2, 3.0, "token-mean", False, "k3", 0.0), 0.0)(out, mb)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.0) and m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    assert logp.grad.tolist() == [[-1.0, -1.0, 0.0]]   # -A / tokens on the real tokens


@pytest.mark.parametrize("overrides, correction", [
    ({}, "none"),
    ({"rl_config.max_weight_staleness": 1, "rl_config.guarantee_order": False, "rl_config.partial_rollout": True},
     "tis"),
    ({"rl_config.max_weight_staleness": 1, "rl_config.guarantee_order": False, "rl_config.partial_rollout": True,
      "actor_config.off_policy_correction": "none"}, "none"),
    ({"actor_config.off_policy_correction": "decoupled"}, "decoupled"),
])
def test_a_null_correction_is_tis_with_partial_rollouts_only(overrides, correction, tmp_path):
    from mindspeed_rl.dataflow.options import off_policy_correction
    from mindspeed_rl.planning import make_plan
    from tests.config.helpers import with_overrides
    cfg = config_from_dict(with_overrides({**overrides, "trainer.output_dir": str(tmp_path)}))
    assert off_policy_correction(cfg) == correction
    assert options_from_config(cfg).off_policy_correction is (correction != "none")
    warned = any(n.startswith("WARNING: rl_config.partial_rollout=true with actor_config.off_policy_correction=none")
                 for n in make_plan(cfg).notes)
    assert warned is (overrides.get("actor_config.off_policy_correction") == "none")
