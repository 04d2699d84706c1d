"""The plan as the user sees it: the printed table (`trainer.dry_run=true`) and plan.json."""
from __future__ import annotations

from .groups import role_names
from .plan import Plan


def plan_dict(plan: Plan, landed: dict | None = None) -> dict:
    """What the plan decided, as plan.json holds it: per worker group its MFCs, backends, dp/tp/pp, devices,
    actors and which ranks read the dock and write results; the stage order, columns and weight syncs; once the
    workers run, where each landed (`landed`: see `landed_dict`)."""
    return {**({"landed": landed} if landed else {}), "groups": {g: p.as_dict() for g, p in plan.groups.items()},
            "stage_order": [m.name for m in plan.order], "columns": list(plan.columns),
            "consumers": list(plan.consumers), "rows_per_step": plan.rows_per_step,
            "weight_sync": {model: {"trained_by": plan.trained[model], "readers": targets}
                            for model, targets in plan.sync_targets.items()},
            "model_paths": dict(plan.model_paths), "notes": list(plan.notes), "batch_sizes": list(plan.size_notes),
            "memory": plan.memory.as_dict() if plan.memory is not None else None}


def landed_dict(worker_info: dict, device_nodes: dict) -> dict:
    """Where the run's actors are: per "group/rank" its Ray node, host, pid and the accelerators Ray gave it;
    per planned device (mode mesh) the node its placement group bundle is on."""
    return {"workers": {f"{g}/{r}": {k: info.get(k) for k in ("node_id", "host", "pid", "accelerators")}
                        for (g, r), info in sorted(worker_info.items())},
            "devices": {str(d): n for d, n in sorted(device_nodes.items())}}


def write_plan_json(plan: Plan, directory: str, landed: dict | None = None) -> str:
    """plan.json in `directory` (a dry run's and a real run's output_dir), written whole or not at all."""
    import json
    import os
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "plan.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(plan_dict(plan, landed), f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def format_plan(plan: Plan) -> str:
    """The plan as `trainer.dry_run=true` prints it: the worker groups (mode mesh: the per-MFC table first)."""
    if plan.placement is not None:
        return _format_mesh_plan(plan)
    return _format_groups(plan)


def _format_mesh_plan(plan: Plan) -> str:
    """mode mesh: the per-MFC table and the devices' sharing (docs/parallel.md), then the worker groups."""
    group_of = {m.name: g for g, p in plan.groups.items() for m in p.mfcs}
    return ("per-MFC placement on " + str(plan.placement.cluster) + "\n" + plan.placement.format_table()
            + "\n\nranks of each MFC (rank k of its worker group runs on the k-th device of its mesh; a replica's "
              "dock reader pulls its micro-batches and broadcasts them to the replica, its writer pushes the "
              "outputs)\n" + plan.placement.format_ranks(group_of)
            + "\n\nworker groups (MFCs of one model on one mesh share a group)\n" + _format_groups(plan))


def _format_groups(plan: Plan) -> str:
    """The worker groups' table, the totals, the stage order, the weight syncs, the columns and the notes."""
    from ..parallel import format_ids
    split = any(p.tp * p.pp > 1 for p in plan.groups.values())  # an engine-split rollout group's tp too
    rows = [("group", "MFCs", "role/type", "dp") + (("tp", "pp", "ranks") if split else ())
            + ("cpus", "gpus", "npus", "device", "on devices")]
    for g, p in plan.groups.items():
        r = p.resources
        rows.append((g, ", ".join(m.name for m in p.mfcs),
                     ", ".join(role_names(p.mfcs)),
                     str(r.dp)) + ((str(p.tp), str(p.pp), str(p.world)) if split else ())
                    + (f"{r.num_cpus:g}", f"{r.num_gpus:g}", f"{r.num_npus:g}", r.device,
                       format_ids(p.devices) if p.devices else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tot = plan.resource_totals()
    lines.append(f"total: {tot['CPU']:g} CPU, {tot['GPU']:g} GPU, {tot['NPU']:g} NPU; "
                 f"{plan.rows_per_step} rows per step")
    lines.append("stage order (blocking mode): " + " -> ".join(m.name for m in plan.order))
    for model, targets in plan.sync_targets.items():
        lines.append(f"weight sync after each optimizer step of '{plan.trained[model]}': {model} -> {targets}")
    lines.append("dock columns: " + ", ".join(plan.columns))
    lines.extend(plan.notes)
    lines.extend(f"batch size: {s}" for s in plan.size_notes)
    return "\n".join(lines)
