"""Built-in synthetic tasks that a tiny random-init model can learn by RL alone.

Prompts are digits, `+` and a closing `=` only: the built-in tokenizer
(`mindspeed_rl.models.tokenizer`) knows just those characters, so every prompt character is a real
token. Answers are only digits, scored by the `digits` reward (per-position partial credit).
Digits are drawn i.i.d. uniform over 0-9 (leading zeros allowed); n = num_digits. A dataset holds
one kind, so the kind needs no marker in the prompt:

| kind      | prompt (n=3)      | answer        | rule                                               |
|-----------|-------------------|---------------|----------------------------------------------------|
| `copy`    | `123=`            | `123`         | the digits as given                                |
| `reverse` | `123=`            | `321`         | the digits in reverse order                        |
| `sort`    | `312=` / `+312=`  | `123` / `321` | ascending; descending when the prompt starts with `+` (drawn per prompt) |
| `add`     | `123+456=`        | `579`         | digit-wise sum mod 10, no carries: (a_i + b_i) % 10 |
| `sum`     | `123+456=`        | `579`         | the real sum, with carries (`999+999=` -> `1998`, `012+034=` -> `46`): the calc tool's task |
| `lookup`  | `123=`            | `lookup_value("123")`, 3 digits | the key's value in the lookup tool's table (a hash): the lookup tool's task |

Why these rules: each answer digit depends on a few prompt positions (learnable by an 84k-parameter
model), and a policy that ignores the prompt cannot do well: random digits score 0.10 on every
kind. Every answer position of `copy`, `reverse` and `add` is uniform over 0-9, so the best
constant answer also scores 0.10. Ascending-only sort would not be fair (the smallest of 3 digits
is 0 a quarter of the time; the constant "059" scores 0.23); mixing both directions brings the
best constant to 0.14 for n=3 (0.17 for n=5, 0.197 for n=8; longer sorts reach 0.2). Real addition
with carries is also unfair (the carry digit is 0 or 1) and harder to learn, hence the digit-wise
sum.

`sum` is the other way round on purpose: real addition of two numbers of `num_digits` digits (drawn
as the others, leading zeros allowed; the answer has none: `012+034=` -> `46`), which the tiny model cannot learn to do in its head in a few minutes but can with a
calculator: it calls the `calc` tool with the operands (`<calc>1234+5678</calc>`), reads the result
(`<result>6912</result>`) and copies it, or, with the tool answering for it (`return_direct`,
`configs/grpo_tiny_tool.yaml`, docs/agent.md), the result is its answer. Its reward
is `final_digits`: `digits` on the text after the last tool result (`calc_digits` adds credit for the call).

`lookup` cannot be solved from the prompt at all: the answer is the `lookup` tool's value for the key
(`agent/tools.py lookup_value`, 3 digits from a hash of the key), so without the tool a model scores the
random-digit 0.10; with it, it calls `<lookup>123</lookup>`, reads `<result>847</result>` and writes `847`
itself (configs/grpo_tiny_tool.yaml, reward `lookup_answer`).

`arith` is for a real pretrained chat model, not the tiny one: additions and subtractions asked in words
(`data/arith.py`), answers in GSM8K's form (`#### 12`), reward `gsm8k_flexible`
(configs/grpo_smollm2_arith.yaml, docs/quickstart.md).

## Train and held-out splits
Every task's prompts are split by a hash of the prompt text (`is_held_out`: CRC-32 mod 10 == 0, about
one prompt in ten), so the split is a property of the prompt, not of a seed or a dataset size: the
training split (`split="train"`, what `data.dataset` loads) never holds a held-out prompt, and the
held-out split (`split="val"`, what `data.val_dataset` loads for validation) holds only those. The two
are disjoint by construction for every seed, size and kind, and training draws the same prompts whether
validation is on or not.
"""
from __future__ import annotations

import zlib

import numpy as np

from .base import ANSWER, PROMPT, PromptDataset

KINDS = ("copy", "reverse", "sort", "add", "sum", "lookup", "arith")
ALPHABET = "0123456789+="  # every character a synthetic prompt may hold
REWARD = "digits"
REWARDS = {"sum": "final_digits", "lookup": "lookup_answer", "arith": "gsm8k_flexible"}  # kinds whose reward is not REWARD
SPLITS = ("train", "val")
HELD_OUT_MODULUS = 10      # one prompt in ten is held out
VAL_STREAM = 0x76616C      # the held-out split's draws: their own generator, seeded by (seed, VAL_STREAM)
MAX_DRAW_ROUNDS = 64       # draws of a split: rounds of sampling before a split too small for `size` gives up


def is_held_out(prompt: str) -> bool:
    """Is `prompt` in the held-out split of its task? A pure function of the text (see the module doc)."""
    return zlib.crc32(prompt.encode("utf-8")) % HELD_OUT_MODULUS == 0


