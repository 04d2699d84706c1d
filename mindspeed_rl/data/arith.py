"""`builtin:arith`: additions and subtractions asked in words, for a real pretrained chat model.

A real model reads text, not the tiny model's digit strings: each question is one of several phrasings of
`a + b` or `a - b` (subtractions never go below zero), rendered with the tokenizer's chat template when
`data.chat_template` is on, and answered in GSM8K's form (`#### 12`) so the `gsm8k` rewards score it
(`gsm8k_flexible` takes a reply's last number: a chat model answers "3 + 4 = 7").

Operands have 1 to `num_digits` digits, the digit count drawn first (so with `num_digits: 2` a quarter of
the questions are single-digit sums, an easy part a small instruct model often gets right, and the rest a
hard part it mostly gets wrong), then the value uniform among numbers of that many digits (0-9 for one digit).

Phrasings the task never uses (`UNSEEN_TEMPLATES`) exist to check that what a trained model learned carries
over to other wordings (benchmarks/arith_transfer.py); they are not in either split.
"""
from __future__ import annotations

import re

import numpy as np

# (template, operator): {a} and {b} are the operands; the question's answer is a op b
TEMPLATES = (
    ("What is {a} + {b}? Answer with just the number.", "+"),
    ("What is {a} - {b}? Answer with just the number.", "-"),
    ("Compute {a} + {b}.", "+"),
    ("Compute {a} - {b}.", "-"),
    ("Add {a} and {b}.", "+"),
    ("Subtract {b} from {a}.", "-"),
    ("{a} plus {b} equals what?", "+"),
    ("{a} minus {b} equals what?", "-"),
    ("Calculate: {a} + {b} = ?", "+"),
    ("Calculate: {a} - {b} = ?", "-"),
    ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?", "+"),
    ("Sam has {a} apples and gives away {b}. How many apples does Sam have left?", "-"),
)
UNSEEN_TEMPLATES = (
    ("Find the sum of {a} and {b}.", "+"),
    ("Find the difference between {a} and {b}.", "-"),
    ("A box holds {a} pens. Someone puts in {b} more pens. How many pens are in the box?", "+"),
    ("There are {a} birds on a wire and {b} fly away. How many birds are still on the wire?", "-"),
    ("Please tell me what {a} added to {b} makes.", "+"),
    ("Take {b} away from {a}. What number remains?", "-"),
)


def answer_text(value: int) -> str:
    """A reference answer in GSM8K's form."""
    return f"#### {value}"


def _operands(rng: np.random.Generator, count: int, max_digits: int) -> np.ndarray:
    digits = rng.integers(1, max_digits + 1, size=(count, 2))
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    return low + (rng.random((count, 2)) * (10 ** digits - low)).astype(np.int64)


def sample_many(rng: np.random.Generator, count: int, max_digits: int,
                templates: tuple = TEMPLATES) -> list[tuple[str, str]]:
    """`count` (question, `#### answer`) pairs; the operands of a subtraction are ordered so it is >= 0."""
    ab = _operands(rng, count, max_digits)
    which = rng.integers(0, len(templates), size=count)
    out = []
    for (a, b), t in zip(ab.tolist(), which.tolist()):
        text, op = templates[t]
        if op == "-" and b > a:
            a, b = b, a
        out.append((text.format(a=a, b=b), answer_text(a + b if op == "+" else a - b)))
    return out


def solve(question: str, templates: tuple = TEMPLATES + UNSEEN_TEMPLATES) -> str:
    """The reference answer of a question of one of `templates` (ValueError otherwise)."""
    for text, op in templates:
        pattern = "^" + re.escape(text).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)") + "$"
        m = re.match(pattern, question)
        if m:
            a, b = int(m.group("a")), int(m.group("b"))
            return answer_text(a + b if op == "+" else a - b)
    raise ValueError(f"{question!r} is not an arith question")
