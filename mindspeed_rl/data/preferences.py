"""Preference data for reward modeling: pairs of a prompt, a `chosen` and a `rejected` response.

Sources (`data.dataset` when `rl_config.algorithm: reward_modeling`):

* a JSONL file (or one JSON array) of objects with the prompt, chosen and rejected fields, as
  OpenRLHF's reward datasets have them (`data.prompt_key`, `data.chosen_key`, `data.rejected_key`;
  dotted keys reach nested fields); a bad row is refused with the file, the line and the key;
* `builtin:copy_pairs`: the tiny copy task's prompts (`123=`), each with its right copy (`123`)
  against a corrupted one (wrong digits, truncated, extra characters, or noise), so a reward model
  can be trained on the CPU from nothing. A response ends with the built-in tokenizer's `<eos>` half
  of the time, as the policy's responses do when they stop before `max_new_tokens`.

`split_held_out` sets aside the evaluation records (accuracy and margin each eval) by whole prompts, a
pure function of (records, count, seed); `PreferenceLoader` is the prompt loader's resumable stream, tokenizing
pairs into the dock columns of `PREFERENCE_KEYS`.
"""
from __future__ import annotations

import json

from pathlib import Path
from typing import Any, Sequence

import numpy as np

# the dock columns of a preference batch: token ids of the prompt and of each response, no padding
from ..dataflow.reward_modeling import DATASET_KEYS as PREFERENCE_KEYS
from .base import PROMPT, PromptDataset, Record
from .loader import PromptLoader, encode_prompts, prompt_text, truncate_left
from .prompts import BUILTIN_PREFIX, MISSING, BadRow, json_rows, lookup_field
from .synthetic import is_held_out

CHOSEN, REJECTED = "chosen", "rejected"
PAIR_FIELDS = (PROMPT, CHOSEN, REJECTED)
BUILTIN_PAIRS = {"copy_pairs": "copy"}
CORRUPTIONS = ("digits", "shuffled", "repeated", "truncated", "extra", "noise")
EOS_TEXT = "<eos>"  # the built-in tokenizer's end-of-sequence token, as text
NOISE_ALPHABET = "0123456789+="
# what a random policy samples: any token of the built-in vocabulary but the end of sequence
NOISE_TOKENS = list(NOISE_ALPHABET) + ["<pad>", "<bos>", "<unk>"]


class PreferenceDataset(PromptDataset):
    """An indexable list of `{"prompt", "chosen", "rejected"}` records."""

    def __init__(self, records: Sequence[Record], source: str = "<pairs>"):
        super().__init__(records, source)
        self.preprocessed = False


# ------------------------------------------------------------------ the built-in pairs
def corrupt(right: str, kind: str, rng: np.random.Generator) -> str:
    """A wrong answer made from the `right` digits: `kind` of `CORRUPTIONS`. Never equals `right`."""
    n = len(right)
    for _ in range(100):
        out = _corrupt(right, kind, rng)
        if out != right:
            return out
    return right[:-1]  # e.g. "repeated" of "777": only shorter is wrong


def _corrupt(right: str, kind: str, rng: np.random.Generator) -> str:
    n = len(right)
    if kind == "digits":  # k of the n positions get another digit, k = 1 most often (the hardest to tell)
        out = list(right)
        k = min(n, int(rng.geometric(0.5)))
        for i in rng.choice(n, size=k, replace=False):
            out[i] = str((int(out[i]) + int(rng.integers(1, 10))) % 10)
        return "".join(out)
    if kind == "shuffled":  # the right digits in another order
        return "".join(rng.permutation(list(right)))
    if kind == "repeated":  # one digit n times
        return str(int(rng.integers(0, 10))) * n
    if kind == "truncated":
        return right[:int(rng.integers(0, n))]
    if kind == "extra":
        return right + "".join(rng.choice(list(NOISE_ALPHABET), size=int(rng.integers(1, 3))))
    if kind == "noise":
        return "".join(rng.choice(NOISE_TOKENS, size=n))
    raise ValueError(f"unknown corruption {kind!r}; kinds: {list(CORRUPTIONS)}")


def closeness(response: str, right: str) -> float:
    """How close a copy `response` is: the positions that hold the right digit, over the longer length."""
    longer = max(len(response), len(right))
    return sum(a == b for a, b in zip(response, right)) / longer if longer else 1.0


def graded_pair(right: str, rng: np.random.Generator) -> tuple[str, str]:
    """Two wrong answers (corruptions of `right` of random kinds), the closer copy first (`closeness`)."""
    while True:
        a, b = (corrupt(right, CORRUPTIONS[int(rng.integers(0, len(CORRUPTIONS)))], rng) for _ in range(2))
        ca, cb = closeness(a, right), closeness(b, right)
        if ca != cb:
            return (a, b) if ca > cb else (b, a)


