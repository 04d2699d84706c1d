"""Reward functions that fail on purpose, loaded by dotted path inside Ray workers."""
import os
import time

from mindspeed_rl.rewards.rules import digits

_calls = {"n": 0}


def crash_in_second_step(response: str, answer: str, prompt: str = "") -> float:
    """Kills its worker process (like a segfault or OOM kill) once step 0's rows are scored."""
    _calls["n"] += 1
    if _calls["n"] > int(os.environ.get("CRASH_AFTER_CALLS", "128")):
        os._exit(1)
    return digits(response, answer, prompt)


def hang_in_second_step(response: str, answer: str, prompt: str = "") -> float:
    """Stops making progress (a stuck stage) once step 0's rows are scored."""
    _calls["n"] += 1
    if _calls["n"] > 128:
        time.sleep(600)
    return digits(response, answer, prompt)


def slow_in_second_step(response: str, answer: str, prompt: str = "") -> float:
    """Scores every row of step 0 at once, then takes 0.2 s a row: late, but never stuck."""
    _calls["n"] += 1
    if _calls["n"] > 128:
        time.sleep(0.2)
    return digits(response, answer, prompt)
