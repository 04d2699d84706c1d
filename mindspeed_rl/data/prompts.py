"""Prompt datasets from files: JSONL / JSON, Parquet, the preprocessed JSONL, and the built-ins.

Every dataset is a `PromptDataset`: records `{"prompt": ..., "answer": str}`. `prompt_key` and
`answer_key` name the source fields; a dotted key reaches into nested fields (verl-style parquet:
`answer_key="reward_model.ground_truth"`). A prompt is a string, or a list of chat messages
(`[{"role": "user", "content": ...}]`, which the loader renders with the chat template).

The preprocessed format (written by `cli/preprocess_data.py`) is JSONL whose lines hold `prompt`,
`answer` and `prompt_ids`; a file whose first record has `prompt_ids` is read as that format
(`prompt_key` / `answer_key` are then ignored) and the loader uses the ids as they are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .base import ANSWER, PROMPT, PROMPT_IDS, PromptDataset, Record

BUILTIN_PREFIX = "builtin:"
SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_REPORTED = 5  # bad rows a file check names one by one (it counts them all)
PARQUET_BATCH_ROWS = 4096
MISSING = object()


class BadRow:
    """A source row that does not parse: it carries why, so a check can go on past it and count them all."""

    def __init__(self, problem: str):
        self.problem = problem


def lookup_field(raw: dict, key: str) -> Any:
    """raw[key], or for a dotted key the nested field (`"a.b"` -> raw["a"]["b"])."""
    if key in raw:
        return raw[key]
    value: Any = raw
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def make_record(raw: Any, where: str, prompt_key: str = PROMPT, answer_key: str = ANSWER,
                preprocessed: bool = False, setting_prefix: str = "") -> Record:
    """Turn one source row into a record; errors start with `where` (file and line or row).

    `setting_prefix` is how the caller names the key settings (`data.` for the trainer's config), so
    the fix in a message is the setting the user actually has.
    """
    if isinstance(raw, BadRow):
        raise ValueError(f"{where}: {raw.problem}")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with {prompt_key!r} and {answer_key!r}, "
                         f"got {type(raw).__name__}")
    if preprocessed:
        prompt_key, answer_key = PROMPT, ANSWER
    fields = {}
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        value = lookup_field(raw, key)
        if value is MISSING:
            raise ValueError(f"{where}: missing key {key!r} (the row has keys {sorted(raw)}); "
                             f"set {setting_prefix}{role} to the field that holds the "
                             f"{role.split('_')[0]}")
        fields[role] = value
    prompt, answer = fields["prompt_key"], fields["answer_key"]
    if not isinstance(prompt, str):
        if not (isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"{where}: {prompt_key!r} must be a string or a list of chat messages "
                             f"{{'role', 'content'}}, got {type(prompt).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: {answer_key!r} must be a string or a number, "
                         f"got {type(answer).__name__}")
    record = {PROMPT: prompt, ANSWER: str(answer)}
    if preprocessed:
        ids = raw.get(PROMPT_IDS, MISSING)
        if ids is MISSING:
            raise ValueError(f"{where}: missing key {PROMPT_IDS!r} (the file's first record has it, "
                             f"so every record of this preprocessed file must)")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"{where}: {PROMPT_IDS!r} must be a non-empty list of token ids")
        record[PROMPT_IDS] = ids
    return record


def _check_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"prompt dataset {str(path)!r} is not a file")


def _starts_with_array(path: Path) -> bool:
    """Is the file one JSON array (its first non-blank byte `[`) rather than JSON lines?"""
    with path.open("rb") as f:
        while chunk := f.read(4096):
            head = chunk.lstrip()
            if head:
                return head.startswith(b"[")
    return False


def _json_error(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):  # its own "line 1 column 9" would read as the file's line 1
        return f"{exc.msg} at character {exc.pos + 1}"
    return str(exc)  # a UnicodeDecodeError: the line is not UTF-8


def json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed row) per record of a JSONL file, streaming line by line (blank lines skipped),
    or per item of a file holding one JSON array; a line that does not parse comes as a `BadRow`.

    Lines are split at newline bytes only: a JSON string cannot hold a raw newline, but it may hold a
    raw U+2028 or form feed, where `str.splitlines` would cut a record in two.
    """
    if _starts_with_array(path):
        try:
            items = json.loads(path.read_bytes())
        except ValueError as exc:
            yield str(path), BadRow(f"not valid JSON: {_json_error(exc)}")
            return
        for i, item in enumerate(items):
            yield f"{path} item {i}", item
        return
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line.rstrip(b"\r\n"))
            except ValueError as exc:
                row = BadRow(f"not a JSON object: {_json_error(exc)}")
            yield f"{path}:{lineno}", row


def parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row dict) per row of a parquet file, read in batches of PARQUET_BATCH_ROWS rows."""
    pq = _import_parquet(path)
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid & co.: not a parquet file, or a truncated one
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from exc
    i = 0
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for raw in batch.to_pylist():
            yield f"{path} row {i}", raw
            i += 1


def _is_preprocessed(first_row: Any) -> bool:
    return isinstance(first_row, dict) and PROMPT_IDS in first_row


class JsonlPromptDataset(PromptDataset):
    """One JSON object per line (blank lines skipped); a `.json` file holding one array also works."""

    def __init__(self, path: str | Path, prompt_key: str = PROMPT, answer_key: str = ANSWER):
        path = Path(path)
        _check_file(path)
        rows = list(json_rows(path))
        preprocessed = bool(rows) and _is_preprocessed(rows[0][1])
        super().__init__([make_record(raw, where, prompt_key, answer_key, preprocessed)
                          for where, raw in rows], source=str(path))


def _import_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading the parquet dataset {str(path)!r} needs pyarrow: "
                          f"pip install pyarrow (or convert it to JSONL)") from exc
    return pq


class ParquetPromptDataset(PromptDataset):
    """A parquet table, one row per record; needs pyarrow (imported only here)."""

    def __init__(self, path: str | Path, prompt_key: str = PROMPT, answer_key: str = ANSWER):
        path = Path(path)
        _check_file(path)
        rows = list(parquet_rows(path))
        preprocessed = bool(rows) and _is_preprocessed(rows[0][1])
        super().__init__([make_record(raw, where, prompt_key, answer_key, preprocessed)
                          for where, raw in rows], source=str(path))


def check_prompt_file(spec: str | Path, prompt_key: str = PROMPT, answer_key: str = ANSWER,
                      setting_prefix: str = "") -> int:
    """Read a dataset file once, streaming, and check every row as the loader will; return the count.

    Why: the trainer loads its dataset after every worker has loaded its model (minutes for a 7B
    model), so a bad line found there wastes all of that. This pass parses each row and keeps none,
    so it costs one read of the file. Raises ValueError for a file without records, or listing the
    first MAX_REPORTED bad rows (file:line or row, the problem, the key) and how many are bad in all.
    """
    path = Path(spec).expanduser()
    _check_file(path)
    rows = parquet_rows(path) if path.suffix.lower() == ".parquet" else json_rows(path)
    count, bad, problems, preprocessed = 0, 0, [], False
    for where, raw in rows:
        if count == 0:
            preprocessed = _is_preprocessed(raw)
        count += 1
        try:
            make_record(raw, where, prompt_key, answer_key, preprocessed, setting_prefix)
        except ValueError as exc:
            bad += 1
            if len(problems) < MAX_REPORTED:
                problems.append(str(exc))
    if count == 0:
        raise ValueError(f"no records in {path} (the file is empty or has only blank lines, or is an empty "
                         f"array or table); give a file with one {{{prompt_key!r}: ..., {answer_key!r}: ...}} record "
                         f"per line, or a built-in task such as builtin:copy")
    if bad:
        shown = f", the first {len(problems)} of them" if bad > len(problems) else ""
        raise ValueError(f"{bad} of {count} records cannot be read (fix or drop them: the trainer would stop at the "
                         f"first){shown}:\n  " + "\n  ".join(problems))
    return count


def load_prompt_dataset(spec: str | Path, prompt_key: str = PROMPT, answer_key: str = ANSWER,
                        num_digits: int = 3, size: int = 10000, seed: int = 0, split: str = "train",
                        val_fraction: float = 0.0) -> PromptDataset:
    """The dataset named by `spec`.

    `builtin:copy` / `builtin:reverse` / `builtin:sort` / `builtin:add`: a synthetic task
    (`num_digits`, `size`, `seed` apply; `split` "train" or "val", its held-out prompts: disjoint, see
    data/synthetic.py); otherwise a file chosen by suffix: `.jsonl` / `.json` (JSON lines, or one JSON
    array), `.parquet`; a preprocessed JSONL is recognised by its `prompt_ids`. A file is the split it is,
    unless `val_fraction` > 0: then `split` is its side of the hash split (data/hash_split.py).
    """
    spec_str = str(spec)
    if spec_str.startswith(BUILTIN_PREFIX):
        from .synthetic import KINDS, SyntheticPromptDataset, SyntheticTask

        kind = spec_str[len(BUILTIN_PREFIX):]
        if kind not in KINDS:
            raise ValueError(f"unknown built-in dataset {spec_str!r}; built-in datasets are "
                             f"{[BUILTIN_PREFIX + k for k in KINDS]}")
        return SyntheticPromptDataset(SyntheticTask(kind, num_digits), size=size, seed=seed, split=split)
    path = Path(spec_str).expanduser()
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        from .synthetic import KINDS
        raise ValueError(f"prompt dataset {spec_str!r}: unsupported file type {suffix or '(none)'!r}; "
                         f"give a {', '.join(SUFFIXES)} file or one of "
                         f"{', '.join(BUILTIN_PREFIX + k for k in KINDS)}")
    whole = ParquetPromptDataset(path, prompt_key, answer_key) if suffix == ".parquet" \
        else JsonlPromptDataset(path, prompt_key, answer_key)
    if not val_fraction:
        return whole
    from .hash_split import split_by_hash
    return split_by_hash(whole, val_fraction, split)
