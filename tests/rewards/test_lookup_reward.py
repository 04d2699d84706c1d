"""The lookup task's reward by hand: 0.8 x the model's answer digits once it looked its key up + 0.2 x format
shaping (the first units of the response against the right call: the opening tag 0.05 and the key's digits 0.6
position by position, each once the response goes on after it; the closing tag 0.35 when it closes a call of the
key's length that the tool answers)."""
from __future__ import annotations

import pytest

from mindspeed_rl.rewards.registry import get_reward_fn
from mindspeed_rl.rewards.rules import LOOKUP_FORM_WEIGHTS, lookup_answer, lookup_call_form, lookup_read

R = "<result>237</result>"


@pytest.mark.parametrize("response, form, read, answer, total", [
    (f"<lookup>123</lookup>{R}237", 1.0, 1.0, 1.0, 1.0),
    (f"<lookup>123</lookup>{R}207", 1.0, 1.0, 2 / 3, 0.2 + 0.8 * 2 / 3),
    (f"<lookup>123</lookup>{R}", 1.0, 1.0, 0.0, 0.2),                    # looks up right, writes no answer
    ("<lookup>129</lookup><result>410</result>410", 0.4 + 0.6 * 2 / 3, 0.0, 0.0, 0.2 * (0.4 + 0.6 * 2 / 3)),
    ("<lookup>7</lookup><result>001</result>2", 0.05, 0.0, 1 / 3, 0.01),  # a right digit by chance: not paid
    ("<lookup><lookup><lookup><lookup></lookup><result>", 0.05, 0.0, 0.0, 0.01),  # the tags, no key: no call
    ("<lookup>1233<result>237</result>", 0.65, 0.0, 0.0, 0.13),         # the key, then its last digit again
    ("123</lookup><result>", 0.0, 0.0, 0.0, 0.0),                        # closed unopened
    ("<lookup>123", 0.05 + 0.4, 0.0, 0.0, 0.2 * 0.45),                  # ends inside the call: its last unit unpaid
    ("<lookup></lookup><result></result>237", 0.05, 0.0, 1.0, 0.01),     # an error result the tokenizer dropped
    ("237", 0.0, 0.0, 1.0, 0.0),                                         # no call: a guess, even a right one
    ("1<lookup>123</lookup>", 0.0, 0.0, 0.0, 0.0),                       # every unit of the call one place late
    ("<lookup>123</lookup>", 1.0, 0.0, 0.0, 0.2),                        # the call without the tool's result
    (f"<lookup>555</lookup><result>1</result><lookup>123</lookup>{R}237", 0.4, 1.0, 1.0, 0.88),  # the last call
])
def test_lookup_answer_by_hand(response, form, read, answer, total):
    assert lookup_call_form(response, "237", "123=") == pytest.approx(form)
    assert lookup_read(response, "237", "123=") == read
    assert lookup_answer.parts["answer"](response, "237", "123=") == pytest.approx(answer)
    assert lookup_answer(response, "237", "123=") == pytest.approx(total)
    assert get_reward_fn("lookup_answer") is lookup_answer
    assert set(lookup_answer.parts) == {"answer", "read", "form"}


def test_the_answer_dominates_the_shaping():
    """The shaping is at most 0.2 and its weights sum to 1: a right call with a wrong answer scores 0.2, a right
    answer after it 1."""
    assert sum(LOOKUP_FORM_WEIGHTS) == pytest.approx(1.0)
    assert lookup_answer(f"<lookup>42</lookup><result>621</result>000", "621", "42=") == pytest.approx(0.2)


def test_a_result_the_model_writes_itself_is_not_a_lookup():
    """Only a result after the call's closing marker is the tool's: writing `<result>` itself earns no answer
    (agent/syntax.py final_answer)."""
    assert lookup_read("<result>237</result>237", "237", "123=") == 0.0
    assert lookup_answer("<lookup>123<result>237</result>237", "237", "123=") == pytest.approx(0.2 * 0.65)
