"""Preference data: builtin:copy_pairs, the JSONL loader's errors, the held-out split, the loader."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mindspeed_rl.data.preferences import (CORRUPTIONS, EOS_TEXT, PREFERENCE_KEYS, PreferenceLoader, closeness,
                                           copy_pairs, corrupt, graded_pair, load_preference_dataset,
                                           split_held_out)
from mindspeed_rl.models import build_char_tokenizer


def _strip(text: str) -> str:
    return text[:-len(EOS_TEXT)] if text.endswith(EOS_TEXT) else text


def test_copy_pairs_chosen_is_the_copy_or_closer_and_rejected_is_not():
    ds = copy_pairs(num_digits=3, size=400, seed=5)
    assert len(ds) == 400
    eos = right = 0
    for r in ds:
        digits = r["prompt"][:-1]
        assert r["prompt"] == digits + "=" and len(digits) == 3 and digits.isdigit()
        chosen, rejected = _strip(r["chosen"]), _strip(r["rejected"])
        assert rejected != digits
        assert closeness(chosen, digits) > closeness(rejected, digits)   # the chosen is the closer copy
        right += chosen == digits
        eos += r["chosen"].endswith(EOS_TEXT)
    assert 120 < right < 280   # half the pairs: the right copy against a corrupted one; half graded
    assert 120 < eos < 280     # about half the responses end with <eos>
    assert all(_strip(r["chosen"]) == r["prompt"][:-1] for r in copy_pairs(3, 50, seed=1, graded=0.0))
    assert copy_pairs(3, 50, seed=5).records == copy_pairs(3, 50, seed=5).records
    assert copy_pairs(3, 50, seed=5).records != copy_pairs(3, 50, seed=6).records


def test_closeness_and_graded_pairs():
    assert closeness("123", "123") == 1.0 and closeness("124", "123") == pytest.approx(2 / 3)
    assert closeness("12", "123") == pytest.approx(2 / 3) and closeness("1234", "123") == 0.75
    assert closeness("", "123") == 0.0
    rng = np.random.default_rng(0)
    for _ in range(200):
        better, worse = graded_pair("507", rng)
        assert better != "507" and worse != "507" and closeness(better, "507") > closeness(worse, "507")


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_every_corruption_differs_from_the_right_answer(kind):
    rng = np.random.default_rng(0)
    outs = {corrupt("123", kind, rng) for _ in range(200)}
    assert "123" not in outs
    if kind == "truncated":
        assert outs == {"", "1", "12"}
    if kind == "extra":
        assert all(o.startswith("123") and 4 <= len(o) <= 5 for o in outs)
    if kind in ("digits", "shuffled", "repeated"):
        assert all(len(o) == 3 and o.isdigit() for o in outs)
    if kind == "shuffled":
        assert all(sorted(o) == sorted("123") for o in outs)


def test_empty_rejected_still_has_a_token():
    ds = copy_pairs(3, 2000, seed=1, graded=0.0)
    assert any(r["rejected"] == EOS_TEXT for r in ds)
    assert all(r["rejected"] for r in ds)


def test_builtin_name_and_unknown_builtin():
    assert len(load_preference_dataset("builtin:copy_pairs", size=10, num_digits=4)) == 10
    with pytest.raises(ValueError, match="builtin:copy_pairs"):
        load_preference_dataset("builtin:copy")


def _write(tmp_path, rows, name="pairs.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_jsonl_file_loads_with_custom_and_nested_keys(tmp_path):
    p = _write(tmp_path, [{"q": "hi", "a": {"good": "yes", "bad": "no"}}, {"q": "x", "a": {"good": "1", "bad": "2"}}])
    ds = load_preference_dataset(p, prompt_key="q", chosen_key="a.good", rejected_key="a.bad")
    assert ds.records == [{"prompt": "hi", "chosen": "yes", "rejected": "no"},
                          {"prompt": "x", "chosen": "1", "rejected": "2"}]


def test_jsonl_errors_name_the_file_line_and_key(tmp_path):
    p = _write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=rf"{p}:2: missing key 'rejected' \(data.rejected_key\)"):
        load_preference_dataset(p)
    p = _write(tmp_path, [{"prompt": "a", "chosen": 3, "rejected": "c"}])
    with pytest.raises(ValueError, match=rf"{p}:1: key 'chosen' \(data.chosen_key\) must be a non-empty string"):
        load_preference_dataset(p)
    p = _write(tmp_path, ['{"prompt": "a", "chosen": "b", "rejected": "c"}', "{oops"])
    with pytest.raises(ValueError, match=rf"{p}:2: not a JSON object"):
        load_preference_dataset(p)
    with pytest.raises(ValueError, match="no such file"):
        load_preference_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_preference_dataset(tmp_path / "pairs.csv")


def test_held_out_split_is_seeded_and_disjoint():
    ds = copy_pairs(3, 100, seed=0)
    train, held = split_held_out(ds, 10, seed=3)
    assert len(held) >= 10 and len(train) + len(held) == 100
    # whole prompts: no held-out pair's prompt is trained on, and at least 10 pairs are held out
    assert {r["prompt"] for r in held.records}.isdisjoint({r["prompt"] for r in train.records})
    key = lambda r: (r["prompt"], r["chosen"], r["rejected"])  # noqa: E731
    assert sorted(map(key, train.records + held.records)) == sorted(map(key, ds.records))
    assert split_held_out(ds, 10, seed=3)[1].records == held.records
    assert split_held_out(ds, 10, seed=4)[1].records != held.records
    assert len(split_held_out(ds, 0)[1]) == 0
    with pytest.raises(ValueError, match="data.eval_size=100 leaves nothing to train on"):
        split_held_out(ds, 100)


def test_loader_tokenizes_pairs_and_resumes():
    tok = build_char_tokenizer()
    ds = copy_pairs(3, 20, seed=0, graded=0.0)   # chosen: the right copy
    loader = PreferenceLoader(ds, tok, 4, seed=1)
    batch = loader.next_batch()
    assert set(PREFERENCE_KEYS) <= set(batch)
    assert all(len(batch[k]) == 4 for k in PREFERENCE_KEYS)
    eos = tok.eos_token_id
    for p, c, text in zip(batch["prompts"], batch["chosen"], batch["prompt_text"]):
        assert tok.decode(p.tolist()) == text
        digits = [t for t in c.tolist() if t != eos]
        assert tok.decode(digits) == text[:-1]          # the right copy, <eos> (one token) or not
        assert eos not in c.tolist()[:-1]
    state = loader.state_dict()
    nxt = loader.next_batch()
    again = PreferenceLoader(ds, tok, 4, seed=1)
    again.load_state_dict(state)
    assert [x.tolist() for x in again.next_batch()["rejected"]] == [x.tolist() for x in nxt["rejected"]]


def test_copy_pairs_hold_no_prompt_the_policy_is_validated_on():
    """The reward model trains only on training prompts: none of builtin:copy's held-out split."""
    from mindspeed_rl.data.prompts import load_prompt_dataset
    held = {r["prompt"] for r in load_prompt_dataset("builtin:copy", size=128, seed=1, split="val")}
    prompts = {r["prompt"] for r in copy_pairs(3, 10000, seed=1)}
    assert not held & prompts and len(held) + len(prompts) == 1000   # every 3-digit prompt on one side
