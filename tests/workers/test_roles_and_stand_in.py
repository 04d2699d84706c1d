"""What a worker is handed and what it makes of it: the stage loop's roles from the deployment's `RankRole`
(`LoopRoles.of`), and, under trainer.simulate_cost_s_per_row, the simulate backend's stand-in declaring the
engines (no model, the cost of each call) and standing in for the compute MFCs (`StandIn`). No Ray here."""
from __future__ import annotations

import time
from types import SimpleNamespace

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.dataflow.mfc import InterfaceType
from mindspeed_rl.engines.deployment import DATA_PARALLEL, MESH, Deployment
from mindspeed_rl.engines.simulate import PLACEHOLDER
from mindspeed_rl.planning import make_plan
from mindspeed_rl.trainer.worker_specs import engine_decls, group_args, worker_specs
from mindspeed_rl.workers.engine_set import ROLLOUT_ROLE, TRAIN_ROLE
from mindspeed_rl.workers.impls import StageContext, StandIn, build_impl
from mindspeed_rl.workers.stage import LoopRoles

COSTS = {"actor_rollout": 0.004, "actor_train": 0.002, "rule_reward": 0.001}


def _engine(collective_forward: bool, shares_batches: bool = True):
    return SimpleNamespace(collective_forward=collective_forward, shares_batches=shares_batches,
                           replica_group="replica", device=None)


# ------------------------------------------------------------------------------------------ loop roles
def test_loop_roles_come_from_the_deployments_role():
    roles = Deployment("mesh", MESH, dp=2, tp=1, pp=2).roles()   # replica 0: ranks 0 (reads), 2 (writes)
    reader, writer = roles[0], roles[2]
    train = LoopRoles.of(writer, InterfaceType.TRAIN_STEP, _engine(True), rows=16)
    assert (train.reads, train.writes, train.fixed_units) == (False, False, True)
    fwd = LoopRoles.of(writer, InterfaceType.INFERENCE, _engine(True), rows=16)
    assert (fwd.reads, fwd.writes, fwd.share_src, fwd.share_group) == (False, True, 0, "replica")
    assert fwd.collective_stop and fwd.stop_group is None   # sharded: every rank goes on while any reader has rows
    gen = LoopRoles.of(reader, InterfaceType.GENERATE, _engine(False), rows=16)
    assert (gen.reads, gen.writes, gen.stop_group) == (True, False, "replica")   # replicas stop on their own


def test_a_one_rank_replica_reads_and_writes_and_shares_collective_forwards():
    role = Deployment("fsdp", DATA_PARALLEL, dp=2).roles()[1]
    assert LoopRoles.of(role, InterfaceType.INFERENCE, _engine(True), rows=16).max_rows == 8
    assert LoopRoles.of(role, InterfaceType.INFERENCE, _engine(False), rows=16).max_rows is None
    plain = LoopRoles.of(role, InterfaceType.COMPUTE, None, rows=16)
    assert (plain.reads, plain.writes, plain.share_group, plain.max_rows) == (True, True, None, None)


# ------------------------------------------------------------------------------------------ stand-in
def _simulated():
    cfg = config_from_dict({"trainer": {"simulate_cost_s_per_row": COSTS, "simulate_generate_slots": 4}})
    return cfg, make_plan(cfg, check_files=False)


def test_the_stand_in_declares_engines_without_a_model():
    cfg, plan = _simulated()
    decls = [d for gp in plan.groups.values() for d in engine_decls(cfg, plan, gp)]
    assert decls and all(d.backend.name == "simulate" and d.model_path == "" and d.features == {} for d in decls)
    rollout = next(d for d in decls if d.role == ROLLOUT_ROLE)
    assert rollout.options == {"costs": {"generate": 0.004}, "slots": 4, "sigma": 0.0}
    train = next(d for d in decls if d.role == TRAIN_ROLE)
    assert train.options["costs"]["train"] == 0.002
    specs = [s for gp in plan.groups.values() for s in worker_specs(cfg, plan, gp, [], lambda k: {})]
    assert all(s.tokenizer_path == "" for s in specs)   # no model: nothing to tokenize


def test_the_stand_in_replaces_a_compute_function_and_keeps_its_micro_batch():
    cfg, plan = _simulated()
    (gp,) = [gp for gp in plan.groups.values() if any(m.name == "rule_reward" for m in gp.mfcs)]
    args = group_args(cfg, plan, gp)["rule_reward"]
    assert args["stand_in_args"] == {"cost_s_per_row": 0.001} and "reward_fn" not in args and args["count"] >= 1
    mfc = next(m for m in gp.mfcs if m.name == "rule_reward")
    impl = build_impl(StageContext(mfc=mfc, step=0, policy_version=0, kl_coef=0.0, args=args, host=None))
    assert isinstance(impl, StandIn) and impl.count == args["count"]
    t0 = time.perf_counter()
    out = impl.run({}, [0, 1, 2])
    assert time.perf_counter() - t0 >= 0.003
    assert set(out.columns) == set(mfc.output_keys) and all(v == [PLACEHOLDER] * 3 for v in out.columns.values())


def test_real_compute_has_no_stand_in():
    cfg = config_from_dict({})
    plan = make_plan(cfg, check_files=False)
    for gp in plan.groups.values():
        assert not any("stand_in" in a for a in group_args(cfg, plan, gp).values())
        assert all(d.backend.name != "simulate" for d in engine_decls(cfg, plan, gp))


def test_partial_rollout_reaches_every_worker_of_the_run():
    """rl_config.partial_rollout is what each worker's WeightHost is built with (workers/weights.py `_writing`)."""
    for partial in (False, True):
        cfg = config_from_dict({"rl_config": {"max_weight_staleness": 1, "guarantee_order": not partial,
                                              "partial_rollout": partial}, "placement": {"mode": "disaggregated"}})
        plan = make_plan(cfg, check_files=False)
        specs = [s for gp in plan.groups.values() for s in worker_specs(cfg, plan, gp, [], lambda k: {})]
        assert len(specs) >= 2 and all(s.partial_rollout is partial for s in specs)
