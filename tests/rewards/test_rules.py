"""exact_match and the `digits` partial credit, with values worked out by hand."""
import pytest

from mindspeed_rl.rewards import digits, exact_match, get_reward_fn


@pytest.mark.parametrize("response, answer, expected", [
    ("123", "123", 1.0),
    ("124", "123", 2 / 3),        # positions 0, 1 right
    ("321", "123", 1 / 3),        # only the middle 2
    ("999", "123", 0.0),
    ("12", "123", 2 / 3),         # short: 2 matches / len(answer) 3
    ("1", "123", 1 / 3),
    ("1234", "123", 3 / 4),       # extra character costs credit: 3 / max(3, 4)
    ("123456", "123", 3 / 6),
    ("0123", "123", 0.0),         # shifted by one: nothing at the same position
    ("", "123", 0.0),
    ("123\n456", "123", 1.0),     # cut at the first newline
    ("123 and more", "123", 1.0), # cut at the first whitespace
    ("12\n3", "123", 2 / 3),
    ("  123", "123", 1.0),        # leading whitespace skipped
    ("1x3", "123", 2 / 3),
    ("5", "5", 1.0),
    ("55", "5", 1 / 2),
    ("", "", 1.0),
])
def test_digits_partial_credit(response, answer, expected):
    assert digits(response, answer, "") == pytest.approx(expected)
    assert get_reward_fn("digits")(response, answer, "") == pytest.approx(expected)


@pytest.mark.parametrize("response, answer, expected", [
    ("42", "42", 1.0), ("  42\n", "42", 1.0), ("42", " 42 ", 1.0),
    ("42.0", "42", 0.0), ("4 2", "42", 0.0), ("", "42", 0.0), ("", "", 1.0),
])
def test_exact_match(response, answer, expected):
    assert exact_match(response, answer, "") == expected
    assert get_reward_fn("exact_match")(response, answer, "") == expected
