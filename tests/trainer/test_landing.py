"""trainer/landing.py: a worker off the node of its planned devices, two ranks of one NCCL group on one
accelerator, and actors that should share a device on two, are named before any model loads. The workers'
reports are written out here (the two-node test checks the real ones: tests/trainer/test_multinode.py).
trainer/launch.py's reservations: the groups holding fractions of a device share one, actor by actor."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import ConfigError, config_from_dict
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


def one_gpu_plan(**overrides):
    """configs/grpo_qwen25_0p5b_1gpu.yaml planned (vLLM's worker 0.4 of the GPU, the trainer's 0.6)."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "grpo_qwen25_0p5b_1gpu.yaml").read_text())
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return make_plan(config_from_dict(raw), check_files=False)


def test_groups_holding_fractions_of_a_device_are_reserved_together_actor_by_actor():
    from mindspeed_rl.trainer.launch import group_bundles
    bundles, member_of = group_bundles(one_gpu_plan())
    # rollout (0.4 GPU, 2 CPUs) and integrated (0.6 GPU, 2 CPUs): one bundle holds actor 0 of both, so Ray
    # gives them one GPU; the CPU-only rule group keeps a reservation of its own
    assert member_of["rollout"] == member_of["integrated"] == "rollout+integrated"
    assert bundles["rollout+integrated"] == [{"CPU": 4, "GPU": 1.0, "NPU": 0}]
    assert member_of["rule"] == "rule" and bundles["rule"] == [{"CPU": 2, "GPU": 0, "NPU": 0}]


def test_actors_sharing_a_device_that_landed_apart_are_named():
    plan = one_gpu_plan()
    infos = {(g, r): {"node_id": "n" * 40, "host": "10.0.0.1", "accelerators": ["GPU:0"] if g != "rule" else []}
             for g, p in plan.groups.items() for r in range(p.world)}
    assert landing_errors(plan, infos, {}) == []
    infos[("integrated", 0)]["accelerators"] = ["GPU:1"]
    [error] = landing_errors(plan, infos, {})
    assert error.startswith("actor 0 of the groups sharing a device (rollout, integrated) landed apart (rollout: "
                            "GPU:0 on node nnnnnnnnnnnn; integrated: GPU:1 on node nnnnnnnnnnnn)")


def test_shares_of_one_device_over_one_are_refused_at_the_plan():
    with pytest.raises(ConfigError, match=r"on device 0 their num_gpus add up to 1.1 \(rollout: 0.5, integrated: "
                                          r"0.6\); lower placement.groups.<group>.num_gpus"):
        one_gpu_plan(**{"placement.groups.rollout.num_gpus": 0.5})
