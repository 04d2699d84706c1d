"""Where each MFC runs and how its ranks are split: device meshes, DP/TP/PP topology, Ray placement.

Why a package of its own: placement is configuration, not code. An algorithm's MFCs (generate,
inference, train_step) each name a mesh of devices and a DP/TP/PP strategy; everything else (the
parallel groups, which ranks read from and write to the TransferDock, which MFCs share a device,
the Ray placement groups that reserve the devices) follows from those few numbers by pure
functions, checked before any worker starts. Layer 2: it imports no trainer, worker or engine.

- `mesh`: `DeviceMesh` and its rules (whole hosts, or an aligned slice of one host).
- `topology`: `ProcessTopology` (PP outermost, DP, TP innermost), `parallel_groups`, dock readers and writers.
- `broadcast`: `broadcast_micro_batch`, reader -> replica over torch.distributed.
- `placement`: per-MFC placement from YAML, `PlacementPlan` (dry-run table, cluster check,
  bundles) and `create_placement_groups`.
"""
from .broadcast import broadcast_micro_batch
from .mesh import DeviceMesh, format_ids
from .placement import (ClusterSpec, MFCPlacement, PlacementPlan, create_group_placement_groups,
                        create_placement_groups, placement_group_nodes, plan_placement, remove_placement_groups,
                        scheduling_strategy)
from .topology import (Coord, ParallelGroups, ProcessTopology, dock_reader_ranks, dock_writer_ranks, parallel_groups,
                       replica_members)

__all__ = [
    "DeviceMesh", "format_ids",
    "Coord", "ParallelGroups", "ProcessTopology", "dock_reader_ranks", "dock_writer_ranks", "parallel_groups",
    "replica_members",
    "broadcast_micro_batch",
    "ClusterSpec", "MFCPlacement", "PlacementPlan", "create_group_placement_groups", "create_placement_groups",
    "placement_group_nodes", "plan_placement", "remove_placement_groups", "scheduling_strategy",
]
