"""benchmarks/async_speedup.py --engine real: each workload and mode is a config the trainer plans (vLLM serving,
the groups bound to their cores, the mode's staleness), and the ratios it reports are the ones its targets name."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.planning import make_plan

_spec = importlib.util.spec_from_file_location(
    "async_speedup", Path(__file__).resolve().parents[2] / "benchmarks" / "async_speedup.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("workload", list(bench.REAL_WORKLOADS))
@pytest.mark.parametrize("mode", bench.REAL_MODES)
def test_every_real_run_is_a_plan_with_its_cores_and_staleness(workload, mode, tmp_path):
    cfg = config_from_dict(bench.make_real_config(workload, mode, 4, str(tmp_path)))
    plan = make_plan(cfg, check_files=False)
    assert plan.groups["rollout"].rollout_row.name == "vllm" and cfg.generate_config.vllm.serve
    for group, cores in bench.REAL_CORES.items():
        assert plan.groups[group].resources.cpu_affinity == cores
    k = {"k0_blocking": 0, "k1": 1, "k2": 2, "k2_partial": 2}[mode]
    assert cfg.rl_config.max_weight_staleness == k and cfg.rl_config.blocking == (k == 0)
    assert cfg.rl_config.partial_rollout == (mode == "k2_partial")
    assert cfg.actor_config.lr == 1e-9  # the lengths stay the same over the steps


def test_the_real_targets_compare_the_modes_the_issue_names(monkeypatch):
    """speedup_k1_over_blocking_balanced_real = balanced blocking / k1; ..._longtail_real = longtail k2 / k2 partial."""
    step = {("balanced", "k0_blocking"): 1.0, ("balanced", "k1"): 0.5, ("balanced", "k2"): 0.5,
            ("balanced", "k2_partial"): 0.5, ("longtail", "k0_blocking"): 2.0, ("longtail", "k1"): 1.2,
            ("longtail", "k2"): 1.0, ("longtail", "k2_partial"): 0.8}

    def fake(workload, mode, steps):
        s = step[(workload, mode)]
        return {"step_s": s, "step_min_s": s, "step_max_s": s, "run_step_s": s * 1.1, "rollout_s": s / 2,
                "train_side_s": s / 2, "response_length_mean": 1.0, "response_length_max": 1.0,
                "partial_fraction": 0.0}
    monkeypatch.setattr(bench, "measure_real", fake)
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))   # as when it runs as a script
    res = bench.run_real(4)
    assert res["ratios"]["speedup_k1_over_blocking_balanced_real"] == pytest.approx(2.0)
    assert res["ratios"]["speedup_k2_partial_over_k2_longtail_real"] == pytest.approx(1.25)
    assert res["workloads"]["balanced"]["k1"]["bound"] == pytest.approx(2.0)  # blocking / max(rollout, train)
    assert res["commit"] and res["placement"]["rollout"]["cores"] == bench.REAL_CORES["rollout"]


@pytest.mark.parametrize("workload", list(bench.WORKLOADS))
@pytest.mark.parametrize("mode", [m[0] for m in bench.MODES])
def test_every_simulated_run_is_a_plan_with_a_stage_for_each_cost(workload, mode, tmp_path):
    """Every stage the workload puts a cost on is in the graph (the old log-probs' stage in every mode)."""
    _, k, blocking, partial = next(m for m in bench.MODES if m[0] == mode)
    cfg = config_from_dict(bench.make_config(workload, k, blocking, 4, str(tmp_path), partial))
    plan = make_plan(cfg, check_files=False)
    assert set(bench.WORKLOADS[workload]) <= {m.name for m in plan.order}
