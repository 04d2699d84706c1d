"""trainer/landing.py: a worker off the node of its planned devices, and two ranks of one NCCL group on one
accelerator, are named before any model loads. The workers' reports are written out here (the two-node test
checks the real ones: tests/trainer/test_multinode.py)."""
from __future__ import annotations

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer.landing import landing_errors
from mindspeed_rl.planning import make_plan

MESH = {"placement": {"mode": "mesh", "n_nodes": 2, "n_devices_per_node": 1, "device_kind": "cpu",
                      "cpus_per_device": 1,
                      "mfcs": {"actor_rollout": {"mesh": 0}, "ref_log_prob": {"mesh": 0}, "actor_log_prob": {"mesh": "all", "dp": 2},
                               "actor_train": {"mesh": "all"}}}}


def test_a_worker_off_its_planned_node_is_named():
    plan = make_plan(config_from_dict(MESH), check_files=False)
    trainer = next(g for g, p in plan.groups.items() if any(m.name == "actor_train" for m in p.mfcs))
    nodes = {0: "a" * 40, 1: "b" * 40}
    infos = {(g, r): {"node_id": nodes[p.actor_devices(r)[0]] if p.devices else "a" * 40, "host": "10.0.0.1"}
             for g, p in plan.groups.items() for r in range(p.world)}
    assert landing_errors(plan, infos, nodes) == []
    infos[(trainer, 1)] = {"node_id": "a" * 40, "host": "10.0.0.1"}
    [error] = landing_errors(plan, infos, nodes)
    assert error.startswith(f"worker {trainer}/1 runs on node aaaaaaaaaaaa (10.0.0.1), not on the node of its planned "
                            "device(s) [1] (bbbbbbbbbbbb)")


def test_two_ranks_of_one_collective_group_on_one_accelerator_are_named():
    plan = make_plan(config_from_dict({"placement": {"groups": {"integrated": {"dp": 2, "device": "cuda",
                                                                               "num_gpus": 1}}}}), check_files=False)
    infos = {("integrated", r): {"node_id": "n" * 40, "host": "10.0.0.1", "accelerators": [f"GPU:{r}"]}
             for r in range(2)}
    infos[("rule", 0)] = {"node_id": "n" * 40, "host": "10.0.0.1", "accelerators": []}
    assert landing_errors(plan, infos, {}) == []
    infos[("integrated", 1)]["accelerators"] = ["GPU:0"]
    [error] = landing_errors(plan, infos, {})
    assert error.startswith("ranks 0 and 1 of group 'integrated' share accelerator GPU:0 on node nnnnnnnnnnnn")
