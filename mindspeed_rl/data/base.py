"""The record list every prompt dataset is: `{"prompt": ..., "answer": str}` dicts, indexable."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

Record = dict[str, Any]

# The fields of a record, named once. PROMPT and ANSWER are also the default source fields a file
# dataset reads them from (`prompt_key` / `answer_key` here, `--prompt-key` / `--answer-key` of
# cli/preprocess_data.py); config/schema.py's DataConfig, a layer below, spells the same two defaults
# and tests/data/test_prompts.py checks that they agree. A preprocessed record adds PROMPT_IDS.
PROMPT, ANSWER, PROMPT_IDS = "prompt", "answer", "prompt_ids"
RECORD_KEYS = (PROMPT, ANSWER)


class PromptDataset:
    """A finite, indexable list of prompt records.

    Each record has `prompt` (a string, or a list of chat messages `{"role", "content"}`) and
    `answer` (a string: the reference the reward function compares against). A preprocessed
    record also has `prompt_ids` (the prompt's token ids), and the loader then skips tokenizing.
    """

    def __init__(self, records: Sequence[Record], source: str = "<records>"):
        self.records = list(records)
        self.source = source
        self.preprocessed = bool(self.records) and all(PROMPT_IDS in r for r in self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        kind = ", preprocessed" if self.preprocessed else ""
        return f"{type(self).__name__}({self.source!r}, {len(self)} records{kind})"
