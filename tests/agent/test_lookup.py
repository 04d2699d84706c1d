"""The lookup tool and its task (configs/grpo_tiny_tool.yaml): a value the model can only read from the tool, a
call syntax of one token per marker on builtin:tiny-qwen2-lookup, and a trajectory whose answer is the model's."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from mindspeed_rl.agent import AgentLoop, get_syntax
from mindspeed_rl.agent.tools import get_tools, lookup, lookup_value
from mindspeed_rl.data.synthetic import SyntheticPromptDataset, SyntheticTask
from mindspeed_rl.rewards.registry import get_reward_fn


@pytest.mark.parametrize("key, value", [("123", "237"), ("000", "922"), ("999", "827"), ("42", "621"), ("042", "293")])
def test_lookup_values_are_pinned(key, value):
    """The table is part of the task: a change of the hash would change every answer of builtin:lookup."""
    assert lookup(key) == value == lookup_value(key)
    assert lookup(f" {key}\n") == value, "surrounding whitespace of the call's text is not part of the key"


@pytest.mark.parametrize("arguments, words", [("", "a key of digits"), ("12+3", "a key of digits"),
                                              ("１２", "a key of digits"), ("1234567", "at most 6 digits")])
def test_lookup_refuses_what_is_not_a_key(arguments, words):
    with pytest.raises(ValueError, match=words):
        lookup(arguments)


def test_no_digit_of_a_value_follows_from_a_digit_of_its_key():
    """Over the 1000 keys of the task, the best guess of any value digit from any one key digit is right at
    most 21% of the time (10% is chance), and no value digit has a value over 12% of keys: the model cannot
    compute the answer from the prompt, as it could a digit-wise rule."""
    keys = [f"{k:03d}" for k in range(1000)]
    values = {k: lookup_value(k) for k in keys}
    assert all(len(v) == 3 and v.isdigit() for v in values.values())
    for i in range(3):
        assert Counter(v[i] for v in values.values()).most_common(1)[0][1] <= 120
        for j in range(3):
            for d in "0123456789":
                given = Counter(values[k][i] for k in keys if k[j] == d)
                assert given.most_common(1)[0][1] <= 21, (i, j, d, given)


def test_the_lookup_task_answers_with_the_tools_value():
    task = SyntheticTask("lookup", 3)
    assert task.reward == "lookup_answer" and task.solve("123=") == "237"
    rows = SyntheticPromptDataset("lookup", size=50, seed=3).records
    assert all(r["answer"] == lookup(r["prompt"][:-1]) and len(r["prompt"]) == 4 for r in rows)
    with pytest.raises(ValueError, match="not a prompt"):
        task.solve("12+3=")


class _Scripted:
    """An engine that writes a given text for each turn (the call, then the answer): the loop's side of the
    lookup task without a model."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, 0

    def generate(self, prompts, params, seeds):
        from types import SimpleNamespace
        ids = [torch.tensor(self.tok.encode(self.turns[self.calls], add_special_tokens=False)) for _ in prompts]
        self.calls += 1
        return SimpleNamespace(responses=ids, log_probs=[torch.full((len(x),), -0.5) for x in ids])


def test_the_model_writes_the_answer_after_the_lookup_result():
    """No tool_choice, no return_direct: the model's tokens are its call and its answer, the result the tool's;
    the reward reads the model's answer (`lookup_answer` 1 with it right, 0.2 + 0.8 x 2/3 with two digits)."""
    from dataclasses import dataclass

    from mindspeed_rl.models.checkpoint import load_tokenizer
    tok = load_tokenizer("builtin:tiny-qwen2-lookup")
    assert [len(tok.encode(m, add_special_tokens=False)) for m in ("<lookup>", "</lookup>", "<result>", "</result>")] \
        == [1, 1, 1, 1]

    @dataclass
    class Params:
        max_new_tokens: int = 16
        stop_token_ids: tuple = (tok.eos_token_id,)

    reward = get_reward_fn("lookup_answer")
    for answer, score in (("237", 1.0), ("207", 0.2 + 0.8 * 2 / 3), ("999", 0.2)):
        loop = AgentLoop(_Scripted(tok, ["<lookup>123</lookup>", f"{answer}<eos>"]), tok, get_tools(["lookup"]),
                         get_syntax("tags"), max_turns=2, tool_timeout_s=5.0)
        out = loop.run([torch.tensor(tok.encode("123=", add_special_tokens=False))], Params(), [7])
        text = tok.decode(out.responses[0], skip_special_tokens=False)
        assert text == f"<lookup>123</lookup><result>237</result>{answer}<eos>"
        assert out.loss_masks[0].tolist() == [1] * 5 + [0] * 5 + [1] * 4, "the answer is the model's, not given"
        assert out.calls["ok"] == 1 and out.truncated == [False]
        assert reward(tok.decode(out.responses[0], skip_special_tokens=True), "237", "123=") == pytest.approx(score)
