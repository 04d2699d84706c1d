"""Reward functions by name: the built-in ones, or your own by dotted path.

A reward function has the signature

    fn(response: str, answer: str, prompt: str) -> float   # in [0, 1]

`response` is the decoded generation (special tokens removed), `answer` the dataset's reference
answer as a string, `prompt` the prompt text. Higher is better; `score_batch` clamps to [0, 1].

Built-in names: `gsm8k`, `gsm8k_flexible`, `exact_match`, `digits`, `final_digits`, `calc_digits`,
`answer_digits`, `lookup_answer` (see BUILTIN_REWARDS).
Your own function: `"my_pkg.my_mod:my_fn"` or `"my_pkg.my_mod.my_fn"`; the module must be
importable on every worker (installed, or on PYTHONPATH).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Callable, Sequence

from .gsm8k import gsm8k, gsm8k_flexible
from .rules import answer_digits, calc_digits, digits, exact_match, final_digits, lookup_answer

RewardFn = Callable[[str, str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "exact_match": exact_match,
    "digits": digits,
    "final_digits": final_digits,
    "calc_digits": calc_digits,
    "answer_digits": answer_digits,
    "lookup_answer": lookup_answer,
}


def _split_dotted(name: str) -> tuple[str, str]:
    """`"pkg.mod:fn"` or `"pkg.mod.fn"` -> ("pkg.mod", "fn"); ValueError when neither form."""
    if ":" in name:
        module, _, attr = name.partition(":")
    else:
        module, _, attr = name.rpartition(".")
    if not module or not attr or any(not part.isidentifier() for part in module.split(".")) \
            or any(not part.isidentifier() for part in attr.split(".")):
        raise ValueError(_unknown_message(name))
    return module, attr


def _unknown_message(name: str) -> str:
    return (f"unknown reward function {name!r}: built-in rewards are {sorted(BUILTIN_REWARDS)}; "
            f"for your own function give its dotted path, 'my_pkg.my_module:my_fn' or "
            f"'my_pkg.my_module.my_fn' (signature fn(response, answer, prompt) -> float in [0, 1])")


def _is_dotted(name: str) -> bool:
    return ":" in name or "." in name


def get_reward_fn(name: str) -> RewardFn:
    """The reward function called `name`: a built-in name or a dotted path to your own function."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(_unknown_message(name))
    name = name.strip()
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if not _is_dotted(name):
        raise ValueError(_unknown_message(name))
    module_name, attr = _split_dotted(name)
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"reward function {name!r}: cannot import module {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward function {name!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
    if not callable(obj):
        raise ValueError(f"reward function {name!r}: {attr!r} in {module_name!r} is a "
                         f"{type(obj).__name__}, not a function")
    return obj


def check_reward_name(name: str, import_module: bool = True) -> str:
    """Check a reward name from the config; return it stripped, or raise ValueError.

    Built-in names are checked against the table. A dotted path is resolved the way
    `get_reward_fn` does (its module is imported: that is the check); with `import_module=False`
    only the path's form and the module's presence on the path are checked (parent packages are
    imported by `importlib.util.find_spec`, the module itself is not run).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(_unknown_message(name))
    name = name.strip()
    if name in BUILTIN_REWARDS:
        return name
    if not _is_dotted(name):
        raise ValueError(_unknown_message(name))
    if import_module:
        get_reward_fn(name)
        return name
    module_name, _ = _split_dotted(name)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"reward function {name!r}: cannot import module {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if spec is None:
        raise ValueError(f"reward function {name!r}: cannot import module {module_name!r}: "
                         f"no module named {module_name!r} on the Python path")
    return name


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def score_batch(fn: RewardFn, responses: Sequence[str], answers: Sequence[str],
                prompts: Sequence[str] | None = None) -> list[float]:
    """Score each (response, answer, prompt); results clamped to [0, 1].

    Raises ValueError when the lengths differ or the function returns NaN, and TypeError naming the
    function and the row when it returns something that is not a number (None, a string, ...).
    """
    if prompts is None:
        prompts = [""] * len(responses)
    if not (len(responses) == len(answers) == len(prompts)):
        raise ValueError(f"score_batch: {len(responses)} responses, {len(answers)} answers and "
                         f"{len(prompts)} prompts; they must have the same length")
    scores = []
    for i, (response, answer, prompt) in enumerate(zip(responses, answers, prompts)):
        value = fn(response, answer, prompt)
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise TypeError(f"reward function {_fn_name(fn)} returned {value!r} "
                            f"({type(value).__name__}) for row {i}; it must return a float in [0, 1]")
        try:
            score = float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"reward function {_fn_name(fn)} returned {value!r} for row {i}, which is "
                            f"not a single number; it must return a float in [0, 1]") from exc
        if math.isnan(score):
            raise ValueError(f"reward function {_fn_name(fn)} returned NaN for row {i}; it must "
                            f"return a float in [0, 1]")
        scores.append(min(1.0, max(0.0, score)))
    return scores
