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
from typing import Any

from .base import PromptDataset, Record

BUILTIN_PREFIX = "builtin:"
SUFFIXES = (".jsonl", ".json", ".parquet")
_MISSING = object()


def _lookup(raw: dict, key: str) -> Any:
    """raw[key], or for a dotted key the nested field (`"a.b"` -> raw["a"]["b"])."""
    if key in raw:
        return raw[key]
    value: Any = raw
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def make_record(raw: Any, where: str, prompt_key: str = "prompt", answer_key: str = "answer",
                preprocessed: bool = False) -> Record:
    """Turn one source row into a record; errors start with `where` (file and line or row)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with {prompt_key!r} and {answer_key!r}, "
                         f"got {type(raw).__name__}")
    if preprocessed:
        prompt_key, answer_key = "prompt", "answer"
    fields = {}
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        value = _lookup(raw, key)
        if value is _MISSING:
            raise ValueError(f"{where}: missing key {key!r} (the row has keys {sorted(raw)}); "
                             f"set {role} to the field that holds the "
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
    record = {"prompt": prompt, "answer": str(answer)}
    if preprocessed:
        ids = raw.get("prompt_ids", _MISSING)
        if ids is _MISSING:
            raise ValueError(f"{where}: missing key 'prompt_ids' (the file's first record has it, "
                             f"so every record of this preprocessed file must)")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        record["prompt_ids"] = ids
    return record


def _check_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"prompt dataset {str(path)!r} is not a file")


class JsonlPromptDataset(PromptDataset):
    """One JSON object per line (blank lines skipped); a `.json` file holding one array also works."""

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"):
        path = Path(path)
        _check_file(path)
        text = path.read_text(encoding="utf-8")
        rows: list[tuple[str, Any]] = []
        if text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON: {exc}") from exc
            rows = [(f"{path} item {i}", item) for i, item in enumerate(items)]
        else:
            for lineno, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object: {exc}") from exc
        preprocessed = bool(rows) and isinstance(rows[0][1], dict) and "prompt_ids" in rows[0][1]
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

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"):
        path = Path(path)
        _check_file(path)
        pq = _import_parquet(path)
        rows = pq.read_table(path).to_pylist()
        preprocessed = bool(rows) and "prompt_ids" in rows[0]
        super().__init__([make_record(raw, f"{path} row {i}", prompt_key, answer_key, preprocessed)
                          for i, raw in enumerate(rows)], source=str(path))


def load_prompt_dataset(spec: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                        num_digits: int = 3, size: int = 10000, seed: int = 0) -> PromptDataset:
    """The dataset named by `spec`.

    `builtin:copy` / `builtin:reverse` / `builtin:sort` / `builtin:add`: a synthetic task
    (`num_digits`, `size`, `seed` apply); otherwise a file chosen by suffix: `.jsonl` / `.json`
    (JSON lines, or one JSON array), `.parquet`; a preprocessed JSONL is recognised by its
    `prompt_ids`.
    """
    spec_str = str(spec)
    if spec_str.startswith(BUILTIN_PREFIX):
        from .synthetic import KINDS, SyntheticPromptDataset, SyntheticTask

        kind = spec_str[len(BUILTIN_PREFIX):]
        if kind not in KINDS:
            raise ValueError(f"unknown built-in dataset {spec_str!r}; built-in datasets are "
                             f"{[BUILTIN_PREFIX + k for k in KINDS]}")
        return SyntheticPromptDataset(SyntheticTask(kind, num_digits), size=size, seed=seed)
    path = Path(spec_str).expanduser()
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"prompt dataset {spec_str!r}: unsupported file type {suffix or '(none)'!r}; "
                         f"give a {', '.join(SUFFIXES)} file or one of builtin:copy, "
                         f"builtin:reverse, builtin:sort, builtin:add")
    if suffix == ".parquet":
        return ParquetPromptDataset(path, prompt_key, answer_key)
    return JsonlPromptDataset(path, prompt_key, answer_key)
