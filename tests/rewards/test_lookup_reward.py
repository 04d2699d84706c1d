"""The lookup task's reward by hand: 0.8 x the model's answer digits once it looked its key up + 0.2 x format
shaping (0.15 for a call the tool answered, 0.7 for its key's digits against the prompt's, 0.15 for an answer of
the value's form)."""
from __future__ import annotations

import pytest

from mindspeed_rl.rewards.registry import get_reward_fn
from mindspeed_rl.rewards.rules import lookup_answer, lookup_call, lookup_read

R = "<result>237</result>"


@pytest.mark.parametrize("response, call, read, answer, total", [
    (f"<lookup>123</lookup>{R}237", 1.0, 1.0, 1.0, 1.0),
    (f"<lookup>123</lookup>{R}207", 1.0, 1.0, 2 / 3, 0.2 + 0.8 * 2 / 3),
    (f"<lookup>123</lookup>{R}", 0.85, 1.0, 0.0, 0.17),                 # looks up right, writes no answer
    (f"<lookup> 123\n</lookup>{R}237", 1.0, 1.0, 1.0, 1.0),             # the tool reads the key stripped
    ("<lookup>129</lookup><result>410</result>410", 0.3 + 0.7 * 2 / 3, 0.0, 0.0, 0.2 * (0.3 + 0.7 * 2 / 3)),
    ("<lookup>7</lookup><result>001</result>2", 0.15, 0.0, 1 / 3, 0.03),  # a right digit by chance: not paid
    ("<lookup>1+2</lookup><result>error: lookup raised ValueError</result>237", 0.3 + 0.7 / 3, 0.0, 1.0,
     0.2 * (0.3 + 0.7 / 3)),
    ("<lookup></lookup><result></result>237", 0.3, 0.0, 1.0, 0.06),      # an error result the tokenizer dropped
    ("237", 0.0, 0.0, 1.0, 0.0),                                         # no call: a guess, even a right one
    ("<lookup>123</lookup>", 0.0, 0.0, 0.0, 0.0),                        # the call without the tool's result
    ("237<lookup></lookup><result>", 0.0, 0.0, 1.0, 0.0),               # a result cut short: no call, no form
    (f"<lookup>555</lookup><result>1</result><lookup>123</lookup>{R}237 9", 1.0, 1.0, 1.0, 1.0),  # the last call
    (f"<lookup>123</lookup>{R}23<lookup>", 0.85, 1.0, 2 / 3, 0.17 + 0.8 * 2 / 3),  # two digits: not the form
])
def test_lookup_answer_by_hand(response, call, read, answer, total):
    assert lookup_call(response, "237", "123=") == pytest.approx(call)
    assert lookup_read(response, "237", "123=") == read
    assert lookup_answer.parts["answer"](response, "237", "123=") == pytest.approx(answer)
    assert lookup_answer(response, "237", "123=") == pytest.approx(total)
    assert get_reward_fn("lookup_answer") is lookup_answer


def test_a_result_the_model_writes_itself_is_not_a_lookup():
    """Only a result after the call's closing marker is the tool's: writing `<result>` itself earns nothing
    (agent/syntax.py final_answer)."""
    assert lookup_answer("<result>237</result>237", "237", "123=") == 0.0
    assert lookup_answer("<lookup>123<result>237</result>237", "237", "123=") == 0.0
