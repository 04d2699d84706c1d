"""The record list every prompt dataset is: `{"prompt": ..., "answer": str}` dicts, indexable."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

Record = dict[str, Any]


class PromptDataset:
    """A finite, indexable list of prompt records.

    Each record has `prompt` (a string, or a list of chat messages `{"role", "content"}`) and
    `answer` (a string: the reference the reward function compares against). A preprocessed
    record also has `prompt_ids` (the prompt's token ids), and the loader then skips tokenizing.
    """

    def __init__(self, records: Sequence[Record], source: str = "<records>"):
        self.records = list(records)
        self.source = source
        self.preprocessed = bool(self.records) and all("prompt_ids" in r for r in self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Record:
        return self.records[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __repr__(self) -> str:
        kind = ", preprocessed" if self.preprocessed else ""
        return f"{type(self).__name__}({self.source!r}, {len(self)} records{kind})"
