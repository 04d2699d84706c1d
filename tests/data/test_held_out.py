"""The built-in tasks' held-out split: disjoint from the training split by construction."""
import itertools

import pytest

from mindspeed_rl.data import SyntheticPromptDataset, load_prompt_dataset
from mindspeed_rl.data.synthetic import KINDS, SyntheticTask, is_held_out


def test_copy_splits_are_disjoint_over_the_whole_prompt_space():
    """Every 3-digit copy prompt is in exactly one split; training never draws a held-out one (any seed)
    and the held-out split is all the held-out prompts the task has."""
    space = {"".join(d) + "=" for d in itertools.product("0123456789", repeat=3)}
    held = {p for p in space if is_held_out(p)}
    assert 50 < len(held) < 200                       # about one in ten
    val = SyntheticPromptDataset("copy", size=1000, seed=1, split="val")
    val_prompts = [r["prompt"] for r in val]
    assert len(val_prompts) == len(set(val_prompts))  # distinct
    assert set(val_prompts) == held                   # fewer than `size` exist: all of them
    for seed in (0, 1, 7):
        train = {r["prompt"] for r in SyntheticPromptDataset("copy", size=10000, seed=seed)}
        assert not train & held
        assert len(train) > 0.99 * len(space - held)  # 10000 draws reach (nearly) every training prompt


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_split_and_answers_stay_right(kind):
    task = SyntheticTask(kind, 3)
    val = SyntheticPromptDataset(task, size=64, seed=3, split="val")
    train = SyntheticPromptDataset(task, size=2000, seed=3)
    assert len(val) == 64 and len(train) == 2000
    assert all(is_held_out(r["prompt"]) for r in val)
    assert not any(is_held_out(r["prompt"]) for r in train)
    assert all(task.solve(r["prompt"]) == r["answer"] for r in itertools.chain(val, train))
    again = SyntheticPromptDataset(task, size=64, seed=3, split="val")
    assert [r["prompt"] for r in again] == [r["prompt"] for r in val]  # a pure function of the seed


def test_load_by_spec_and_refusals():
    val = load_prompt_dataset("builtin:reverse", num_digits=4, size=32, seed=0, split="val")
    assert len(val) == 32 and "held-out split" in val.source
    with pytest.raises(ValueError, match="split must be one of"):
        SyntheticPromptDataset("copy", size=4, split="test")
    one_digit = SyntheticPromptDataset("copy", size=10, num_digits=1, split="val")  # 10 prompts in all
    assert 0 < len(one_digit) < 10
