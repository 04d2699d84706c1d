"""A user's prompt file split into training and held-out prompts by a hash of each prompt (`data.val_fraction`).

The split is a property of the prompt text, as the built-in tasks' is (`synthetic.is_held_out`): the same
prompt is on the same side for every seed, shuffle and file order, a prompt repeated in the file never
lands on both sides, and training draws the same prompts whether validation is on or not. A prompt goes
to the held-out side when the CRC-32 of its text (a chat prompt: its messages as sorted JSON) falls in the
first `fraction` of BUCKETS buckets, so the held-out share is `fraction` up to the hash's spread.
`overlap` counts the prompts two datasets share: what `data.val_dataset` beside `data.dataset` is checked by.
"""
from __future__ import annotations

import json
import zlib
from typing import Any

from .base import PROMPT, PromptDataset

BUCKETS = 10_000
SIDES = ("train", "val")


def prompt_text(prompt: Any) -> str:
    """The text a prompt is hashed and compared by: itself, or a chat prompt's messages as sorted JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def is_held_out(prompt: Any, fraction: float) -> bool:
    return zlib.crc32(prompt_text(prompt).encode("utf-8")) % BUCKETS < round(fraction * BUCKETS)


def split_by_hash(dataset: PromptDataset, fraction: float, side: str) -> PromptDataset:
    """The records of `dataset` on `side` ("train" or "val") of the split at `fraction`. Raises ValueError
    naming data.val_fraction when that side holds no prompt."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {list(SIDES)}, got {side!r}")
    held = side == "val"
    records = [r for r in dataset.records if is_held_out(r[PROMPT], fraction) == held]
    if not records:
        raise ValueError(f"data.val_fraction={fraction}: of the {len(dataset)} prompts of {dataset.source!r} none is "
                         f"{'held out' if held else 'left to train on'}; "
                         f"{'raise' if held else 'lower'} it")
    out = PromptDataset(records, source=f"{dataset.source} ({'held-out' if held else 'training'} prompts of "
                                         f"data.val_fraction={fraction})")
    out.preprocessed = dataset.preprocessed
    return out


def overlap(training: PromptDataset, held: PromptDataset) -> tuple[int, int]:
    """(how many of `held`'s distinct prompts are also in `training`, how many distinct prompts `held` has)."""
    seen = {prompt_text(r[PROMPT]) for r in training.records}
    distinct = {prompt_text(r[PROMPT]) for r in held.records}
    return len(distinct & seen), len(distinct)
