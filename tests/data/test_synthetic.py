"""The synthetic tasks: formats, right answers, determinism, and that ignoring the prompt scores low."""
import re

import numpy as np
import pytest

from mindspeed_rl.data import SYNTHETIC_KINDS, SyntheticPromptDataset, SyntheticTask
from mindspeed_rl.data.synthetic import ALPHABET
from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.rewards import digits, get_reward_fn

FORMATS = {"copy": r"\d{3}=", "reverse": r"\d{3}=", "sort": r"\+?\d{3}=", "add": r"\d{3}\+\d{3}=",
           "sum": r"\d{3}\+\d{3}=", "lookup": r"\d{3}="}
ANSWERS = {"sum": r"0|[1-9]\d{0,3}"}  # the real sum of two 3-digit strings (leading zeros): 0 .. 1998
# the tiny model's tasks (digits, `+` and `=`); `arith` is asked in words for a real model (tests below)
DIGIT_KINDS = [k for k in SYNTHETIC_KINDS if k != "arith"]


@pytest.mark.parametrize("kind, prompt, answer", [
    ("copy", "123=", "123"), ("copy", "007=", "007"),
    ("reverse", "123=", "321"), ("reverse", "100=", "001"),
    ("sort", "312=", "123"), ("sort", "+312=", "321"), ("sort", "909=", "099"), ("sort", "+909=", "990"),
    ("add", "123+456=", "579"), ("add", "999+111=", "000"), ("add", "555+505=", "050"),
    ("sum", "123+456=", "579"), ("sum", "999+999=", "1998"), ("sum", "555+505=", "1060"), ("sum", "012+034=", "46"),
    ("lookup", "123=", "237"), ("lookup", "042=", "293"),
])
def test_solve_by_hand(kind, prompt, answer):
    assert SyntheticTask(kind, 3).solve(prompt) == answer


@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_samples_have_the_format_and_the_right_answer(kind):
    task = SyntheticTask(kind, 3)
    pairs = task.sample_many(np.random.default_rng(0), 500)
    for prompt, answer in pairs:
        assert re.fullmatch(FORMATS[kind], prompt), prompt
        assert re.fullmatch(ANSWERS.get(kind, r"\d{3}"), answer), answer
        assert task.solve(prompt) == answer
        assert digits(answer, answer, prompt) == 1.0
    assert len({p for p, _ in pairs}) > 350  # varied (500 draws of 1000 prompts: ~393 distinct)
    prompt, answer = task.sample(np.random.default_rng(1))
    assert task.solve(prompt) == answer


def test_sort_uses_both_directions_and_other_lengths():
    prompts = [p for p, _ in SyntheticTask("sort").sample_many(np.random.default_rng(0), 200)]
    assert 60 < sum(p.startswith("+") for p in prompts) < 140
    for kind in DIGIT_KINDS:
        task = SyntheticTask(kind, 5)
        for prompt, answer in task.sample_many(np.random.default_rng(2), 50):
            expected = {"sum": len(str(int(prompt[:5]) + int(prompt[6:11]))) if kind == "sum" else 0, "lookup": 3}
            assert len(answer) == expected.get(kind, 5)
            assert task.solve(prompt) == answer


def test_solve_rejects_other_prompts():
    with pytest.raises(ValueError, match=r"'\+123=' is not a prompt of SyntheticTask\(kind='copy'"):
        SyntheticTask("copy").solve("+123=")
    for kind, bad in (("reverse", "12="), ("sort", "++123="), ("sort", "1x3="), ("add", "12+345="),
                      ("add", "123+45a="), ("copy", "123"), ("copy", "=")):
        with pytest.raises(ValueError, match="is not a prompt of"):
            SyntheticTask(kind).solve(bad)


def test_task_argument_errors():
    with pytest.raises(ValueError, match=r"unknown synthetic task kind 'mul'; kinds are \['copy', "
                                         r"'reverse', 'sort', 'add', 'sum', 'lookup', 'arith'\]"):
        SyntheticTask("mul")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_digits must be a positive integer"):
            SyntheticTask("copy", bad)
    with pytest.raises(ValueError, match="size must be a positive integer"):
        SyntheticPromptDataset("copy", size=0)


