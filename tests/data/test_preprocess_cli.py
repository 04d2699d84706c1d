"""cli/preprocess_data.py end to end: tokenize a tiny dataset, then load its output."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.data import PromptLoader, load_prompt_dataset
from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.models.tokenizer import CHARACTERS

REPO = Path(__file__).resolve().parents[2]
# The built-in char tokenizer knows digits, "+" and "=" only: the questions use just those.
ROWS = [{"question": "40+2=", "answer": "40+2=<<40+2=42>>42\n#### 42"},
        {"question": "1+1+1+1+1+1+1+1=", "answer": "#### 8"},
        {"question": "1+1=", "answer": "#### 2"}]


def char_ids(text):
    return [4 + CHARACTERS.index(c) for c in text]


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    """Run as a script from the repo root, with a tokenizer directory (as a real checkpoint's)."""
    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tok_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "sub" / "pre.jsonl"
    proc = subprocess.run(
        [sys.executable, "cli/preprocess_data.py", "--input", str(src), "--output", str(out),
         "--tokenizer", str(tok_dir), "--prompt-key", "question", "--max-prompt-length", "12"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rows=3 truncated=1 mean_prompt_length=7.0 max_prompt_length=12" in proc.stdout, proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"prompt": "40+2=", "answer": ROWS[0]["answer"], "prompt_ids": char_ids("40+2=")}
    assert lines[1]["prompt_ids"] == char_ids("+1+1+1+1+1+1=")[1:]  # the last 12 characters
    ds = load_prompt_dataset(out)
    assert ds.preprocessed and len(ds) == 3 and ds[0]["answer"].endswith("#### 42")
    batch = PromptLoader(ds, build_char_tokenizer(), 3, seed=0, shuffle=False).next_batch()
    assert batch["prompts"][2].tolist() == char_ids("1+1=")
    assert batch["answer_text"][0] == ROWS[0]["answer"]


@pytest.fixture(scope="module")
def preprocess_data():
    sys.path.insert(0, str(REPO / "cli"))
    try:
        import preprocess_data
    finally:
        sys.path.remove(str(REPO / "cli"))
    return preprocess_data


def test_cli_builtin_task(tmp_path, preprocess_data, capsys):
    # (--tokenizer builtin:tiny-qwen2 goes through models.load_tokenizer, tested with the models;
    # building the tiny checkpoint here would cost seconds)
    tok_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "add.jsonl"
    assert preprocess_data.main(["--input", "builtin:add", "--output", str(out), "--tokenizer",
                                 str(tok_dir), "--size", "20", "--num-digits", "2"]) == 0
    assert "rows=20 truncated=0 mean_prompt_length=6.0 max_prompt_length=6" in capsys.readouterr().out
    ds = load_prompt_dataset(out)
    assert ds.preprocessed and all(r["prompt_ids"] == char_ids(r["prompt"]) for r in ds)
    assert [r["prompt"] for r in ds] == [r["prompt"] for r in
                                         load_prompt_dataset("builtin:add", num_digits=2, size=20)]


def test_cli_errors(tmp_path, preprocess_data):
    tok_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit, match="error: prompt dataset .*nope.jsonl' does not exist"):
        preprocess_data.main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(out),
                              "--tokenizer", str(tok_dir)])
    with pytest.raises(SystemExit, match="--chat-template given but the tokenizer"):
        preprocess_data.main(["--input", "builtin:copy", "--output", str(out), "--tokenizer",
                              str(tok_dir), "--chat-template", "--size", "2"])
    with pytest.raises(SystemExit, match="--max-prompt-length must be a positive integer"):
        preprocess_data.main(["--input", "builtin:copy", "--output", str(out), "--tokenizer",
                              str(tok_dir), "--max-prompt-length", "0"])
    assert not out.exists()


def test_record_fields_have_one_source(preprocess_data):
    """The record's fields are named once (data/base.py); the defaults of the source fields that spell
    them (the CLI's --prompt-key / --answer-key, the config's data.prompt_key / data.answer_key, the
    loaders' keyword defaults) are those names."""
    import inspect

    from mindspeed_rl.config import DataConfig
    from mindspeed_rl.data import base, check_prompt_file, make_record
    args = preprocess_data.parse_args(["--input", "x", "--output", "y", "--tokenizer", "z"])
    assert (args.prompt_key, args.answer_key) == base.RECORD_KEYS == (base.PROMPT, base.ANSWER)
    assert (DataConfig().prompt_key, DataConfig().answer_key) == base.RECORD_KEYS
    for fn in (make_record, check_prompt_file, load_prompt_dataset):
        params = inspect.signature(fn).parameters
        assert (params["prompt_key"].default, params["answer_key"].default) == base.RECORD_KEYS, fn
    assert tuple(load_prompt_dataset("builtin:copy", size=2)[0]) == base.RECORD_KEYS
    assert tuple(make_record({"prompt": "1", "answer": 1, "prompt_ids": [5]}, "row 0", preprocessed=True)) == (
        *base.RECORD_KEYS, base.PROMPT_IDS)
