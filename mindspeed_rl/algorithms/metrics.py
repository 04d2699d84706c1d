"""How a metric is combined across micro-batches and ranks, decided by its name: the one rule.

A metric whose name ends in ``_max`` is the largest value seen, ``_min`` the smallest; every other
metric is a sum (``reward_sum``, ``rows``, ``pg_loss`` summed over micro-batches), which the trainer
turns into a mean by dividing by a count it sums beside it (``micro_batches``, ``rows``, ``*_tokens``).
So a loss function, a compute function or an engine names what it reports and never says how to
combine it. Engines (over micro-batches), workers (over micro-batches and updates) and the trainer
(over ranks and stages) all combine with `merge_metrics`, and the trainer ends a sum with
`metric_mean`. Pure Python; it lives here, with the math that emits such names
(``off_policy/is_weight_max``), below every layer that combines them.
"""
from __future__ import annotations

from typing import Mapping, MutableMapping

# name suffix -> how two values of such a metric combine; anything else is summed
EXTREMES = {"_max": max, "_min": min}


def _extreme(name: str):
    """max or min for an extreme's name, None for a sum."""
    return next((fn for suffix, fn in EXTREMES.items() if name.endswith(suffix)), None)


def reduction(name: str) -> str:
    """"max", "min" or "sum": how values of the metric `name` combine."""
    fn = _extreme(name)
    return fn.__name__ if fn else "sum"


def is_extreme(name: str) -> bool:
    """Is `name` a max or a min (final as it is) rather than a sum (divided by a count for a mean)?"""
    return reduction(name) != "sum"


def merge_metrics(into: MutableMapping[str, float], more: Mapping[str, float]) -> MutableMapping[str, float]:
    """Fold `more` into `into` by the naming rule (floats); returns `into`. A key missing from `into`
    starts from `more`'s value."""
    for k, v in more.items():
        v = float(v)
        if k in into:
            combine = _extreme(k)
            into[k] = combine(into[k], v) if combine else into[k] + v
        else:
            into[k] = v
    return into


def metric_mean(name: str, value: float, count: float) -> float:
    """A combined metric per `count` (e.g. micro-batches): a sum's mean; an extreme as it is."""
    return value if is_extreme(name) else value / count
