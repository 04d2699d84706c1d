"""Where the workers landed, checked against the plan once they run, before any model loads.

Why: the memory plan and the collectives assume each actor holds the devices the plan gave it. In mode mesh
an actor is pinned to its devices' placement-group bundles, so it lands on the node those bundles are on
unless Ray placed it elsewhere; outside mode mesh Ray places each actor by its resource share, and two ranks
of one NCCL or HCCL group on one device end the run when the group first talks, with an error that names
neither; the groups holding a fraction of an accelerator are counted by the memory plan as sharing actor k's
device, which their shared reservation asks Ray for (`launch.group_bundles`). Each worker reports its node
and the accelerators Ray gave it (`Worker.ping`); a mismatch stops the run naming the worker, what the plan
said and where it is.
"""
from __future__ import annotations

from typing import Mapping

from ..planning import Plan


def landing_errors(plan: Plan, infos: Mapping[tuple[str, int], dict], device_nodes: Mapping[int, str]) -> list[str]:
    """infos: (group, rank) -> the worker's ping (node_id, host, accelerators); device_nodes: planned device -> the
    node its bundle is on (mode mesh; empty otherwise). One line per worker off its planned node, and per
    device two ranks of one collective group share."""
    errors = []
    for (g, rank), info in sorted(infos.items()):
        planned = {device_nodes[d] for d in plan.groups[g].actor_devices(rank) if d in device_nodes}
        if planned and info["node_id"] not in planned:
            errors.append(f"worker {g}/{rank} runs on node {info['node_id'][:12]} ({info.get('host')}), not on the "
                          f"node of its planned device(s) {plan.groups[g].actor_devices(rank)} "
                          f"({', '.join(n[:12] for n in sorted(planned))})")
    errors += _colocation_errors(plan, infos)
    for g, p in plan.groups.items():
        if p.deployment is None or not p.deployment.joins_default_process_group:
            continue
        seen: dict[tuple[str, str], int] = {}
        for rank in range(p.world):
            info = infos.get((g, rank))
            for acc in (info or {}).get("accelerators", []):
                other = seen.setdefault((info["node_id"], str(acc)), rank)
                if other != rank:
                    errors.append(f"ranks {other} and {rank} of group '{g}' share accelerator {acc} on node "
                                  f"{info['node_id'][:12]} ({info.get('host')}): NCCL/HCCL refuse two ranks on one "
                                  "device; give each rank a whole device")
    return errors


def _colocation_errors(plan: Plan, infos: Mapping[tuple[str, int], dict]) -> list[str]:
    """Actor k of every group holding a fraction of an accelerator on one device (node and accelerator ids), as
    the memory plan counts them (planning/memory.py); one line per k where they are apart."""
    from ..planning.groups import device_sharing_groups
    fractional = device_sharing_groups(plan.groups)
    errors = []
    for k in range(max((plan.groups[g].world for g in fractional), default=0)):
        where = {g: (infos[(g, k)]["node_id"], tuple(infos[(g, k)].get("accelerators") or ()))
                 for g in fractional if k < plan.groups[g].world and (g, k) in infos}
        if len(set(where.values())) > 1:
            errors.append(f"actor {k} of the groups sharing a device ({', '.join(where)}) landed apart ("
                          + "; ".join(f"{g}: {','.join(acc) or 'no accelerator'} on node {node[:12]}"
                                      for g, (node, acc) in where.items())
                          + "): the memory plan counts them on one device; their shared placement group should "
                            "have put them there, so Ray's placement was overridden (RAY_*/CUDA_VISIBLE_DEVICES?)")
    return errors
