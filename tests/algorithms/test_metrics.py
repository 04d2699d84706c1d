"""The metric naming rule (algorithms/metrics.py): `_max` maxed, `_min` minned, the rest summed."""
import math

import pytest

from mindspeed_rl.algorithms.metrics import is_extreme, merge_metrics, metric_mean, reduction


@pytest.mark.parametrize("name, how", [("response_length_max", "max"), ("off_policy/is_weight_max", "max"),
                                       ("weight_version_min", "min"), ("reward_sum", "sum"), ("pg_loss", "sum"),
                                       ("micro_batches", "sum"), ("max_tokens", "sum"), ("reward/max_fraction", "sum"),
                                       ("x_maximum", "sum")])
def test_the_suffix_decides(name, how):
    assert reduction(name) == how
    assert is_extreme(name) == (how != "sum")


def test_merge_over_micro_batches_and_ranks():
    micro_batches = [{"pg_loss": 0.5, "is_weight_max": 1.5, "weight_version_min": 3, "rows": 2},
                     {"pg_loss": 0.25, "is_weight_max": 1.25, "weight_version_min": 2, "rows": 2},
                     {"pg_loss": 0.25, "is_weight_max": 2.0, "weight_version_min": 4, "rows": 1, "new_sum": 7}]
    out: dict = {}
    for m in micro_batches:
        assert merge_metrics(out, m) is out
    assert out == {"pg_loss": 1.0, "is_weight_max": 2.0, "weight_version_min": 2.0, "rows": 5.0, "new_sum": 7.0}
    assert all(type(v) is float for v in out.values())
    # the same rule across ranks: folding the ranks' merged dicts equals merging every micro-batch at once
    rank0, rank1 = merge_metrics({}, micro_batches[0]), merge_metrics({}, micro_batches[1])
    merge_metrics(rank0, rank1)
    assert merge_metrics(rank0, micro_batches[2]) == out
    # a first value is kept as it is, whatever its sign (no 0 start for a max, no -inf for a negative min)
    assert merge_metrics({}, {"a_max": -3, "b_min": 5, "c": -1}) == {"a_max": -3.0, "b_min": 5.0, "c": -1.0}


def test_metric_mean_divides_sums_only():
    assert metric_mean("pg_loss", 1.0, 4) == 0.25
    assert metric_mean("is_weight_max", 2.0, 4) == 2.0 and metric_mean("weight_version_min", 3.0, 4) == 3.0
    assert math.isclose(metric_mean("entropy", 3.0, 2.0), 1.5)


def test_the_workers_rule_is_this_rule():
    """workers/stage.py's add_metrics (through which the trainer also combines ranks) follows the same
    rule, so a report combined there equals one combined here."""
    from mindspeed_rl.workers.stage import add_metrics
    more = {"pg_loss": 0.5, "is_weight_max": 1.5, "weight_version_min": 3.0}
    for first in ({}, {"pg_loss": 1.0, "is_weight_max": 2.5, "weight_version_min": 1.0}):
        assert add_metrics(dict(first), more) == merge_metrics(dict(first), more)
