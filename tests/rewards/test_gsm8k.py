"""The GSM8K answer check, on hand-written cases."""
import pytest

from mindspeed_rl.rewards import (answers_equal, extract_answer, get_reward_fn, gsm8k,
                                  gsm8k_flexible, parse_number)

SOLUTION_42 = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 42")


@pytest.mark.parametrize("response, answer, expected", [
    ("So the answer is\n#### 42", "42", 1.0),
    ("#### 42", SOLUTION_42, 1.0),                      # reference is a whole GSM8K solution
    ("The total is \\boxed{42}.", "42", 1.0),
    ("The total is \\boxed{42}.", SOLUTION_42, 1.0),
    ("#### 42.0", "42", 1.0),
    ("#### 42.00", "#### 42", 1.0),
    ("#### $42.", "42", 1.0),                           # `$` and trailing `.` stripped
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### $1,000.00", "#### 1000", 1.0),
    ("#### 3/4", "0.75", 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 42.0000001", "42", 1.0),                     # within 1e-6 relative
    ("#### 42.001", "42", 0.0),
    ("#### 41", "42", 0.0),                             # wrong answers
    ("\\boxed{41}", SOLUTION_42, 0.0),
    ("#### 5", "-5", 0.0),
    ("#### 3/4", "0.7", 0.0),
    ("The answer is 42.", "42", 0.0),                   # strict: no #### and no \boxed
    ("", "42", 0.0),                                    # no answer at all
    ("I don't know", "42", 0.0),
    ("#### forty-two", "42", 0.0),
    ("#### 7\n#### 42", "42", 1.0),                     # the last #### wins
    ("\\boxed{7} then \\boxed{42}", "42", 1.0),         # the last \boxed wins
    ("\\boxed{7}\n#### 42", "42", 1.0),                 # #### is preferred over \boxed
    ("#### 42\n\\boxed{7}", "42", 1.0),
    ("\\boxed{x = 42}", "42", 1.0),
    ("\\boxed{42 \\text{ apples}}", "42", 1.0),
    ("\\boxed{{42}}", "42", 1.0),                       # nested braces
    ("#### 42", "#### 42", 1.0),
    ("#### 1/0", "0", 0.0),                             # not a number, not an error
])
def test_gsm8k_cases(response, answer, expected):
    assert gsm8k(response, answer, "prompt") == expected
    assert get_reward_fn("gsm8k")(response, answer, "prompt") == expected


@pytest.mark.parametrize("response, answer, strict, flexible", [
    ("The answer is 42.", "42", 0.0, 1.0),
    ("First 7 apples, then 1,000 more", "1000", 0.0, 1.0),
    ("It costs $3.50.", "3.5", 0.0, 1.0),
    ("7 plus 8 is 15, not 16", "15", 0.0, 0.0),         # the last number is taken
    ("no numbers here", "42", 0.0, 0.0),
    ("#### 42 and then 7", "42", 1.0, 1.0),             # #### still preferred
    ("\\boxed{42}, checked with 7", "42", 1.0, 1.0),
])
def test_gsm8k_flexible_falls_back_to_last_number(response, answer, strict, flexible):
    assert gsm8k(response, answer) == strict
    assert gsm8k_flexible(response, answer) == flexible
    assert get_reward_fn("gsm8k_flexible")(response, answer, "") == flexible


def test_extract_answer():
    assert extract_answer("blah\n#### 72") == "72"
    assert extract_answer("blah #### $1,234.") == "1,234"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "1/2"
    assert extract_answer("no answer 5") is None
    assert extract_answer("no answer 5", strict=False) == "5"
    assert extract_answer("#### yes") == "yes"
    assert extract_answer("\\boxed{}") is None


def test_parse_number_and_equality():
    assert parse_number("1,000") == 1000.0
    assert parse_number("$42.") == 42.0
    assert parse_number("3/4") == 0.75
    assert parse_number(" -2.5 ") == -2.5
    assert parse_number("abc") is None
    assert parse_number("1/0") is None
    assert parse_number("") is None
    assert answers_equal("42", "42.0")
    assert answers_equal("Yes.", "yes")                 # non-numeric answers: normalized text
    assert not answers_equal("42", "yes")
