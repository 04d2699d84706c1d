"""A new compute step is one implementation class under one `compute_step` line: the plan checks MFCs that
name it, the driver takes its arguments from the config, the worker calls it."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow import ALGORITHMS, MFCDef, get_algorithm, register_algorithm
from mindspeed_rl.planning import make_plan
from mindspeed_rl.workers.compute import FUNCTIONS, Output, check_mfc, compute_step
from mindspeed_rl.workers.impls import Impl, PlanInfo, StageContext, impl_class, mfc_args

from ..config.helpers import with_overrides


@pytest.fixture
def neg_reward():
    @compute_step("neg_reward", "compute", inputs=("rm_scores",), outputs=("neg_scores",))
    class NegReward(Impl):
        """Minus each row's reward."""

        @staticmethod
        def args(cfg, mfc, info):
            return {"count": cfg.rl_config.dock_micro_batch_size}

        def __call__(self, batch, rows):
            scores = [-s for s in batch["rm_scores"]]
            return Output({"neg_scores": scores}, {"neg_sum": float(sum(float(s) for s in scores))})

    register_algorithm("grpo_neg", lambda options: get_algorithm("grpo", options)[0] + [
        MFCDef("negate", "advantage", "compute", ("rm_scores",), ("neg_scores",), fn="neg_reward")])
    yield NegReward
    FUNCTIONS.pop("neg_reward")
    ALGORITHMS.pop("grpo_neg")


def test_a_declared_step_is_checked_planned_and_called(neg_reward):
    f = FUNCTIONS["neg_reward"]
    assert (f.impl, f.inputs, f.outputs, f.doc) == (neg_reward, ("rm_scores",), ("neg_scores",),
                                                   "Minus each row's reward.")
    cfg = config_from_dict(with_overrides({"rl_config.algorithm": "grpo_neg"}))
    plan = make_plan(cfg, check_files=False)
    mfc = next(m for m in plan.order if m.name == "negate")
    assert check_mfc(mfc) is f and impl_class(mfc) is neg_reward
    args = mfc_args(cfg, mfc, PlanInfo())
    assert args == {"count": cfg.rl_config.dock_micro_batch_size}
    ctx = StageContext(mfc=mfc, step=0, policy_version=0, kl_coef=0.0, args=args, host=None)
    out = impl_class(mfc)(ctx).run({"rm_scores": [torch.tensor([0.5]), torch.tensor([1.0])]}, [0, 1])
    assert [float(s) for s in out.columns["neg_scores"]] == [-0.5, -1.0] and out.metrics == {"neg_sum": -1.5}


def test_an_mfc_that_feeds_a_declared_step_the_wrong_columns_is_refused(neg_reward):
    bad = MFCDef("negate", "advantage", "compute", ("advantages",), ("neg_scores",), fn="neg_reward")
    with pytest.raises(ValueError, match=r"fn='neg_reward' needs \['rm_scores'\]"):
        check_mfc(bad)