def training_copy(rng: np.random.Generator, num_digits: int) -> str:
    """Digits whose prompt (`123=`) is in the copy task's training split: the pairs never hold a prompt the
    policy is validated on (`data.val_dataset: builtin:copy`), so a reward model scores those as new."""
    while True:
        right = "".join(str(int(d)) for d in rng.integers(0, 10, size=num_digits))
        if not is_held_out(f"{right}="):
            return right


def copy_pairs(num_digits: int = 3, size: int = 10000, seed: int = 0, graded: float = 0.5) -> PreferenceDataset:
    """`size` pairs of the copy task; a pure function of (num_digits, size, seed, graded).

    A fraction `graded` are graded pairs (`graded_pair`: of two corrupted answers the closer copy), the
    others the right copy against a corrupted one, each kind of `CORRUPTIONS` as often. Right against
    wrong alone makes a reward model that tells a right copy from everything else but ranks the wrong
    answers anyhow: a policy that starts far from right then gets no signal towards it (measured: the
    policy's rule reward stayed at 0.06 over 300 GRPO steps; with graded pairs of k against more wrong
    digits only, it learnt to answer `<eos>` alone, which no pair ranked); the graded pairs give the
    partial credit of a copy that is closer. Every prompt is of the copy task's training split."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    if isinstance(num_digits, bool) or not isinstance(num_digits, (int, np.integer)) or num_digits < 1:
        raise ValueError(f"num_digits must be a positive integer, got {num_digits!r}")
    rng = np.random.default_rng([int(seed), 27])
    records = []
    for _ in range(int(size)):
        right = training_copy(rng, int(num_digits))
        if num_digits > 1 and rng.random() < graded:
            better, wrong = graded_pair(right, rng)
        else:
            better, wrong = right, corrupt(right, CORRUPTIONS[int(rng.integers(0, len(CORRUPTIONS)))], rng)
        # <eos> ends a response half of the time (always an empty one: it has no other token)
        chosen = better + (EOS_TEXT if rng.random() < 0.5 else "")
        rejected = wrong + (EOS_TEXT if not wrong or rng.random() < 0.5 else "")
        records.append({PROMPT: f"{right}=", CHOSEN: chosen, REJECTED: rejected})
    return PreferenceDataset(records, source=f"builtin:copy_pairs (num_digits={num_digits}, size={size}, seed={seed})")


# ------------------------------------------------------------------ files
def make_pair(raw: Any, where: str, prompt_key: str = PROMPT, chosen_key: str = CHOSEN,
              rejected_key: str = REJECTED) -> Record:
    """One source row as a pair record; errors start with `where` (the file and line) and name the key
    (`data.<role>`), with what was found."""
    if isinstance(raw, BadRow):
        raise ValueError(f"{where}: {raw.problem}")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with {prompt_key!r}, {chosen_key!r} and {rejected_key!r}, "
                         f"got {type(raw).__name__}")
    out: Record = {}
    for role, key, field in (("prompt_key", prompt_key, PROMPT), ("chosen_key", chosen_key, CHOSEN),
                             ("rejected_key", rejected_key, REJECTED)):
        value = lookup_field(raw, key)
        if value is MISSING:
            raise ValueError(f"{where}: missing key {key!r} (data.{role}); the row has keys {sorted(raw)}")
        if field == PROMPT and isinstance(value, list) and value and all(
                isinstance(m, dict) and "content" in m for m in value):
            out[field] = value  # chat messages
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: key {key!r} (data.{role}) must be a non-empty string, got "
                             f"{type(value).__name__} {value!r:.60}")
        out[field] = value
    return out


def load_preference_file(path: str | Path, prompt_key: str = PROMPT, chosen_key: str = CHOSEN,
                         rejected_key: str = REJECTED) -> PreferenceDataset:
    path = Path(path).expanduser()
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise ValueError(f"preference dataset {str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; "
                         f"give a .jsonl or .json file (objects with {prompt_key!r}, {chosen_key!r}, {rejected_key!r}) "
                         f"or one of {[BUILTIN_PREFIX + k for k in BUILTIN_PAIRS]}")
    if not path.is_file():
        raise ValueError(f"preference dataset {str(path)!r}: no such file")
    records = [make_pair(raw, where, prompt_key, chosen_key, rejected_key) for where, raw in json_rows(path)]
    if not records:
        raise ValueError(f"preference dataset {str(path)!r} holds no records")
    return PreferenceDataset(records, source=str(path))


def load_preference_dataset(spec: str | Path, prompt_key: str = PROMPT, chosen_key: str = CHOSEN,
                            rejected_key: str = REJECTED, num_digits: int = 3, size: int = 10000,
                            seed: int = 0) -> PreferenceDataset:
    """`builtin:copy_pairs` (num_digits, size and seed apply) or a JSONL/JSON file of pairs."""
    spec_str = str(spec)
    if spec_str.startswith(BUILTIN_PREFIX):
        name = spec_str[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_PAIRS:
            raise ValueError(f"data.dataset={spec_str!r}: not a built-in preference dataset; reward modeling reads "
                             f"{[BUILTIN_PREFIX + k for k in BUILTIN_PAIRS]} or a .jsonl file of "
                             f"{{{prompt_key!r}, {chosen_key!r}, {rejected_key!r}}} objects")
        return copy_pairs(num_digits, size, seed)
    return load_preference_file(spec_str, prompt_key, chosen_key, rejected_key)


def split_held_out(dataset: PromptDataset, count: int, seed: int = 0) -> tuple[PreferenceDataset, PreferenceDataset]:
    """(training records, held-out records): whole prompts, drawn in a seeded order, are held out with every
    pair of theirs until at least `count` pairs are, both parts in dataset order. Held out by prompt, not by
    pair: a reward model evaluated on pairs of prompts it trained on (other pairs of the same prompt) is
    scored on what it has half seen, and its held-out accuracy overstates what it does on new prompts.
    `count` 0 holds nothing out; at least one prompt must remain to train on."""
    n = len(dataset)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"data.eval_size={count!r}: must be an integer >= 0 (records held out for evaluation)")
    groups: dict[str, list[int]] = {}
    for i in range(n):
        groups.setdefault(json.dumps(dataset[i][PROMPT], sort_keys=True), []).append(i)
    prompts = list(groups)
    held: set[int] = set()
    if count:
        for k in np.random.default_rng([int(seed), 1]).permutation(len(prompts)).tolist():
            if len(held) >= count:
                break
            held.update(groups[prompts[k]])
    if count and len(held) >= n:
        raise ValueError(f"data.eval_size={count} leaves nothing to train on: {dataset.source} has {n} records over "
                         f"{len(prompts)} prompts, and whole prompts are held out; hold out fewer")
    train = [dataset[i] for i in range(n) if i not in held]
    evals = [dataset[i] for i in sorted(held)]
    return (PreferenceDataset(train, f"{dataset.source} (training part)"),
            PreferenceDataset(evals, f"{dataset.source} (held out: {len(evals)} pairs of "
                                     f"{len(prompts) - len({json.dumps(r[PROMPT], sort_keys=True) for r in train})} "
                                     "prompts)"))


# ------------------------------------------------------------------ tokenized batches
def encode_responses(tokenizer, responses: Sequence[str], where: str = "") -> list[np.ndarray]:
    """Token ids of each response, no special tokens added (an `<eos>` written in the text stays one)."""
    ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"] if responses else []
    out = [np.asarray(x, dtype=np.int64) for x in ids]
    for text, x in zip(responses, out):
        if x.size == 0:
            raise ValueError(f"a response{where} tokenizes to nothing: {text!r}")
    return out


def encode_pairs(tokenizer, records: Sequence[Record], apply_chat_template: bool = False,
                 max_prompt_length: int | None = None) -> tuple[dict[str, list[np.ndarray]], int]:
    """The dock columns `PREFERENCE_KEYS` of `records` (and how many prompts were cut)."""
    prompts, _ = encode_prompts(tokenizer, [r[PROMPT] for r in records], apply_chat_template)
    for r, x in zip(records, prompts):
        if x.size == 0:
            raise ValueError(f"a prompt tokenizes to nothing: {r[PROMPT]!r}")
    prompts, cut = truncate_left(prompts, max_prompt_length)
    p_key, c_key, r_key = PREFERENCE_KEYS
    return {p_key: prompts,
            c_key: encode_responses(tokenizer, [r[CHOSEN] for r in records], " (chosen)"),
            r_key: encode_responses(tokenizer, [r[REJECTED] for r in records], " (rejected)")}, cut


class PreferenceLoader(PromptLoader):
    """The prompt loader's deterministic, resumable stream (`state_dict`), of pairs: `next_batch()`
    gives `prompts_per_step` pairs as the columns of `PREFERENCE_KEYS` plus `prompt_text`."""

    def next_batch(self) -> dict[str, list]:
        records = [self.dataset[i] for i in self._take_indices(self.prompts_per_step)]
        columns, cut = encode_pairs(self.tokenizer, records, self.apply_chat_template, self.max_prompt_length)
        self.truncated += cut
        self.last_truncated = cut
        return {**columns, "prompt_text": [prompt_text(r[PROMPT]) for r in records]}

    def prompt_lengths(self, chunk: int = 1024):
        n = len(self.dataset)
        for start in range(0, n, chunk):
            part = [self.dataset[i] for i in range(start, min(start + chunk, n))]
            yield from (len(x) for x in encode_prompts(self.tokenizer, [r[PROMPT] for r in part],
                                                       self.apply_chat_template)[0])


def batches(records: Sequence[Record], size: int):
    """`records` in consecutive slices of `size` (the last may be shorter): an evaluation pass."""
    for start in range(0, len(records), size):
        yield list(records[start:start + size])
