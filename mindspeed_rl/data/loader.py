"""The prompt loader the trainer uses: a deterministic, resumable stream of tokenized batches.

Each epoch visits every record once, in an order drawn from a generator seeded by (seed, epoch),
so the stream is a pure function of (seed, position) and `state_dict()` (epoch, offset) is all a
resumed run needs. Batches cross epoch boundaries without a gap or a short batch.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from ..dataflow.dataset import LABELS, PROMPT_LENGTH, PROMPTS
from .base import ANSWER, PROMPT, PROMPT_IDS, PromptDataset


def encode_label(answer: str) -> np.ndarray:
    """The answer string as a uint8 array of its UTF-8 bytes (how it travels through the dock)."""
    return np.frombuffer(str(answer).encode("utf-8"), dtype=np.uint8).copy()


def decode_label(label) -> str:
    """Inverse of `encode_label`: a uint8 array (or tensor, or list) back to the answer string."""
    if hasattr(label, "detach"):  # a torch tensor
        label = label.detach().cpu().numpy()
    return np.asarray(label, dtype=np.uint8).tobytes().decode("utf-8")


def prompt_text(prompt: str | list[dict]) -> str:
    """A prompt as plain text: itself, or a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1]["content"])


def encode_prompts(tokenizer, prompts: Sequence[str | list[dict]], apply_chat_template: bool = False,
                   max_prompt_length: int | None = None) -> tuple[list[np.ndarray], int]:
    """Token ids (int64, no padding) of each prompt, and how many were truncated.

    Plain prompts are tokenized without special tokens; with `apply_chat_template` each prompt
    (a string becomes one user message) is rendered by `tokenizer.apply_chat_template` with the
    generation prompt, then tokenized without adding special tokens again. A prompt longer than
    `max_prompt_length` keeps its last `max_prompt_length` tokens.
    """
    texts = []
    for i, prompt in enumerate(prompts):
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True))
        elif isinstance(prompt, str):
            texts.append(prompt)
        else:
            raise ValueError(f"prompt {i} is a list of chat messages; turn on apply_chat_template "
                             f"to render it, or give plain-text prompts")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return truncate_left([np.asarray(x, dtype=np.int64) for x in ids], max_prompt_length)


def truncate_left(ids: list[np.ndarray], max_prompt_length: int | None) -> tuple[list[np.ndarray], int]:
    """Keep the last `max_prompt_length` tokens of each prompt; return them and the count cut."""
    if max_prompt_length is None:
        return ids, 0
    cut = sum(len(x) > max_prompt_length for x in ids)
    return [x[-max_prompt_length:] if len(x) > max_prompt_length else x for x in ids], cut


def truncation_warning(cut: int, total: int, longest: int, limit: int, source: str,
                       setting: str = "data.max_prompt_length") -> str | None:
    """The start-up line about prompts longer than the limit, or None when no prompt is."""
    if not cut:
        return None
    return (f"warning: {cut} of {total} prompts of {source} are longer than {setting}={limit} tokens "
            f"(the longest has {longest}); they lose their first tokens. Raise {setting} to keep them "
            f"whole (the count per step is the metric data/prompts_truncated)")


def check_tokenizer_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"apply_chat_template is on but the tokenizer "
                         f"({type(tokenizer).__name__}) has no chat template; turn it off or use a "
                         f"tokenizer whose checkpoint has one (tokenizer_config.json "
                         f"'chat_template' or chat_template.jinja)")