def test_dataset_is_deterministic_and_indexable():
    a = SyntheticPromptDataset(SyntheticTask("add", 3), size=1000, seed=7)
    b = SyntheticPromptDataset(SyntheticTask("add", 3), size=1000, seed=7)
    c = SyntheticPromptDataset(SyntheticTask("add", 3), size=1000, seed=8)
    assert len(a) == 1000 and a.records == b.records and a.records != c.records
    assert set(a[0]) == {"prompt", "answer"} and a[-1] == b[-1]
    assert list(a)[:3] == a.records[:3]
    assert len(SyntheticPromptDataset("reverse", size=5, num_digits=4)[0]["prompt"]) == 5
    assert len(SyntheticPromptDataset()) == 10000
    assert "builtin:add" in repr(a)


def _mean_reward(responses, dataset):
    return float(np.mean([digits(r, rec["answer"], rec["prompt"])
                          for r, rec in zip(responses, dataset)]))


def _best_constant(dataset, n):
    """The prompt-ignoring answer that scores best: the most frequent digit at each position."""
    answers = np.array([[int(ch) for ch in r["answer"]] for r in dataset])
    return "".join(str(np.bincount(answers[:, i], minlength=10).argmax()) for i in range(n))


@pytest.mark.parametrize("kind", [k for k in DIGIT_KINDS if k not in ("sum", "lookup")])  # the tool tasks: below,
# and tests/agent/test_lookup.py
def test_a_policy_that_ignores_the_prompt_scores_under_0_2(kind):
    n = 3
    dataset = SyntheticPromptDataset(SyntheticTask(kind, n), size=4000, seed=0)
    rng = np.random.default_rng(123)
    random_strings = ["".join(map(str, rng.integers(0, 10, n))) for _ in dataset]
    assert _mean_reward(random_strings, dataset) < 0.2
    random_lengths = ["".join(map(str, rng.integers(0, 10, rng.integers(1, 2 * n + 1))))
                      for _ in dataset]
    assert _mean_reward(random_lengths, dataset) < 0.2
    for constant in ("000", "123", "555", "999", _best_constant(dataset, n)):
        assert _mean_reward([constant] * len(dataset), dataset) < 0.2, constant
    # ... while reading the prompt gets full credit
    task = dataset.task
    assert _mean_reward([task.solve(r["prompt"]) for r in dataset], dataset) == 1.0
    assert get_reward_fn(task.reward) is digits


def test_sum_is_real_addition_scored_after_the_tool_result():
    """`sum`: numbers of num_digits digits (no leading zero), the exact sum; the reward `final_digits`
    reads the answer after the last tool result, so copying the calculator's result is full credit."""
    from mindspeed_rl.rewards import final_digits
    task = SyntheticTask("sum", 4)
    pairs = task.sample_many(np.random.default_rng(0), 2000)
    for prompt, answer in pairs[:200]:
        a, b = prompt[:-1].split("+")
        assert len(a) == len(b) == 4 and answer == str(int(a) + int(b))
    assert 0.4 < np.mean([len(a) == 5 for _, a in pairs]) < 0.6  # carries into a fifth digit about half the time
    assert task.reward == "final_digits" and get_reward_fn(task.reward) is final_digits
    prompt, answer = pairs[0]
    call = f"<calc>{prompt[:-1]}</calc><result>{answer}</result>{answer}"
    assert final_digits(call, answer, prompt) == 1.0
    assert final_digits(f"<calc>{prompt[:-1]}</calc><result>{answer}</result>", answer, prompt) == 0.0
    assert final_digits(answer, answer, prompt) == 1.0, "an answer without a tool call counts too"
    # calc_digits: half for the call (its arguments against the prompt's expression), half for the answer once
    # the call is exactly right
    from mindspeed_rl.rewards import calc_digits, get_reward_fn as get
    p, ans = "0123+4567=", "4690"
    assert calc_digits(f"<calc>0123+4567</calc><result>4690</result>4690", ans, p) == 1.0
    assert calc_digits(f"<calc>0123+4567</calc><result>4690</result>", ans, p) == 0.5
    assert calc_digits(f"<calc>0123+4568</calc><result>4691</result>4691", ans, p) == pytest.approx(0.5 * 8 / 9)
    assert calc_digits(f"<calc>0123+4567</calc>", ans, p) == 0.0, "a call nobody answered"
    assert calc_digits("4690", ans, p) == 1.0 and calc_digits("4600", ans, p) == 0.75, "no call: final_digits"
    call = get("calc_digits").parts["call"]
    # a call not of the prompt's form (two numbers joined by +) gets half its digits' credit
    assert call(f"<calc>0123</calc><result>123</result>", ans, p) == pytest.approx(4 / 9 / 2)
    assert call(f"<calc>012344567</calc><result>12344567</result>", ans, p) == pytest.approx(8 / 9 / 2)
    assert call(f"<calc>0123+456</calc><result>579</result>", ans, p) == pytest.approx(8 / 9), "right form"
    assert call(f"<calc>0123++4567</calc><result>x</result>", ans, p) == pytest.approx(5 / 10 / 2)
    assert calc_digits(f"<calc>0123-4567</calc><result>-4444</result>", ans, p) == pytest.approx(0.5 * 8 / 9 / 2)
    from mindspeed_rl.rewards.rules import same_form
    assert same_form("1+22", "333+4") and not same_form("1+", "1+2") and not same_form("12", "1+2")
    assert not same_form("1+2a", "1+2") and same_form("(1+2)*3", "(4+5)*6")


