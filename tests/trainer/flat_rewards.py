"""A reward that gives every response of some prompts the same score, loaded by dotted path in Ray workers:
dynamic sampling must drop exactly those groups (all-equal rewards) and draw other prompts in their place."""
from mindspeed_rl.rewards.rules import digits


def flat_for_even_answers(response: str, answer: str, prompt: str = "") -> float:
    """0.5 for every response of a prompt whose answer starts with an even digit; the copy task's per-position
    credit otherwise."""
    answer = str(answer).strip()
    if answer and answer[0] in "02468":
        return 0.5
    return digits(response, answer, prompt)