class PromptLoader:
    """Batches of `prompts_per_step` prompts, epoch after epoch, reshuffled per (seed, epoch).

    `next_batch()` returns a dict of per-prompt lists:
      prompts:       np.ndarray int64, the prompt's token ids (no padding)
      prompt_length: np.ndarray int64 of shape (1,)
      labels:        np.ndarray uint8, the answer's UTF-8 bytes (`decode_label` reads it back)
      prompt_text:   str (a chat prompt's last user message)
      answer_text:   str
    """

    def __init__(self, dataset: PromptDataset | Sequence[dict[str, Any]], tokenizer,
                 prompts_per_step: int, seed: int, shuffle: bool = True,
                 max_prompt_length: int | None = None, apply_chat_template: bool = False):
        if len(dataset) == 0:
            raise ValueError(f"prompt dataset {getattr(dataset, 'source', '')!r} is empty")
        if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, (int, np.integer)) \
                or prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be a positive integer, got {prompts_per_step!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if max_prompt_length is not None and (not isinstance(max_prompt_length, (int, np.integer))
                                              or max_prompt_length < 1):
            raise ValueError(f"max_prompt_length must be a positive integer or None, "
                             f"got {max_prompt_length!r}")
        if apply_chat_template:
            check_tokenizer_chat_template(tokenizer)
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.prompts_per_step = int(prompts_per_step)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.max_prompt_length = None if max_prompt_length is None else int(max_prompt_length)
        self.apply_chat_template = bool(apply_chat_template)
        self.epoch = 0
        self.offset = 0
        self.truncated = 0  # prompts cut to max_prompt_length so far
        self.last_truncated = 0  # prompts of the last batch cut (the trainer's data/prompts_truncated)
        self._order_epoch = -1
        self._order = np.arange(0)
        self._vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None

    def __len__(self) -> int:
        """Batches per epoch (rounded up; a batch may span two epochs)."""
        return -(-len(self.dataset) // self.prompts_per_step)

    def __iter__(self) -> Iterator[dict[str, list]]:
        while True:
            yield self.next_batch()

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def _take_indices(self, count: int) -> list[int]:
        indices = []
        for _ in range(count):
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
            indices.append(int(self._order[self.offset]))
            self.offset += 1
            if self.offset == len(self.dataset):
                self.epoch, self.offset = self.epoch + 1, 0
        return indices

    def next_batch(self, count: int | None = None) -> dict[str, list]:
        """The next `count` prompts of the stream (prompts_per_step by default; dynamic sampling draws fewer)."""
        records = [self.dataset[i] for i in self._take_indices(self.prompts_per_step if count is None else count)]
        ids: list[np.ndarray | None] = [None] * len(records)
        to_encode = [i for i, r in enumerate(records) if PROMPT_IDS not in r]
        if to_encode:
            encoded, _ = encode_prompts(self.tokenizer, [records[i][PROMPT] for i in to_encode],
                                        self.apply_chat_template)
            for i, x in zip(to_encode, encoded):
                ids[i] = x
        for i, r in enumerate(records):
            if ids[i] is None:
                ids[i] = np.asarray(r[PROMPT_IDS], dtype=np.int64)
                if self._vocab_size is not None and ids[i].size and ids[i].max() >= self._vocab_size:
                    raise ValueError(f"preprocessed prompt_ids hold id {int(ids[i].max())}, beyond the "
                                     f"tokenizer's {self._vocab_size} tokens: the dataset was "
                                     f"preprocessed with another tokenizer; run "
                                     f"cli/preprocess_data.py again with this one")
            if ids[i].size == 0:
                raise ValueError(f"a prompt of {getattr(self.dataset, 'source', 'the dataset')} "
                                 f"tokenizes to nothing: {r[PROMPT]!r}")
        ids, cut = truncate_left(ids, self.max_prompt_length)
        self.truncated += cut
        self.last_truncated = cut
        return {  # the dock columns of dataflow.DATASET_KEYS, then the texts for the run's log
            PROMPTS: ids,
            PROMPT_LENGTH: [np.array([len(x)], dtype=np.int64) for x in ids],
            LABELS: [encode_label(r[ANSWER]) for r in records],
            "prompt_text": [prompt_text(r[PROMPT]) for r in records],
            "answer_text": [r[ANSWER] for r in records],
        }

    def prompt_lengths(self, chunk: int = 1024) -> Iterator[int]:
        """Each record's prompt length in tokens before truncation, in dataset order, encoded as
        `next_batch` encodes it (tokenized `chunk` prompts at a time, so memory stays flat)."""
        n = len(self.dataset)
        for start in range(0, n, chunk):
            part = [self.dataset[i] for i in range(start, min(start + chunk, n))]
            texts = [r[PROMPT] for r in part if PROMPT_IDS not in r]
            encoded = iter(encode_prompts(self.tokenizer, texts, self.apply_chat_template)[0] if texts else [])
            for r in part:
                yield len(r[PROMPT_IDS]) if PROMPT_IDS in r else len(next(encoded))

    def truncation_warning(self, setting: str = "data.max_prompt_length") -> str | None:
        """One line saying how many of the dataset's prompts `max_prompt_length` cuts (None: none).

        Why up front: a cut prompt loses its start (often the question itself) without any error,
        so the user hears it once at start, with the count, the limit and the longest prompt; the
        per-step count is `last_truncated`. Tokenizes the whole dataset once.
        """
        if self.max_prompt_length is None:
            return None
        cut, longest, total = 0, 0, 0
        for length in self.prompt_lengths():
            total += 1
            cut += length > self.max_prompt_length
            longest = max(longest, length)
        return truncation_warning(cut, total, longest, self.max_prompt_length,
                                  getattr(self.dataset, "source", "the dataset"), setting)

    def state_dict(self) -> dict[str, Any]:
        """The data position (and what it depends on), for checkpoints."""
        return {"epoch": self.epoch, "offset": self.offset, "truncated": self.truncated,
                "seed": self.seed, "shuffle": self.shuffle, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; the seed, shuffle and dataset size must be the same."""
        for key, mine in (("dataset_size", len(self.dataset)), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the prompt loader: the checkpoint has {key}="
                                 f"{state[key]!r} but this run has {key}={mine!r}; the data order "
                                 f"would differ")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < len(self.dataset):
            raise ValueError(f"cannot resume the prompt loader: position epoch={epoch}, "
                             f"offset={offset} is outside a dataset of {len(self.dataset)} records")
        self.epoch, self.offset = epoch, offset
        self.truncated = int(state.get("truncated", 0))
