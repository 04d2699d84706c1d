"""trainer.simulate_cost_s_per_row: the cost model's key is checked before anything starts, and
its errors name the key, the value and the fix."""
from __future__ import annotations

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.planning import format_plan, make_plan

from .helpers import error_of, with_overrides

KEY = "trainer.simulate_cost_s_per_row"


def test_default_is_off():
    cfg = config_from_dict(with_overrides({}))
    assert cfg.trainer.simulate_cost_s_per_row == {}
    assert "sleeping compute" not in format_plan(make_plan(cfg, check_files=False))


def test_valid_costs_plan_and_say_so():
    cfg = config_from_dict(with_overrides({KEY: {"actor_rollout": 0.004, "actor_train": 0}}))
    plan = make_plan(cfg, check_files=False)
    assert cfg.trainer.simulate_cost_s_per_row == {"actor_rollout": 0.004, "actor_train": 0}
    assert "sleeping compute" in format_plan(plan)


@pytest.mark.parametrize("value", [-0.001, "fast", True])
def test_bad_cost_is_named(value):
    msg = error_of({KEY: {"actor_rollout": value}}, "validate")
    assert f"{KEY}.actor_rollout={value!r}" in msg and "seconds per row" in msg and ">= 0" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_cost_is_refused_at_load(value):
    msg = error_of({KEY: {"actor_rollout": value}}, "load")  # config/load.py refuses nan/inf for every key
    assert f"{KEY}.actor_rollout={value!r}" in msg and "must be a finite number" in msg


def test_not_a_mapping_is_refused_at_load():
    msg = error_of({KEY: [0.004]}, "load")
    assert KEY in msg and "expected a mapping" in msg


def test_unknown_stage_names_the_graphs_stages():
    msg = error_of({KEY: {"actor_rollout": 0.004, "rollout": 0.001}}, "plan", check_files=False)
    assert f"{KEY}.rollout=0.001" in msg and "no stage 'rollout' in the grpo graph" in msg
    assert "'actor_rollout'" in msg and "'actor_train'" in msg
