"""Simple rule rewards: exact string match, and per-position digit credit for the synthetic tasks."""
from __future__ import annotations

import re


def exact_match(response: str, answer: str, prompt: str = "") -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if str(response).strip() == str(answer).strip() else 0.0


def first_word(response: str) -> str:
    """The response up to its first whitespace (leading whitespace skipped): what `digits` scores."""
    parts = str(response).split(maxsplit=1)
    return parts[0] if parts else ""


def digits(response: str, answer: str, prompt: str = "") -> float:
    """Partial credit per position, for the synthetic tasks (`mindspeed_rl.data.synthetic`).

    The response is cut at its first whitespace (newline included; leading whitespace is skipped);
    score = (positions i where response[i] == answer[i]) / max(len(answer), len(response)).
    Characters beyond the answer's length therefore cost credit, like wrong ones:
    answer "123": "123" -> 1, "124" -> 2/3, "12" -> 2/3, "1234" -> 3/4, "321" -> 1/3, "" -> 0.
    """
    answer = str(answer).strip()
    response = first_word(response)
    denom = max(len(answer), len(response))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, response)) / denom


def final_digits(response: str, answer: str, prompt: str = "") -> float:
    """`digits` on the final answer of a tool-using trajectory: the text after the last tool result
    (`</result>`, `</tool_response>`; mindspeed_rl/agent/syntax.py), or the whole response when it
    called no tool. The reward of the `sum` task: `<calc>1234+5678</calc><result>6912</result>6912`
    scores 1, the same without the copied `6912` scores 0.
    """
    from ..agent.syntax import final_answer
    return digits(final_answer(str(response)), answer, prompt)


def answer_digits(response: str, answer: str, prompt: str = "") -> float:
    """`final_digits` reading the answer's length of the final answer only: what follows it is not scored
    (as the copy tasks' max_new_tokens cut a response at the answer's length; a tool-using trajectory's
    answer has no fixed place to be cut at)."""
    from ..agent.syntax import final_answer
    answer = str(answer).strip()
    return digits(first_word(final_answer(str(response)))[:len(answer)], answer, prompt)


def same_form(text: str, expression: str) -> bool:
    """Whether `text` is an expression of the same form as `expression`: the same operators in the same
    order between numbers (`12+345` and `1+2` yes; `12345` and `12+` no)."""
    import re
    form = lambda t: re.sub(r"\d+", "9", t)  # noqa: E731 - every number one digit
    return bool(re.fullmatch(r"[\d+\-*/()]*\d[\d+\-*/()]*", text)) and form(text) == form(expression)


def calc_call_digits(response: str, answer: str, prompt: str = "") -> float:
    """The last `calc` call's arguments against the prompt's expression (the prompt without its closing
    `=`): `digits`, halved when the call is not an expression of the prompt's form (two numbers joined
    by the prompt's operator, `same_form`): `12+34=` and `<calc>12+34</calc><result>46</result>...` score 1,
    `<calc>12234</calc>` 4/5 x 1/2. Only a call the tool answered counts (its closing `</calc>` followed by
    `<result>`); no call scores 0.

    Why the form counts: `digits` alone gives a call with its `+` written as a copy of the digit before
    it (`12234` for `12+34`) 4/5 of the credit, and a randomly initialised model learns that call and
    stays there: the `+` is one position of the call, the only one whose token the copy needs nowhere
    else (measured, docs/agent.md: with `digits` alone 2 seeds of 3 never wrote the `+` in 300 steps;
    with the form counted, all 3 did)."""
    import re
    calls = re.findall(r"<calc>([^<]*)</calc><result>", str(response))
    if not calls:
        return 0.0
    expression = str(prompt).strip().removesuffix("=")
    score = digits(calls[-1], expression)
    return score if same_form(calls[-1], expression) else score / 2


def calc_digits(response: str, answer: str, prompt: str = "") -> float:
    """The `sum` task's reward with the calc tool (configs/grpo_tiny_tool.yaml): half for the call, half for
    the answer, and the answer counts only once the call is exactly right.

        0.5 x calc_call_digits + 0.5 x answer_digits x [calc_call_digits == 1]

    Why shaped: a randomly initialised model writes a whole right call almost never, and before its
    call is right the result it copies is wrong anyway; the answer's credit would then be noise on the
    call's (measured: half the speed). A response that calls no tool scores `answer_digits` alone, so
    an answer without the tool is scored as the answer after a call is."""
    if "<calc>" not in str(response):
        return answer_digits(response, answer, prompt)
    call = calc_call_digits(response, answer, prompt)
    return 0.5 * call + (0.5 * answer_digits(response, answer, prompt) if call == 1.0 else 0.0)


calc_digits.parts = {"answer": answer_digits, "call": calc_call_digits}  # logged as reward/answer_mean, reward/call_mean


