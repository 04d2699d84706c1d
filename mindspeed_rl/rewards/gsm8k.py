"""GSM8K-style answer checking: pull the final answer out of a response and compare numbers.

The response's final answer is, in order of preference:
  1. the text after the last `####` (GSM8K's own format, e.g. `#### 42`),
  2. the content of the last `\\boxed{...}` (the usual math-model format),
  3. only when `strict=False` (reward name `gsm8k_flexible`): the last number anywhere in the text.
The reference answer may be a whole GSM8K solution ending in `#### 42`, or just `42`.

Numbers are compared as numbers after stripping `,`, `$`, `%` and a trailing `.`: `42`, `42.0`,
`42.00` and `$42.` are equal, `1,000` equals `1000`, `3/4` and `\\frac{3}{4}` equal `0.75`, within a
relative tolerance of 1e-6. An answer that is not a number is compared as normalized text.
"""
from __future__ import annotations

import math
import re

# An integer or decimal with optional thousands commas (or a bare `.5`), optionally `/` a second one.
_NUM = r"(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
NUMBER_RE = re.compile(rf"[-+]?{_NUM}(?:\s*/\s*{_NUM})?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
REL_TOL = 1e-6


def _strip_latex(text: str) -> str:
    text = _FRAC_RE.sub(r"\1/\2", text)
    text = _TEXT_RE.sub(r"\1", text)
    for token in ("\\$", "\\%", "\\!", "\\,", "\\;", "\\left", "\\right"):
        text = text.replace(token, "")
    return text


def parse_number(text: str) -> float | None:
    """`text` as a number (`"1,000"` -> 1000.0, `"$3/4."` -> 0.75), or None when it is not one."""
    s = _strip_latex(str(text)).strip().replace(",", "").replace("$", "").replace("%", "")
    s = s.replace(" ", "").rstrip(".")
    if not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            den_value = float(den)
            return float(num) / den_value if den_value != 0 else None
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)
    return None


def _first_number_or_text(fragment: str) -> str | None:
    """The first number in `fragment`, else its first non-empty line (a non-numeric answer)."""
    cleaned = _strip_latex(fragment)
    m = NUMBER_RE.search(cleaned)
    if m:
        return m.group(0)
    for line in cleaned.splitlines():
        if line.strip():
            return line.strip()
    return None


def extract_answer(response: str, strict: bool = True) -> str | None:
    """The final answer written in `response` (see the module docstring), or None if it has none."""
    if "####" in response:
        found = _first_number_or_text(response[response.rfind("####") + 4:])
        if found is not None:
            return found
    boxed = last_boxed(response)
    if boxed is not None:
        cleaned = _strip_latex(boxed).strip()
        if parse_number(cleaned) is not None:
            return cleaned
        numbers = NUMBER_RE.findall(cleaned)
        return numbers[-1] if numbers else (cleaned or None)
    if not strict:
        numbers = NUMBER_RE.findall(_strip_latex(response))
        if numbers:
            return numbers[-1]
    return None


def reference_answer(answer: str) -> str:
    """The final answer of a reference: the text after the last `####`, else the whole string."""
    answer = str(answer)
    if "####" in answer:
        return _first_number_or_text(answer[answer.rfind("####") + 4:]) or ""
    return answer.strip()


def _normalize_text(text: str) -> str:
    return " ".join(text.replace("$", "").strip().rstrip(".").lower().split())


def answers_equal(predicted: str, reference: str) -> bool:
    """Numeric equivalence within REL_TOL when both are numbers, else normalized-text equality."""
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)
    if a is None and b is None:
        return _normalize_text(predicted) == _normalize_text(reference)
    return False


def gsm8k_reward(response: str, answer: str, prompt: str = "", strict: bool = True) -> float:
    """1.0 when the response's final answer equals the reference's, else 0.0 (also when none)."""
    predicted = extract_answer(str(response), strict=strict)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equal(predicted, reference_answer(answer)) else 0.0


def gsm8k(response: str, answer: str, prompt: str = "") -> float:
    """Reward `gsm8k`: strict extraction (`#### x` or `\\boxed{x}` only)."""
    return gsm8k_reward(response, answer, prompt, strict=True)


def gsm8k_flexible(response: str, answer: str, prompt: str = "") -> float:
    """Reward `gsm8k_flexible`: as `gsm8k`, falling back to the last number in the response."""
    return gsm8k_reward(response, answer, prompt, strict=False)
