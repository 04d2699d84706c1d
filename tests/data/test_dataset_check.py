"""A bad dataset file fails before Ray starts: `check_prompt_file` reads every row once, and the CLI
turns its finding into `config error:` and exit 2, naming the file, the line and the key, before any
worker loads its model."""
from __future__ import annotations

import json

import pytest

from mindspeed_rl.data.prompts import MAX_REPORTED, check_prompt_file, load_prompt_dataset

from ..config.test_cli import run_cli

GOOD = {"prompt": "12=", "answer": "12"}


def write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ------------------------------------------------------------------ the check on its own
def test_a_good_file_passes_and_agrees_with_the_loader(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), "", "  ", json.dumps({**GOOD, "x": 1})])
    assert check_prompt_file(path) == 2 == len(load_prompt_dataset(path))
    (tmp_path / "a.json").write_text(json.dumps([GOOD, GOOD, GOOD]))
    assert check_prompt_file(tmp_path / "a.json") == 3


def test_names_every_bad_line_up_to_a_limit_and_counts_them_all(tmp_path):
    lines = [json.dumps(GOOD)] + ['{"prompt": "1=",'] * (MAX_REPORTED + 2) + [json.dumps({"question": "1="})]
    path = write_lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError) as err:
        check_prompt_file(path)
    msg = str(err.value)
    assert msg.startswith(f"{MAX_REPORTED + 3} of {len(lines)} records cannot be read")
    assert f"the first {MAX_REPORTED} of them" in msg
    named = [line for line in msg.splitlines()[1:]]
    assert len(named) == MAX_REPORTED
    assert named[0] == f"  {path}:2: not a JSON object: Expecting property name enclosed in double quotes at character 17"
    assert named[-1].startswith(f"  {path}:{MAX_REPORTED + 1}: ")


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON object: .*utf-8"):
        check_prompt_file(path)


def test_line_numbers_are_the_editors_even_with_u2028_inside_a_string(tmp_path):
    """str.splitlines would cut the first record at U+2028 and number every later line wrong."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b", "answer": "1"}, ensure_ascii=False) + "\n{bad\n",
                    encoding="utf-8")
    with pytest.raises(ValueError, match=rf"1 of 2 records cannot be read.*\n  {path}:2: not a JSON object"):
        check_prompt_file(path)
    path.write_text(json.dumps({"prompt": "a\u2028b", "answer": "1"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_prompt_dataset(path)[0]["prompt"] == "a\u2028b"


@pytest.mark.parametrize("content", ["", "\n\n  \n", "[]"])
def test_an_empty_file_is_refused(tmp_path, content):
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"^no records in {path} \(the file is empty"):
        check_prompt_file(path)


def test_preprocessed_files_are_checked_for_their_ids(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({**GOOD, "prompt_ids": [5, 6]}), json.dumps(GOOD)])
    with pytest.raises(ValueError, match=rf"{path}:2: missing key 'prompt_ids'"):
        check_prompt_file(path, prompt_key="question")  # the format fixes its keys


def test_parquet_rows_are_checked(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["1=", "2=", "3="], "answer": ["1", None, "3"]}), path, row_group_size=2)
    with pytest.raises(ValueError, match=rf"1 of 3 records.*\n  {path} row 1: 'answer' must be a string"):
        check_prompt_file(path, prompt_key="question")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="no records in"):
        check_prompt_file(path)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        check_prompt_file(path)


# ------------------------------------------------------------------ through the CLI, before Ray
# Every finding of the check reaches the CLI the same way; two of them go through it here (a CLI run is
# a fresh interpreter, seconds each), the others' messages are checked above and in test_prompts.py.
def assert_config_error_before_ray(proc, *expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: data.dataset="), proc.stderr
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr)
    assert "Traceback" not in proc.stderr
    # it failed before Ray started, so before any worker loaded a model; a time bound would be flaky on a
    # loaded machine
    assert "[ray-probe] initialized=False" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cli_malformed_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), json.dumps(GOOD), '{"prompt": "3=" "answer": "3"}'])
    proc, _ = run_cli(tmp_path, f"data.dataset={path}")
    assert_config_error_before_ray(proc, "1 of 3 records cannot be read",
                                   f"{path}:3: not a JSON object: Expecting ',' delimiter")


@pytest.mark.slow
def test_cli_missing_prompt_key(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "1=", "answer": "1"})])
    proc, _ = run_cli(tmp_path, f"data.dataset={path}")
    assert_config_error_before_ray(proc, f"{path}:1: missing key 'prompt'", "['answer', 'question']",
                                   "set data.prompt_key to the field that holds the prompt")