class SyntheticTask:
    """One synthetic task: `sample(rng) -> (prompt, answer)`; `solve(prompt) -> answer`."""

    def __init__(self, kind: str = "copy", num_digits: int = 3):
        if kind not in KINDS:
            raise ValueError(f"unknown synthetic task kind {kind!r}; kinds are {list(KINDS)}")
        if isinstance(num_digits, bool) or not isinstance(num_digits, (int, np.integer)) \
                or num_digits < 1:
            raise ValueError(f"num_digits must be a positive integer, got {num_digits!r}")
        self.kind = kind
        self.num_digits = int(num_digits)

    def __repr__(self) -> str:
        return f"SyntheticTask(kind={self.kind!r}, num_digits={self.num_digits})"

    @property
    def reward(self) -> str:
        """The reward function that scores this task (`rl_config.reward_fn`)."""
        return REWARDS.get(self.kind, REWARD)

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        """One (prompt, answer) pair drawn from `rng`."""
        return self.sample_many(rng, 1)[0]

    def sample_many(self, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        """`count` (prompt, answer) pairs drawn from `rng` at once (vectorized)."""
        if self.kind == "arith":
            from . import arith
            return arith.sample_many(rng, count, self.num_digits)
        a = rng.integers(0, 10, size=(count, self.num_digits))
        if self.kind == "copy":
            return [(f"{_digits(x)}=", _digits(x)) for x in a]
        if self.kind == "lookup":
            from ..agent.tools import lookup_value
            return [(f"{_digits(x)}=", lookup_value(_digits(x))) for x in a]
        if self.kind == "reverse":
            return [(f"{_digits(x)}=", _digits(x[::-1])) for x in a]
        if self.kind == "sort":
            descending = rng.integers(0, 2, size=count).astype(bool)
            return [(f"{'+' if d else ''}{_digits(x)}=", _digits(sorted(x, reverse=bool(d))))
                    for x, d in zip(a, descending)]
        if self.kind == "sum":  # digits i.i.d. like every task here (leading zeros too): no constant does well
            b = rng.integers(0, 10, size=(count, self.num_digits))
            return [(f"{_digits(x)}+{_digits(y)}=", str(int(_digits(x)) + int(_digits(y)))) for x, y in zip(a, b)]
        b = rng.integers(0, 10, size=(count, self.num_digits))  # add
        return [(f"{_digits(x)}+{_digits(y)}=", _digits((x + y) % 10)) for x, y in zip(a, b)]

    def solve(self, prompt: str) -> str:
        """The answer to `prompt` computed from its text (ValueError when it is not this task's)."""
        if self.kind == "arith":
            from . import arith
            return arith.solve(prompt)
        n = self.num_digits
        body = prompt[:-1] if prompt.endswith("=") else ""
        if self.kind == "sort" and body.startswith("+"):
            body, descending = body[1:], True
        else:
            descending = False
        if self.kind in ("add", "sum"):
            left, plus, right = body.partition("+")
            if plus and len(left) == len(right) == n and _is_digits(left) and _is_digits(right):
                if self.kind == "sum":
                    return str(int(left) + int(right))
                return "".join(str((int(x) + int(y)) % 10) for x, y in zip(left, right))
        elif len(body) == n and _is_digits(body):
            if self.kind == "copy":
                return body
            if self.kind == "reverse":
                return body[::-1]
            if self.kind == "lookup":
                from ..agent.tools import lookup_value
                return lookup_value(body)
            return "".join(sorted(body, reverse=descending))
        raise ValueError(f"{prompt!r} is not a prompt of {self!r}")


def _digits(row) -> str:
    return "".join(str(int(d)) for d in row)


def _is_digits(text: str) -> bool:
    return bool(text) and all("0" <= ch <= "9" for ch in text)


class SyntheticPromptDataset(PromptDataset):
    """`size` records `{"prompt", "answer"}` of `task`'s `split`, a pure function of (task, size, seed, split).

    `train`: drawn i.i.d. from the task, held-out prompts dropped (`size` records, repeats allowed).
    `val`: distinct held-out prompts in a seeded order, `size` of them, or all the task has when it
    has fewer (copy with 3 digits holds out about 100 of its 1000 prompts); a task with none is refused.
    """

    def __init__(self, task: SyntheticTask | str = "copy", size: int = 10000, seed: int = 0,
                 num_digits: int = 3, split: str = "train"):
        if isinstance(task, str):
            task = SyntheticTask(task, num_digits)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        self.task = task
        self.seed = seed
        self.split = split
        pairs = _draw_train(task, int(size), seed) if split == "train" else _draw_held_out(task, int(size), seed)
        super().__init__([{PROMPT: p, ANSWER: a} for p, a in pairs],
                         source=f"builtin:{task.kind} (num_digits={task.num_digits}, "
                                f"size={size}, seed={seed}{', held-out split' if split == 'val' else ''})")


def _draw_train(task: SyntheticTask, size: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[str, str]] = []
    for _ in range(MAX_DRAW_ROUNDS):
        out += [(p, a) for p, a in task.sample_many(rng, size - len(out) if out else size) if not is_held_out(p)]
        if len(out) >= size:
            return out[:size]
    raise ValueError(f"{task!r}: almost every prompt is held out for validation; use more num_digits")


def _draw_held_out(task: SyntheticTask, size: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng([seed, VAL_STREAM])
    seen: dict[str, str] = {}
    idle = 0
    for _ in range(MAX_DRAW_ROUNDS):
        before = len(seen)
        for p, a in task.sample_many(rng, max(4096, 4 * size)):
            if is_held_out(p) and p not in seen:
                seen[p] = a
                if len(seen) == size:
                    return list(seen.items())
        idle = idle + 1 if seen and len(seen) == before else 0
        if idle == 3:  # 12k draws found nothing new: the task has no more held-out prompts
            break
    if not seen:
        raise ValueError(f"{task!r} has no held-out prompts (one prompt in {HELD_OUT_MODULUS} is held out, by "
                         "its hash); use more num_digits for a validation set")
    return list(seen.items())
