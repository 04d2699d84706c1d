"""The compute-function registry: the plan's checks of an MFC against its function, the key remaps,
and the row-level functions PPO and ReMax add (against hand-computed numbers)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.dataflow import MFCDef, get_algorithm
from mindspeed_rl.workers import compute as C
from mindspeed_rl.workers.steps.gae_advantage import gae_advantage
from mindspeed_rl.workers.steps.policy_train import advantage_matrix
from mindspeed_rl.workers.steps.remax_advantage import remax_advantage


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_every_registered_algorithm_passes_the_checks(algorithm):
    mfcs, _ = get_algorithm(algorithm)
    for m in mfcs:
        assert C.check_mfc(m).name == C.fn_name(m)


def test_defaults_per_interface_type():
    assert C.fn_name(MFCDef("g", "actor", "generate", ("prompts",), ("responses",))) == "generate"
    assert C.fn_name(MFCDef("i", "ref", "inference", ("prompts", "responses"), ())) == "log_probs"
    assert C.fn_name(MFCDef("t", "actor", "train_step", ("prompts",), ())) == "policy_train"
    assert C.fn_name(MFCDef("c", "reward", "compute", ("responses",), ("rm_scores",))) is None


@pytest.mark.parametrize("mfc, words", [
    (MFCDef("c", "reward", "compute", ("responses",), ("rm_scores",)),
     ["MFC 'c' is a compute MFC without fn=", "rule_reward"]),
    (MFCDef("c", "reward", "compute", ("responses",), ("rm_scores",), fn="nosuch"),
     ["fn='nosuch' is not a known compute function", "gae_advantage"]),
    (MFCDef("c", "reward", "compute", ("prompts", "responses"), ("log_prob",), fn="log_probs"),
     ["fn='log_probs' is a inference function but the MFC is compute"]),
    (MFCDef("r", "reward", "compute", ("prompts", "responses"), ("rm_scores",), fn="rule_reward"),
     ["fn='rule_reward' needs ['prompts', 'responses', 'labels']", "lack ['labels']", "input_key_remap"]),
    (MFCDef("i", "ref", "inference", ("prompts", "responses"), ("ref_log_prob",)),
     ["fn='log_probs' writes ['log_prob'], not ['ref_log_prob']", "output_key_remap"]),
])
def test_mismatches_are_named(mfc, words):
    with pytest.raises(ValueError) as e:
        C.check_mfc(mfc)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_remaps_must_name_the_mfcs_own_columns():
    with pytest.raises(ValueError, match="input_key_remap names column\\(s\\) 'x' that are not in its input_keys"):
        MFCDef("r", "reward", "compute", ("responses",), ("s",), fn="rule_reward", input_key_remap={"x": "y"})
    with pytest.raises(ValueError, match="output_key_remap names column\\(s\\) 'z' that are not in its output_keys"):
        MFCDef("r", "reward", "compute", ("responses",), ("s",), fn="rule_reward", output_key_remap={"rm": "z"})
    m = MFCDef("g", "reward", "compute", ("prompts", "greedy", "labels"), ("base",), fn="rule_reward",
               input_key_remap={"greedy": "responses"}, output_key_remap={"rm_scores": "base"})
    assert m.arg_name("greedy") == "responses" and m.arg_name("prompts") == "prompts"
    assert m.column_of("rm_scores") == "base" and C.check_mfc(m).name == "rule_reward"


def test_advantage_matrix_broadcasts_scalars_and_lays_out_token_rows():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    scalars = advantage_matrix([torch.tensor([2.0]), torch.tensor([-1.0])], mask)
    assert scalars.tolist() == [[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]]
    tokens = advantage_matrix([torch.tensor([0.5, 0.25]), torch.tensor([1.0, 2.0, 3.0])], mask)
    assert tokens.tolist() == [[0.5, 0.25, 0.0], [1.0, 2.0, 3.0]]


def test_remax_advantage_on_rows():
    # row 0: reward 1 on its last (2nd) token, baseline 0.25 -> reward-to-go [1, 1] -> adv [0.75, 0.75]
    # row 1: reward 0 over 3 tokens, baseline 0.5 -> adv [-0.5, -0.5, -0.5]
    batch = {"rm_scores": [torch.tensor([1.0]), torch.tensor([0.0])],
             "reward_baselines": [torch.tensor([0.25]), torch.tensor([0.5])],
             "response_length": [torch.tensor([2]), torch.tensor([3])]}
    out = remax_advantage(batch, [0, 1])
    assert [r.tolist() for r in out.columns["advantages"]] == [[0.75, 0.75], [-0.5, -0.5, -0.5]]
    assert [r.tolist() for r in out.columns["returns"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]


def test_gae_advantage_on_rows_gamma_lambda_one():
    # gamma = lam = 1: raw advantage = reward-to-go - V; returns = reward-to-go.
    # row 0: values [0.5, 0.5], reward 1 -> returns [1, 1], raw adv [0.5, 0.5]
    # row 1: values [0.0], reward 0 -> returns [0], raw adv [0.0]
    # whitened over the 3 tokens: mean 1/3; deviations 1/6, 1/6, -1/3; unbiased var = (1/36+1/36+1/9)/2 = 1/12
    # -> adv = dev * sqrt(12): [0.57735, 0.57735, -1.1547]
    batch = {"rm_scores": [torch.tensor([1.0]), torch.tensor([0.0])],
             "values": [torch.tensor([0.5, 0.5]), torch.tensor([0.0])]}
    out = gae_advantage(batch, [0, 1], gamma=1.0, lam=1.0)
    assert [r.tolist() for r in out.columns["returns"]] == [[1.0, 1.0], [0.0]]
    adv = torch.cat(out.columns["advantages"])
    assert torch.allclose(adv, torch.tensor([0.57735, 0.57735, -1.1547]), atol=1e-4)
    assert out.metrics == {"returns_sum": 2.0, "returns_tokens": 3.0}
