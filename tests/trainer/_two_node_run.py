"""Run by test_multinode.py in a fresh process: a two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`), the tiny GRPO job placed by per-MFC meshes across both nodes.
Prints one JSON line: where each worker group and each planned device landed, and the rewards."""
from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer import Trainer


def main(out_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    cfg = config_from_dict({
        "trainer": {"total_steps": 2, "output_dir": out_dir, "progress": False, "logger": ["jsonl"], "plot": False,
                    "save_interval": 0, "stage_timeout_s": 60, "dashboard": False, "report": False},
        "placement": {"mode": "mesh", "n_nodes": 2, "n_devices_per_node": 2, "device_kind": "cpu",
                      "cpus_per_device": 0.5, "ray_address": cluster.address,
                      # rollout and reference on node 0; the actor's log-probs and training on both
                      # devices of node 1, as DDP over gloo
                      "mfcs": {"actor_rollout": {"mesh": "node0:0"}, "ref_log_prob": {"mesh": "node0:1"},
                               "actor_log_prob": {"mesh": "node1", "dp": 2}, "actor_train": {"mesh": "node1"}}}})
    import mindspeed_rl.transfer_dock.client as dock_client
    create, dock_nodes = dock_client.create_transfer_dock, []

    def recording(*args, **kwargs):   # where each dock landed, before the run ends it
        client = create(*args, **kwargs)
        dock_nodes.append(ray.get(client.actor.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id())))
        return client
    dock_client.create_transfer_dock = recording
    trainer = Trainer(cfg)
    try:
        history = trainer.run()
        result = {"head": head, "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
                  "worker_nodes": trainer.worker_nodes, "device_nodes": {str(k): v for k, v in trainer.device_nodes.items()},
                  "groups": {g: [m.name for m in p.mfcs] for g, p in trainer.plan.groups.items()},
                  "dock_nodes": dock_nodes, "rewards": [r["reward/mean"] for r in history],
                  "versions": [r["weight_version"] for r in history]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
