"""The reward registry: built-in names, dotted paths, config validation, score_batch, errors."""
import math
import sys

import numpy as np
import pytest

from mindspeed_rl.rewards import (BUILTIN_REWARDS, digits, get_reward_fn, gsm8k, score_batch,
                                  check_reward_name)
from tests.rewards import custom_reward_example as example

MODULE = "tests.rewards.custom_reward_example"


def test_builtin_names():
    assert set(BUILTIN_REWARDS) == {"gsm8k", "gsm8k_flexible", "exact_match", "digits", "final_digits", "calc_digits", "answer_digits",
                                     "lookup_answer"}
    assert get_reward_fn("gsm8k") is gsm8k
    assert get_reward_fn(" digits ") is digits
    for name in BUILTIN_REWARDS:
        assert check_reward_name(name) == name
        assert 0.0 <= get_reward_fn(name)("1", "1", "") <= 1.0


@pytest.mark.parametrize("path", [f"{MODULE}:length_reward", f"{MODULE}.length_reward"])
def test_custom_reward_by_dotted_path(path):
    fn = get_reward_fn(path)
    assert fn is example.length_reward
    assert fn("abc", "abc", "p") == 1.0
    assert fn("abcd", "ab", "p") == pytest.approx(1 / 3)
    assert check_reward_name(path) == path
    assert check_reward_name(path, import_module=False) == path


def test_custom_reward_nested_attribute():
    assert get_reward_fn(f"{MODULE}:Scorers.always_half")("a", "b", "c") == 0.5


def test_unknown_name_error_lists_builtins_and_dotted_path():
    for call in (get_reward_fn, check_reward_name):
        with pytest.raises(ValueError) as err:
            call("gsm9k")
        msg = str(err.value)
        assert "'gsm9k'" in msg
        for name in BUILTIN_REWARDS:
            assert name in msg
        assert "my_pkg.my_module:my_fn" in msg
    for bad in ("", "   ", "pkg.mod:", ":fn", "pkg..mod:fn", "1pkg.mod:fn"):
        with pytest.raises(ValueError, match="built-in rewards are"):
            get_reward_fn(bad)


def test_dotted_path_that_does_not_import():
    with pytest.raises(ValueError) as err:
        get_reward_fn("no_such_pkg_xyz.rewards:fn")
    msg = str(err.value)
    assert "no_such_pkg_xyz.rewards:fn" in msg and "cannot import module 'no_such_pkg_xyz.rewards'" in msg
    assert "ModuleNotFoundError" in msg and "no_such_pkg_xyz" in msg
    assert isinstance(err.value.__cause__, ImportError)


def test_dotted_path_whose_module_raises_on_import():
    with pytest.raises(ValueError, match="mindspeed_rl_no_such_dependency"):
        get_reward_fn("tests.rewards.broken_reward_module:reward")


def test_dotted_path_missing_attribute_or_not_callable():
    with pytest.raises(ValueError, match=f"module '{MODULE}' has no attribute 'nope'"):
        get_reward_fn(f"{MODULE}:nope")
    with pytest.raises(ValueError, match="'NOT_CALLABLE' .* is a int, not a function"):
        get_reward_fn(f"{MODULE}:NOT_CALLABLE")


def test_validate_without_import_does_not_run_the_module():
    name = "tests.rewards.broken_reward_module:reward"
    sys.modules.pop("tests.rewards.broken_reward_module", None)
    assert check_reward_name(name, import_module=False) == name
    assert "tests.rewards.broken_reward_module" not in sys.modules
    with pytest.raises(ValueError, match="no module named 'tests.rewards.nope'"):
        check_reward_name("tests.rewards.nope:fn", import_module=False)
    with pytest.raises(ValueError, match="cannot import module"):
        check_reward_name(name)


def test_score_batch_scores_and_clamps():
    assert score_batch(digits, ["123", "124", "9"], ["123", "123", "123"], ["", "", ""]) == \
        pytest.approx([1.0, 2 / 3, 0.0])
    assert score_batch(example.out_of_range, ["big", "small"], ["a", "b"], ["", ""]) == [1.0, 0.0]
    assert score_batch(lambda r, a, p: np.float32(0.25), ["x"], ["y"], ["z"]) == [0.25]
    assert score_batch(lambda r, a, p: True, ["x"], ["y"]) == [1.0]   # prompts default to ""
    assert score_batch(digits, [], [], []) == []
    assert all(isinstance(s, float) for s in score_batch(lambda r, a, p: 1, ["x"], ["y"], [""]))


def test_score_batch_errors():
    with pytest.raises(TypeError, match=r"<lambda> returned None \(NoneType\) for row 1; it must "
                                        r"return a float in \[0, 1\]"):
        score_batch(lambda r, a, p: 0.0 if r == "a" else None, ["a", "b"], ["", ""], ["", ""])
    with pytest.raises(TypeError, match=r"returns_none returned None \(NoneType\) for row 0"):
        score_batch(example.returns_none, ["a"], ["b"], ["c"])
    with pytest.raises(TypeError, match=r"returns_string returned '1.0' \(str\) for row 0"):
        score_batch(example.returns_string, ["a"], ["b"], ["c"])
    with pytest.raises(ValueError, match="returns_nan returned NaN for row 0"):
        score_batch(example.returns_nan, ["a"], ["b"], ["c"])
    with pytest.raises(TypeError, match="not a single number"):
        score_batch(lambda r, a, p: np.array([0.1, 0.2]), ["a"], ["b"], ["c"])
    with pytest.raises(ValueError, match="2 responses, 1 answers and 2 prompts"):
        score_batch(digits, ["a", "b"], ["a"], ["", ""])
    assert math.isfinite(score_batch(lambda r, a, p: float("inf"), ["a"], ["b"], ["c"])[0])
