"""Rule rewards: `fn(response: str, answer: str, prompt: str) -> float` in [0, 1].

`get_reward_fn(name)` gives a built-in (`gsm8k`, `gsm8k_flexible`, `exact_match`, `digits`,
`final_digits`) or your
own function by dotted path (`"my_pkg.my_mod:fn"`); `score_batch` runs one over a batch.
"""
from .gsm8k import answers_equal, extract_answer, gsm8k, gsm8k_flexible, gsm8k_reward, parse_number
from .registry import BUILTIN_REWARDS, RewardFn, check_reward_name, get_reward_fn, score_batch
from .rules import answer_digits, calc_digits, digits, exact_match, final_digits

__all__ = ["BUILTIN_REWARDS", "RewardFn", "answer_digits", "answers_equal", "calc_digits", "digits", "exact_match", "extract_answer", "final_digits",
           "get_reward_fn", "gsm8k", "gsm8k_flexible", "gsm8k_reward", "parse_number",
           "score_batch", "check_reward_name"]
