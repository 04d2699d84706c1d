"""PromptLoader: batch layout, determinism, epochs, exact resume, truncation, preprocessed ids."""
import numpy as np
import pytest

from mindspeed_rl.data import (PromptDataset, PromptLoader, SyntheticPromptDataset, decode_label,
                               encode_label, load_prompt_dataset)
from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.models.tokenizer import CHARACTERS


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def char_ids(text):
    return [4 + CHARACTERS.index(c) for c in text]


def answers(batches):
    return [a for b in batches for a in b["answer_text"]]


def test_batch_layout(tok):
    ds = SyntheticPromptDataset("add", size=20, seed=0)
    batch = PromptLoader(ds, tok, prompts_per_step=4, seed=0).next_batch()
    assert set(batch) == {"prompts", "prompt_length", "labels", "prompt_text", "answer_text"}
    assert all(len(v) == 4 for v in batch.values())
    for ids, length, label, text, answer in zip(*(batch[k] for k in (
            "prompts", "prompt_length", "labels", "prompt_text", "answer_text"))):
        assert ids.dtype == np.int64 and ids.ndim == 1 and ids.tolist() == char_ids(text)
        assert length.dtype == np.int64 and length.shape == (1,) and length[0] == len(ids) == 8
        assert label.dtype == np.uint8 and decode_label(label) == answer
        assert ds.task.solve(text) == answer


def test_a_batch_holds_every_dataset_column_of_the_graphs(tok):
    """The loader produces exactly the columns every algorithm's graph starts from (one source:
    dataflow/dataset.py), plus the texts for the log."""
    from mindspeed_rl.dataflow import ALGORITHMS, DATASET_KEYS
    batch = PromptLoader(SyntheticPromptDataset("copy", size=4, seed=0), tok, prompts_per_step=2, seed=0).next_batch()
    assert set(batch) - set(DATASET_KEYS) == {"prompt_text", "answer_text"}
    for name, (_, keys) in ALGORITHMS.items():
        if name != "reward_modeling":   # reads preference pairs: data/preferences.py PreferenceLoader
            assert keys is DATASET_KEYS, name
    from mindspeed_rl.data.preferences import PREFERENCE_KEYS
    assert ALGORITHMS["reward_modeling"][1] is PREFERENCE_KEYS


def test_labels_round_trip():
    for text in ("579", "#### 1,000", "é ü 中", ""):
        assert decode_label(encode_label(text)) == text
        assert decode_label(list(encode_label(text))) == text


class FakeTensor:
    """Stands in for a torch tensor (detach / cpu / numpy) without importing torch."""
    def __init__(self, array):
        self.array = array

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.array


def test_labels_from_tensors():
    assert decode_label(FakeTensor(encode_label("42"))) == "42"


def test_same_seed_same_stream_other_seed_other_order(tok):
    ds = SyntheticPromptDataset("copy", size=50, seed=0)

    def run(seed):
        loader = PromptLoader(ds, tok, 8, seed=seed)
        return answers(loader.next_batch() for _ in range(10))
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_epochs_visit_every_record_once_and_reshuffle(tok):
    ds = SyntheticPromptDataset("copy", size=10, seed=0)
    loader = PromptLoader(ds, tok, prompts_per_step=4, seed=3)
    assert len(loader) == 3
    got = answers(loader.next_batch() for _ in range(5))  # 20 prompts = 2 epochs exactly
    assert (loader.epoch, loader.offset) == (2, 0)
    first, second = got[:10], got[10:]
    everything = sorted(r["answer"] for r in ds)
    assert sorted(first) == everything and sorted(second) == everything
    assert first != second
    assert first == [ds[i]["answer"] for i in loader.epoch_order(0)]
    assert second == [ds[i]["answer"] for i in loader.epoch_order(1)]


def test_no_shuffle_keeps_dataset_order(tok):
    ds = SyntheticPromptDataset("copy", size=5, seed=0)
    loader = PromptLoader(ds, tok, prompts_per_step=3, seed=0, shuffle=False)
    got = answers(loader.next_batch() for _ in range(4))
    assert got == [r["answer"] for r in ds] * 2 + [ds[0]["answer"], ds[1]["answer"]]


def test_batch_larger_than_dataset(tok):
    ds = SyntheticPromptDataset("copy", size=3, seed=0)
    loader = PromptLoader(ds, tok, prompts_per_step=7, seed=0)
    got = answers([loader.next_batch()])
    assert len(got) == 7 and (loader.epoch, loader.offset) == (2, 1)
    assert sorted(got[:3]) == sorted(got[3:6]) == sorted(r["answer"] for r in ds)


@pytest.mark.parametrize("size", [7, 12, 100])
def test_resume_continues_exactly(tok, size):
    ds = SyntheticPromptDataset("reverse", size=size, seed=0)
    straight = PromptLoader(ds, tok, prompts_per_step=4, seed=5)
    six = [straight.next_batch() for _ in range(6)]
    first = PromptLoader(ds, tok, prompts_per_step=4, seed=5)
    three = [first.next_batch() for _ in range(3)]
    state = first.state_dict()
    resumed = PromptLoader(ds, tok, prompts_per_step=4, seed=5)
    resumed.load_state_dict(state)
    then = [resumed.next_batch() for _ in range(3)]
    for a, b in zip(six, three + then):
        assert a["answer_text"] == b["answer_text"] and a["prompt_text"] == b["prompt_text"]
        assert all(np.array_equal(x, y) for x, y in zip(a["prompts"], b["prompts"]))
    assert resumed.state_dict() == straight.state_dict()


