"""Prompt datasets from files: JSONL, JSON, parquet, preprocessed, built-ins, and their errors."""
import json
import sys

import pytest

from mindspeed_rl.data import (JsonlPromptDataset, ParquetPromptDataset, SyntheticPromptDataset,
                               load_prompt_dataset)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_with_custom_keys(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "What is 6*7?", "answer": "6*7=42\n#### 42"}) + "\n\n"
                    + json.dumps({"question": "1+1?", "answer": 2, "extra": "x"}) + "\n")
    ds = JsonlPromptDataset(path, prompt_key="question", answer_key="answer")
    assert len(ds) == 2 and not ds.preprocessed
    assert ds[0] == {"prompt": "What is 6*7?", "answer": "6*7=42\n#### 42"}
    assert ds[1] == {"prompt": "1+1?", "answer": "2"}  # numbers become strings
    assert load_prompt_dataset(path, prompt_key="question").records == ds.records


def test_json_array_and_json_lines(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    (tmp_path / "arr.json").write_text(json.dumps(rows))
    write_jsonl(tmp_path / "lines.json", rows)
    assert load_prompt_dataset(tmp_path / "arr.json").records == rows
    assert load_prompt_dataset(str(tmp_path / "lines.json")).records == rows


def test_nested_key_and_chat_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "verl.jsonl",
                       [{"prompt": messages, "reward_model": {"ground_truth": "4"}}])
    ds = load_prompt_dataset(path, answer_key="reward_model.ground_truth")
    assert ds[0] == {"prompt": messages, "answer": "4"}


def test_missing_key_error_names_file_line_and_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"},
                                               {"prompt": "b", "solution": "2"}])
    with pytest.raises(ValueError) as err:
        JsonlPromptDataset(path)
    msg = str(err.value)
    assert f"{path}:2" in msg and "missing key 'answer'" in msg and "['prompt', 'solution']" in msg
    assert "answer_key" in msg
    with pytest.raises(ValueError, match=rf"{path}:1: missing key 'question'.*prompt_key"):
        JsonlPromptDataset(path, prompt_key="question")


def test_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n')
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON object"):
        JsonlPromptDataset(path)
    path.write_text('{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: expected an object .* got list"):
        JsonlPromptDataset(path)
    write_jsonl(path, [{"prompt": 5, "answer": "1"}])
    with pytest.raises(ValueError, match=rf"{path}:1: 'prompt' must be a string or a list of chat"):
        JsonlPromptDataset(path)
    write_jsonl(path, [{"prompt": "a", "answer": None}])
    with pytest.raises(ValueError, match=rf"{path}:1: 'answer' must be a string or a number, got NoneType"):
        JsonlPromptDataset(path)
    (tmp_path / "bad.json").write_text("[{]")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_prompt_dataset(tmp_path / "bad.json")


def test_preprocessed_is_detected_by_prompt_ids(tmp_path):
    path = write_jsonl(tmp_path / "pre.jsonl", [{"prompt": "ab", "answer": "1", "prompt_ids": [14, 15]}])
    ds = load_prompt_dataset(path, prompt_key="question")  # keys are fixed in this format
    assert ds.preprocessed and ds[0] == {"prompt": "ab", "answer": "1", "prompt_ids": [14, 15]}
    write_jsonl(path, [{"prompt": "ab", "answer": "1", "prompt_ids": [14, 15]},
                       {"prompt": "c", "answer": "2"}])
    with pytest.raises(ValueError, match=rf"{path}:2: missing key 'prompt_ids'"):
        load_prompt_dataset(path)
    write_jsonl(path, [{"prompt": "ab", "answer": "1", "prompt_ids": ["a"]}])
    with pytest.raises(ValueError, match=rf"{path}:1: 'prompt_ids' must be a non-empty list"):
        load_prompt_dataset(path)


@pytest.mark.parametrize("kind", ["copy", "reverse", "sort", "add"])
def test_builtin_specs(kind):
    ds = load_prompt_dataset(f"builtin:{kind}", num_digits=4, size=50, seed=3)
    assert isinstance(ds, SyntheticPromptDataset) and len(ds) == 50
    assert ds.task.kind == kind and ds.task.num_digits == 4 and len(ds[0]["answer"]) == 4
    assert ds.records == load_prompt_dataset(f"builtin:{kind}", num_digits=4, size=50, seed=3).records


def test_spec_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown built-in dataset 'builtin:mul'; built-in datasets "
                                         r"are \['builtin:copy', 'builtin:reverse'"):
        load_prompt_dataset("builtin:mul")
    with pytest.raises(ValueError, match=r"data.csv': unsupported file type '.csv'; give a .jsonl, "
                                         r".json, .parquet file or one of builtin:copy") as e:
        load_prompt_dataset(tmp_path / "data.csv")
    from mindspeed_rl.data import SYNTHETIC_KINDS  # the one list of built-in tasks, named in full
    assert str(e.value).endswith("one of " + ", ".join(f"builtin:{k}" for k in SYNTHETIC_KINDS))
    with pytest.raises(FileNotFoundError, match="prompt dataset .*missing.jsonl' does not exist"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        load_prompt_dataset(tmp_path / "dir.jsonl")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"d.parquet' needs pyarrow: pip install pyarrow"):
        load_prompt_dataset(path)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        ParquetPromptDataset(path)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 1", "#### 2"]}), path)
    ds = load_prompt_dataset(path, prompt_key="question")
    assert ds.records == [{"prompt": "q1", "answer": "#### 1"}, {"prompt": "q2", "answer": "#### 2"}]
    with pytest.raises(ValueError, match=rf"{path} row 0: missing key 'prompt'"):
        load_prompt_dataset(path)
