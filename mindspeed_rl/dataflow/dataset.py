"""The columns a prompt dataset puts into the dock before any MFC runs, named once.

Every algorithm's graph starts from them (`grpo.py`, `ppo.py`, `remax.py` declare them as their
dataset keys; the trainer puts exactly the plan's dataset keys), and the prompt loader produces them
(`data/loader.py` `PromptLoader.next_batch`, which imports these names: the data layer sits above
this one): the prompt's token ids, its length, and the reference answer as UTF-8 bytes.
"""
from __future__ import annotations

PROMPTS = "prompts"              # int64 token ids of the prompt, no padding
PROMPT_LENGTH = "prompt_length"  # [1] int64: len(prompts)
LABELS = "labels"                # uint8: the reference answer's UTF-8 bytes (data.encode_label)

DATASET_KEYS = (PROMPTS, PROMPT_LENGTH, LABELS)
