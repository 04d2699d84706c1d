"""The agent rollout and dynamic sampling as graph transforms (dataflow/rollout_options.py)."""
from __future__ import annotations

import pytest

from mindspeed_rl.dataflow import AlgorithmOptions, algorithm_graph, get_algorithm
from mindspeed_rl.dataflow.mfc import MFCDef
from mindspeed_rl.dataflow.rollout_options import GATE, LOSS_MASK, with_gate


def _by_name(mfcs):
    return {m.name: m for m in mfcs}


def test_the_agent_rollout_writes_loss_mask_and_the_loss_and_old_log_probs_read_it():
    m = _by_name(get_algorithm("grpo", AlgorithmOptions(agent=True, loss_mask=True))[0])
    assert m["actor_rollout"].fn == "agent_generate" and LOSS_MASK in m["actor_rollout"].output_keys
    assert LOSS_MASK in m["actor_log_prob"].input_keys and LOSS_MASK in m["actor_train"].input_keys
    assert LOSS_MASK not in m["ref_log_prob"].input_keys, "the frozen reference compares with nothing"
    plain = _by_name(get_algorithm("grpo", AlgorithmOptions(loss_mask=True))[0])  # drop_truncated alone
    assert plain["actor_rollout"].fn is None and LOSS_MASK in plain["actor_rollout"].output_keys
    ppo = _by_name(get_algorithm("ppo", AlgorithmOptions(agent=True, loss_mask=True))[0])
    assert LOSS_MASK in ppo["critic_train"].input_keys, "the value loss leaves tool tokens out too"
    off = _by_name(get_algorithm("grpo")[0])
    assert LOSS_MASK not in off["actor_rollout"].output_keys and off["actor_rollout"].fn is None


def test_dynamic_sampling_gates_every_stage_after_the_reward():
    for algorithm in ("grpo", "ppo", "remax"):
        mfcs, keys = get_algorithm(algorithm, AlgorithmOptions(dynamic_sampling=True))
        assert GATE in keys, "the driver puts the gate, as it puts the dataset's columns"
        m = _by_name(mfcs)
        for name, mfc in m.items():
            upstream = name in ("actor_rollout", "rule_reward")  # ReMax's greedy baseline: kept groups only
            assert (GATE in mfc.input_keys) != upstream, (algorithm, name)
        algorithm_graph(algorithm, AlgorithmOptions(dynamic_sampling=True, agent=True, loss_mask=True))  # a valid DAG


def test_a_graph_without_rewards_cannot_be_filtered():
    with pytest.raises(ValueError, match="no 'rm_scores' column to filter groups by"):
        with_gate([MFCDef("g", "actor", "generate", ("prompts",), ("responses",))])
