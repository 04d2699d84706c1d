"""The rollout and reward functions' DAPO parts: truncated rows and drop_truncated, the overlong
penalty on rm_scores, a reward's parts, the agent rollout's columns and metrics."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.engines import Rollout, SamplingParams
from mindspeed_rl.workers.steps.agent_generate import agent_generate
from mindspeed_rl.workers.steps.generate import generate
from mindspeed_rl.workers.steps.rule_reward import rule_reward


class FixedEngine:
    weight_version = 3

    def __init__(self, responses):
        self.responses = responses

    def generate(self, prompts, params, seeds):
        return Rollout([torch.tensor(r) for r in self.responses], [torch.full((len(r),), -0.5) for r in self.responses])


def test_generate_counts_truncated_rows_and_drop_truncated_masks_them():
    eng = FixedEngine([[5, 6, 2], [5, 6, 7], [5, 2]])  # finished at the limit, cut, finished early
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(2,))
    batch = {"prompts": [torch.tensor([1])] * 3}
    out = generate(batch, [0, 1, 2], engine=eng, params=params, seed=0, step=0)
    assert out.metrics["truncated_count"] == 1
    assert [m.tolist() for m in out.columns["loss_mask"]] == [[1, 1, 1], [1, 1, 1], [1, 1]]
    out = generate(batch, [0, 1, 2], engine=eng, params=params, seed=0, step=0, drop_truncated=True)
    assert [m.tolist() for m in out.columns["loss_mask"]] == [[1, 1, 1], [0, 0, 0], [1, 1]]


class Tok:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(str(t) for t in r) for r in rows]


def test_rule_reward_adds_the_overlong_penalty_and_logs_the_parts():
    def score(response, answer, prompt):
        return 1.0 if response.startswith(answer) else 0.0
    score.parts = {"first": lambda r, a, p: float(r[:1] == a[:1])}
    batch = {"responses": [torch.tensor([1, 2]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([9] * 10)],
             "prompts": [torch.tensor([0])] * 3, "labels": ["12", "12", "12"]}
    # max_len 10, buffer 4: lengths 2 -> 0, 8 -> -2/4 * 0.5 = -0.25, 10 -> -0.5
    out = rule_reward(batch, [0, 1, 2], reward_fn=score, tokenizer=Tok(), decode_label=str, overlong=(10, 4, 0.5))
    assert [float(r) for r in out.columns["rm_scores"]] == [1.0, 0.75, -0.5]
    assert out.metrics["reward_sum"] == 2.0, "the function's own score, before the penalty"
    assert out.metrics["overlong_penalty_sum"] == -0.75
    assert out.metrics["reward_part_first_sum"] == 2.0
    plain = rule_reward(batch, [0, 1, 2], reward_fn=score, tokenizer=Tok(), decode_label=str)
    assert [float(r) for r in plain.columns["rm_scores"]] == [1.0, 1.0, 0.0] and "overlong_penalty_sum" not in plain.metrics


def test_agent_generate_writes_the_trajectory_its_mask_and_the_calls():
    from mindspeed_rl.agent import AgentLoop, get_syntax, get_tools
    from tests.agent.test_agent import CharTok, ScriptedEngine
    tok = CharTok()
    eng = ScriptedEngine(tok, {0: ["<calc>2+3</calc>", "5<eos>"], 1: ["9999999999"]})
    eng.weight_version = 2
    loop = AgentLoop(eng, tok, get_tools(["calc"]), get_syntax("tags"), 3, 5.0)
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(tok.eos,))
    batch = {"prompts": [torch.tensor([0]), torch.tensor([1])]}
    out = agent_generate(batch, [0, 1], loop=loop, params=params, seed=0, step=0, drop_truncated=True)
    cols, m = out.columns, out.metrics
    assert tok.decode(cols["responses"][0].tolist()).startswith("<calc>2+3</calc><result>5</result>5")
    assert cols["loss_mask"][0].tolist().count(0) == 3 and cols["loss_mask"][1].tolist() == [0] * 10, \
        "row 1 ran into max_new_tokens: dropped from the loss"
    assert m["truncated_count"] == 1 and m["agent_calls_ok"] == 1 and m["agent_turns_sum"] == 3
    assert m["agent_tool_tokens_sum"] == 3 and cols["weight_version"][0].tolist() == [2]
