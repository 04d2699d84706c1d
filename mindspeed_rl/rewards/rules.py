"""Simple rule rewards: exact string match, and per-position digit credit for the synthetic tasks."""
from __future__ import annotations


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
