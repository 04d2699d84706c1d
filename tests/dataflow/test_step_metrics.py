"""A new step metric is the code that reports it plus one `register_metric` line: the step record, the console
line and the dashboard's charts follow from the registration."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mindspeed_rl.dashboard import DashboardState
from mindspeed_rl.dataflow import get_algorithm
from mindspeed_rl.dataflow.metrics import (COUNTED, REPORTED, STEP_METRICS, StepMetric, chart_specs, console_metrics,
                                           curve_metrics, register_metric)
from mindspeed_rl.trainer.run_log import format_line, plot_curve
from mindspeed_rl.trainer.step_metrics import step_record

SYNC = {"actor": {"seconds": 0.01, "checksum": None, "readers": 1, "bytes": 0}}


def _record(reports: list[dict], step: int = 3) -> dict:
    mfcs, _ = get_algorithm("grpo")
    plan = SimpleNamespace(order=mfcs, trained={"actor": "actor_train"})
    return step_record(plan, step, reports, step_s=1.0, stages_s=0.9, sync=SYNC, kl_coef=0.0, policy_version=2)


def _report(stage: str, **metrics) -> dict:
    return {"stage": stage, "metrics": metrics, "t_start": 0.0, "t_end": 1.0, "compute_s": 0.5}


@pytest.fixture
def shortest():
    """What a new metric needs: the rollout reports `response_length_min` (one line in its compute function),
    and one registration."""
    register_metric(StepMetric("response_length/min", "responses", "response_length_min", "rows", REPORTED,
                               label="resp_min", fmt=".0f", chart="Shortest response", curve=True))
    yield "response_length/min"
    STEP_METRICS.pop("response_length/min")


def test_a_registered_metric_reaches_the_record_the_console_and_the_charts(shortest, tmp_path, monkeypatch):
    reports = [_report("actor_rollout", rows=4.0, response_length_sum=10.0, response_length_min=2.0),
               _report("actor_rollout", rows=4.0, response_length_sum=12.0, response_length_min=1.0)]
    rec = _record(reports)
    assert rec[shortest] == 1.0, "an extreme (_min) is combined by the naming rule and kept as it is"
    assert rec["response_length/mean"] == pytest.approx(22 / 8)
    assert "resp_min 1" in format_line(rec)
    assert {"title": "Shortest response", "keys": [shortest], "stageKeys": False} in chart_specs()
    assert {"title": "Shortest response", "keys": [shortest], "stageKeys": False} in \
        DashboardState({"title": "t"}).snapshot()["info"]["charts"]
    assert shortest not in _record([_report("actor_rollout", rows=4.0)]), "REPORTED: absent when not reported"
    assert curve_metrics() == ["reward/mean", "timing/step", shortest]
    import matplotlib.pyplot as plt
    drawn = []
    monkeypatch.setattr(plt.Axes, "set_title", lambda ax, t, *a, **k: drawn.append(t))
    assert plot_curve([rec, {**rec, "step": 4}], tmp_path / "curve.png") and (tmp_path / "curve.png").stat().st_size
    assert drawn == curve_metrics(), "curve.png: a panel per curve metric"


def test_when_and_behind_decide_presence_and_value():
    rec = _record([_report("actor_rollout", rows=4.0, weight_version_min=1.0, weight_version_sum=6.0),
                   _report("actor_log_prob", logprob_diff_max=0.5, logprob_diff_sum=1.0, logprob_diff_tokens=0.0)])
    assert rec["async/staleness_max"] == 2.0 and rec["async/staleness_mean"] == 3 - 6 / 4
    assert "rollout/logprob_diff_mean" not in rec, "COUNTED: absent with a count of 0"
    assert rec["reward/mean"] == 0.0, "ALWAYS: 0 when no stage reported it"


def test_console_line_and_charts_follow_the_registry():
    keys = [k for k, _, _ in console_metrics()]
    assert keys[:3] == ["reward/mean", "reward/rule_mean", "reward/model_mean"]
    charts = {c["title"]: c for c in chart_specs()}
    assert charts["Reward"]["keys"] == ["reward/mean", "reward/max_fraction"]
    assert charts["Per-stage time (s)"] == {"title": "Per-stage time (s)", "keys": ["timing/{stage}"],
                                            "stageKeys": True}


@pytest.mark.parametrize("kwargs, message", [
    ({"key": "nogroup"}, "name it <group>/<name>"),
    ({"key": "a/b", "when": "sometimes"}, "when='sometimes'"),
    ({"key": "a/b", "column": "responses"}, "names both"),
    ({"key": "a/b", "column": "responses", "total": "x_sum", "when": COUNTED}, "needs a count"),
])
def test_a_bad_metric_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepMetric(**kwargs)
    with pytest.raises(TypeError, match="not a StepMetric"):
        register_metric({"key": "a/b"})


def test_a_registered_family_adds_its_keys_after_the_built_in_ones():
    """The keys that follow the graph come from registered families, in registration order; a new one is a
    function of the step's inputs under one `register_family` line."""
    from mindspeed_rl.trainer.step_metrics import METRIC_FAMILIES, register_family
    assert list(METRIC_FAMILIES) == ["other_rewards", "reward_parts", "tool_calls", "trained_models", "driver",
                                     "stage_times", "weight_syncs", "throughput"]

    @register_family("rollout_ranks")
    def rollout_ranks(x):
        return {"rollout/ranks": float(len(x.by_stage.get("actor_rollout", [])))}
    try:
        rec = _record([_report("actor_rollout", rows=4.0), _report("actor_rollout", rows=4.0)])
        assert rec["rollout/ranks"] == 2.0 and list(rec)[-1] == "rollout/ranks"
        assert rec["timing/step"] == 1.0 and rec["weight_version"] == 2
    finally:
        METRIC_FAMILIES.pop("rollout_ranks")