@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_prompts_are_made_of_real_tokens_of_the_builtin_tokenizer(kind):
    """No character may map to <unk>: the tiny model must see every prompt character."""
    tok = build_char_tokenizer()
    unk = tok.unk_token_id
    for record in SyntheticPromptDataset(kind, size=100, seed=0):
        ids = tok(record["prompt"], add_special_tokens=False)["input_ids"]
        assert unk not in ids and len(ids) == len(record["prompt"])
        assert tok.decode(ids) == record["prompt"]
        assert set(record["prompt"]) <= set(ALPHABET)


def test_arith_questions_answers_and_splits():
    """builtin:arith: every template used, operands of 1 to num_digits digits, subtractions never below 0,
    answers in GSM8K form scored 1 by the gsm8k rewards, train and held-out splits disjoint; the phrasings
    kept for transfer checks appear in neither."""
    from mindspeed_rl.data import arith
    from mindspeed_rl.rewards.gsm8k import gsm8k_flexible
    task = SyntheticTask("arith", 2)
    assert task.reward == "gsm8k_flexible"
    train = SyntheticPromptDataset(task, size=2000, seed=3)
    held = SyntheticPromptDataset(task, size=300, seed=3, split="val")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    used = set()
    for r in list(train) + list(held):
        numbers = [int(x) for x in re.findall(r"\d+", r["prompt"])]
        assert len(numbers) == 2 and all(0 <= x <= 99 for x in numbers)
        value = int(r["answer"].removeprefix("#### "))
        assert value >= 0 and r["answer"] == task.solve(r["prompt"])
        assert gsm8k_flexible(f"The answer is {value}.", r["answer"]) == 1.0
        used |= {t for t, _ in arith.TEMPLATES if re.fullmatch(
            re.escape(t).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+"), r["prompt"])}
    assert used == {t for t, _ in arith.TEMPLATES}
    singles = sum(all(int(x) < 10 for x in re.findall(r"\d+", r["prompt"])) for r in train)
    assert 350 < singles < 650   # both operands single-digit a quarter of the time
    unseen = arith.sample_many(np.random.default_rng(0), 50, 2, arith.UNSEEN_TEMPLATES)
    assert not {p for p, _ in unseen} & {r["prompt"] for r in train}
    assert all(arith.solve(p) == a for p, a in unseen)
    assert arith.solve("Compute 12 - 5.") == "#### 7" and arith.solve("Add 3 and 4.") == "#### 7"
    with pytest.raises(ValueError, match="is not an arith question"):
        task.solve("123=")
