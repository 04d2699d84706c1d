"""pass@k of sampled responses: the chance that at least one of k responses to a prompt passes.

With n responses per prompt of which c pass, the unbiased estimator (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code", eq. 1) is

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over prompts. It is computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the
binomials (they overflow for large n). pass@1 is the plain fraction c / n; pass@n is 1 when any of the
n responses passes.

A response passes when its reward reaches `PASS_THRESHOLD`: 1.0, the full score of the built-in rule
rewards (`digits` gives partial credit per position and 1.0 only to the exact answer; `gsm8k` scores 1.0
for a correct answer). A reward whose full score is another number passes at that number with
`threshold=...`.
"""
from __future__ import annotations

from typing import Sequence

PASS_THRESHOLD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `n` responses, `c` of them passing."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every choice of k responses holds a passing one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(scores_by_prompt: Sequence[Sequence[float]], k: int,
                   threshold: float = PASS_THRESHOLD) -> float:
    """pass@k averaged over prompts; each prompt's scores are its n responses' rewards (n >= k)."""
    if not scores_by_prompt:
        raise ValueError("mean_pass_at_k: no prompts")
    total = 0.0
    for scores in scores_by_prompt:
        total += pass_at_k(len(scores), sum(1 for s in scores if s >= threshold), k)
    return total / len(scores_by_prompt)