LOOKUP_SHAPING_WEIGHT = 0.2  # the shaping's share of lookup_answer; the answer's is the rest
# lookup_call_form's weights of the call's opening tag, its key's digits (split evenly) and its closing tag
LOOKUP_FORM_WEIGHTS = (0.05, 0.6, 0.35)
_LOOKUP_CALL = re.compile(r"<lookup>([^<]*)</lookup><result>([^<]*)</result>")
_UNITS = re.compile(r"<[^<>]*>|.", re.DOTALL)  # a tag is one unit (one token of the lookup model), else a character


def _lookup_calls(response: str) -> list[tuple[str, str]]:
    """(key, result) of each lookup call whose whole result the response holds (`</lookup><result>..</result>`).
    A result cut by `max_new_tokens` does not count: its call has no answer after it."""
    return _LOOKUP_CALL.findall(str(response))


def _prompt_key(prompt: str) -> str:
    return str(prompt).strip().removesuffix("=")


def lookup_read(response: str, answer: str = "", prompt: str = "") -> float:
    """1 when the last lookup call the tool answered asked for the prompt's key, else 0."""
    calls = _lookup_calls(response)
    return float(bool(calls) and calls[-1][0].strip() == _prompt_key(prompt))


def lookup_call_form(response: str, answer: str = "", prompt: str = "") -> float:
    """Format shaping: the response's first units (a tag one unit, a character one unit) against the call that
    looks the prompt's key up, weighted by LOOKUP_FORM_WEIGHTS. The opening tag 0.05 and the key's digits 0.6
    (split evenly) count position by position, each once the response goes on after it; the closing tag 0.35
    counts when it closes a call the tool answers: the opening tag first, then as many digits as the key has,
    whichever digits. `42=`: `<lookup>42</lookup>...` 1, `<lookup>47</lookup>` 0.05 + 0.3 + 0.35,
    `<lookup>422` 0.65, `<lookup>42<eos>` 0.35, `4</lookup>` 0, `4<lookup>42` 0 (every unit one place late).

    Why by position, and why the closing tag is paid for any well-formed call: credit for a call only once it
    is right comes too seldom to a random model (about one row in four hundred writes a whole call with its
    key); credit per position comes as the copy task's `digits` does, to every row. Paid little (0.05) or only
    with the right key, the closing tag is never found: the key's copy is learned first and the place after it
    settles on the key's last digit repeated (`<lookup>422`, nearly always), so no call parses and nothing
    is read. Paid without the opening tag, it teaches calls closed unopened (`4</lookup>`), whose long error
    result fills `max_new_tokens`: every row of a group scores alike and no gradient is left. A response that
    ends inside the call (its `<eos>`) never calls; its last unit, paid for, pays for stopping there (measured
    slower, docs/agent.md)."""
    key = _prompt_key(prompt)
    ideal = ["<lookup>", *key, "</lookup>"]
    opener, digits_w, closer = LOOKUP_FORM_WEIGHTS
    weights = [opener] + [digits_w / max(len(key), 1)] * len(key)
    units = _UNITS.findall(str(response))[:len(ideal)]
    score = sum(w for u, i, w in zip(units[:-1], ideal, weights) if u == i)  # a unit something follows
    well_formed = (len(units) == len(ideal) and units[0] == ideal[0] and units[-1] == ideal[-1]
                   and all(u.isdigit() for u in units[1:-1]))
    return score + (closer if well_formed else 0.0)


def lookup_answer(response: str, answer: str, prompt: str = "") -> float:
    """The `lookup` task's reward (configs/grpo_tiny_tool.yaml): the model's answer once it has read its key's
    value, with format shaping worth at most 0.2.

        (1 - w) x answer_digits x lookup_read + w x lookup_call_form,    w = LOOKUP_SHAPING_WEIGHT = 0.2

    `answer_digits` reads the model's own text after the tool's result against the true value; nothing
    in the loop writes it for the model. It counts only after a lookup of the prompt's key: the value
    is a hash of the whole key, so without it an answer is right by chance alone (0.1 of its digits),
    and that chance, paid, is noise on the shaping while the model learns to call. A trajectory that
    looks up right and answers wrong scores 0.2: a reward of 0.8 needs the answer itself 75% right.
    """
    return ((1 - LOOKUP_SHAPING_WEIGHT) * answer_digits(response, answer, prompt) * lookup_read(response, answer, prompt)
            + LOOKUP_SHAPING_WEIGHT * lookup_call_form(response, answer, prompt))


# logged as reward/<part>_mean: answer (the answer's digits, looked up or not: the plain accuracy), read (rows that
# looked their own key up), form (the shaping)
lookup_answer.parts = {"answer": answer_digits, "read": lookup_read, "form": lookup_call_form}