def test_resume_refuses_another_order(tok):
    ds = SyntheticPromptDataset("copy", size=10, seed=0)
    state = PromptLoader(ds, tok, 4, seed=5).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=5 but this run has seed=6"):
        PromptLoader(ds, tok, 4, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint has dataset_size=10 but this run has dataset_size=11"):
        PromptLoader(SyntheticPromptDataset("copy", size=11), tok, 4, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint has shuffle=True but this run has shuffle=False"):
        PromptLoader(ds, tok, 4, seed=5, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="offset=10 is outside a dataset of 10 records"):
        PromptLoader(ds, tok, 4, seed=5).load_state_dict({**state, "offset": 10})


def test_truncation_keeps_the_end_and_counts(tok):
    ds = PromptDataset([{"prompt": "123+456=", "answer": "579"}, {"prompt": "12=", "answer": "12"}])
    loader = PromptLoader(ds, tok, prompts_per_step=2, seed=0, shuffle=False, max_prompt_length=4)
    batch = loader.next_batch()
    assert [x.tolist() for x in batch["prompts"]] == [char_ids("456="), char_ids("12=")]
    assert [int(x[0]) for x in batch["prompt_length"]] == [4, 3]
    assert batch["prompt_text"] == ["123+456=", "12="]  # the text is not cut
    assert loader.truncated == 1
    loader.next_batch()
    assert loader.truncated == 2 and loader.state_dict()["truncated"] == 2


class NoTokenizing:
    """A tokenizer that must not be called: preprocessed records carry their ids."""
    def __len__(self):
        return 100

    def __call__(self, *args, **kwargs):
        raise AssertionError("tokenizer called for a preprocessed dataset")


def test_preprocessed_ids_skip_tokenizing():
    ds = PromptDataset([{"prompt": "ab", "answer": "1", "prompt_ids": [14, 15, 16]}])
    loader = PromptLoader(ds, NoTokenizing(), 2, seed=0, max_prompt_length=2)
    batch = loader.next_batch()
    assert [x.tolist() for x in batch["prompts"]] == [[15, 16], [15, 16]]
    assert batch["prompts"][0].dtype == np.int64 and loader.truncated == 2
    bad = PromptDataset([{"prompt": "ab", "answer": "1", "prompt_ids": [14, 500]}])
    with pytest.raises(ValueError, match="id 500, beyond the tokenizer's 100 tokens"):
        PromptLoader(bad, NoTokenizing(), 1, seed=0).next_batch()


# The built-in tokenizer knows only digits, "+" and "=": the template marks roles with those.
TEMPLATE = ("{% for m in messages %}{{ '0' if m['role'] == 'system' else '1' }}+{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}={% endif %}")


def test_chat_template():
    tok = build_char_tokenizer()
    ds = PromptDataset([{"prompt": "12", "answer": "12"},
                        {"prompt": [{"role": "system", "content": "9"},
                                    {"role": "user", "content": "34"}], "answer": "34"}])
    with pytest.raises(ValueError, match="has no chat template"):
        PromptLoader(ds, tok, 2, seed=0, apply_chat_template=True)
    with pytest.raises(ValueError, match="prompt 0 is a list of chat messages; turn on apply_chat_template"):
        PromptLoader(PromptDataset(ds.records[1:]), tok, 1, seed=0).next_batch()
    tok.chat_template = TEMPLATE
    batch = PromptLoader(ds, tok, 2, seed=0, shuffle=False, apply_chat_template=True).next_batch()
    assert [x.tolist() for x in batch["prompts"]] == [char_ids("1+12="), char_ids("0+91+34=")]
    assert batch["prompt_text"] == ["12", "34"]


def test_argument_errors(tok):
    ds = SyntheticPromptDataset("copy", size=4)
    with pytest.raises(ValueError, match="is empty"):
        PromptLoader(PromptDataset([]), tok, 1, seed=0)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="prompts_per_step must be a positive integer"):
            PromptLoader(ds, tok, bad, seed=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        PromptLoader(ds, tok, 1, seed=-1)
    with pytest.raises(ValueError, match="max_prompt_length must be a positive integer or None"):
        PromptLoader(ds, tok, 1, seed=0, max_prompt_length=0)
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        PromptLoader(PromptDataset([{"prompt": "", "answer": "1"}]), tok, 1, seed=0).next_batch()


def test_loader_over_a_jsonl_file(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text('{"q": "40+2=", "a": "#### 42"}\n')
    ds = load_prompt_dataset(tmp_path / "d.jsonl", prompt_key="q", answer_key="a")
    batch = PromptLoader(ds, tok, 1, seed=0).next_batch()
    assert batch["prompts"][0].tolist() == char_ids("40+2=")  # no bos/eos added
    assert decode_label(batch["labels"][0]) == "#### 42"
