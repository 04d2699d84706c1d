"""Per-MFC placement, as ReaLHF allocates it: each MFC names its own mesh and DP/TP/PP strategy.

MFCs may share devices (the actor's generation and the critic's inference on the same GPUs, taking
turns) or sit on disjoint ones (running at once). The YAML for one MFC is::

    actor_gen: {mesh: all, dp: 4, tp: 1, pp: 2}
    critic_inf: {mesh: "node0:0-1", dp: 2}
    ref_inf: {mesh: "4-7", dp: 4}

`plan_placement` checks every entry (mesh rules, ``dp*tp*pp == mesh size``) and returns a
`PlacementPlan`: the groups of each MFC, which MFCs share each device, a dry-run table, a check
against the resources Ray reports, and the Ray placement-group bundles. `create_placement_groups`
reserves those bundles (one STRICT_PACK group per node) so a worker can be pinned to a device.
Nothing here starts a worker; ray is imported only inside the functions that talk to it.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..device import DEVICE_KINDS, RAY_RESOURCES, device_spec, ray_resource
from .mesh import DeviceMesh, format_ids
from .topology import ParallelGroups, ProcessTopology, parallel_groups

CPU = ray_resource("cpu")  # Ray's CPU resource: a cpu cluster's devices, and the CPUs beside an accelerator
PLACEMENT_KEYS = ("mesh", "dp", "tp", "pp")


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster the plan is for: ``n_nodes`` hosts of ``n_devices_per_node`` devices of one kind.

    On ``cpu`` a "device" is a slot of `cpus_per_device` Ray CPUs (the CPU test path of the same code);
    ``cuda`` is accepted for ``gpu``.
    """

    n_nodes: int
    n_devices_per_node: int
    device_kind: str

    def __post_init__(self):
        for name in ("n_nodes", "n_devices_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ClusterSpec: {name}={v!r} must be an integer >= 1")
        try:  # either spelling: "cuda" is "gpu" (device/DEVICE_TABLE)
            kind = device_spec(self.device_kind).name if isinstance(self.device_kind, str) else None
        except ValueError:
            kind = None
        if kind is None:
            raise ValueError(f"ClusterSpec: device_kind={self.device_kind!r}; use one of {list(DEVICE_KINDS)}")
        object.__setattr__(self, "device_kind", kind)

    @property
    def resource(self) -> str:
        """The Ray resource one device is: "CPU", "GPU" or "NPU"."""
        return ray_resource(self.device_kind)

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.n_devices_per_node

    def mesh(self, spec: Any) -> DeviceMesh:
        return DeviceMesh.from_spec(spec, self.n_nodes, self.n_devices_per_node)

    def __str__(self) -> str:
        return f"{self.n_nodes} node(s) x {self.n_devices_per_node} {self.device_kind}"


def _check_size(mfc: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MFC {mfc!r}: {name}={value!r} must be an integer >= 1; use 1 to not split along "
                         f"{name.upper()}")


@dataclass(frozen=True)
class MFCPlacement:
    """Where one MFC runs (`mesh`) and how its ``dp*tp*pp == mesh.size`` ranks are split."""

    mfc: str
    mesh: DeviceMesh
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        if not isinstance(self.mfc, str) or not self.mfc.strip():
            raise ValueError(f"MFCPlacement: mfc={self.mfc!r} must be the MFC's name")
        if not isinstance(self.mesh, DeviceMesh):
            raise ValueError(f"MFC {self.mfc!r}: mesh={self.mesh!r} is not a DeviceMesh; build it with "
                             f"DeviceMesh.from_spec or use MFCPlacement.from_dict")
        for name in ("dp", "tp", "pp"):
            _check_size(self.mfc, name, getattr(self, name))
        if self.dp * self.tp * self.pp != self.mesh.size:
            size, rest = self.mesh.size, self.tp * self.pp
            hint = (f"dp={size // rest}, tp={self.tp}, pp={self.pp}" if size % rest == 0 else f"dp={size}, tp=1, pp=1")
            raise ValueError(
                f"MFC {self.mfc!r}: dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * rest} but its mesh "
                f"{self.mesh} has {size} device(s); one rank runs on each device, so choose dp, tp, pp whose "
                f"product is {size} (e.g. {hint}) or change the mesh")

    @classmethod
    def from_dict(cls, mfc: str, entry: Mapping[str, Any], cluster: ClusterSpec) -> "MFCPlacement":
        """Read one YAML entry ``{mesh: "all"|[ids]|"4-7"|"node1:0-3", dp: 2, tp: 1, pp: 1}``.

        ``mesh`` defaults to ``all``, ``tp`` and ``pp`` to 1, and ``dp`` to what is left:
        ``mesh size / (tp * pp)``.
        """
        if not isinstance(entry, Mapping):
            raise ValueError(f"MFC {mfc!r}: placement {entry!r} is not a mapping; write e.g. "
                             f"{{mesh: all, dp: 2, tp: 1, pp: 1}}")
        unknown = [k for k in entry if k not in PLACEMENT_KEYS]
        if unknown:
            raise ValueError(f"MFC {mfc!r}: unknown placement key(s) {unknown}; the keys are {list(PLACEMENT_KEYS)}")
        try:
            mesh = cluster.mesh(entry.get("mesh", "all"))
        except ValueError as e:
            raise ValueError(f"MFC {mfc!r}: mesh={entry.get('mesh', 'all')!r}: {e}") from None
        tp, pp = entry.get("tp", 1), entry.get("pp", 1)
        _check_size(mfc, "tp", tp)
        _check_size(mfc, "pp", pp)
        if "dp" in entry:
            dp = entry["dp"]
        elif mesh.size % (tp * pp):
            raise ValueError(f"MFC {mfc!r}: its mesh {mesh} has {mesh.size} device(s), which tp*pp = {tp}*{pp} "
                             f"does not divide; choose tp and pp whose product divides {mesh.size}")
        else:
            dp = mesh.size // (tp * pp)
        return cls(mfc, mesh, dp, tp, pp)

    @property
    def topology(self) -> ProcessTopology:
        return ProcessTopology(self.dp, self.tp, self.pp)

    @property
    def groups(self) -> ParallelGroups:
        """DP/TP/PP groups in global device ids (sub-rank i runs on the mesh's i-th device)."""
        return parallel_groups(self.mesh.devices, self.dp, self.tp, self.pp)

    @property
    def strategy(self) -> str:
        return f"{self.dp}/{self.tp}/{self.pp}"


@dataclass
class PlacementPlan:
    """Every MFC's placement on one cluster, and what follows from it."""

    cluster: ClusterSpec
    placements: dict[str, MFCPlacement]
    roles: dict[str, str]
    groups: dict[str, ParallelGroups] = field(default_factory=dict)

    def __post_init__(self):
        if not self.groups:
            self.groups = {name: p.groups for name, p in self.placements.items()}

    # ---- which MFC is where ------------------------------------------------------------------
    def devices(self) -> list[int]:
        """Sorted union of all meshes: the devices the plan reserves."""
        return sorted({d for p in self.placements.values() for d in p.mesh.devices})

    def device_map(self) -> dict[int, list[str]]:
        """Global device id -> the MFCs (in plan order) that run on it; only devices in some mesh."""
        return {d: [name for name, p in self.placements.items() if d in p.mesh] for d in self.devices()}

    def bundle_devices(self) -> dict[int, list[int]]:
        """Node -> its reserved devices, sorted; bundle i of the node's placement group is device i here."""
        per = self.cluster.n_devices_per_node
        out: dict[int, list[int]] = {}
        for d in self.devices():
            out.setdefault(d // per, []).append(d)
        return out

    # ---- resources ---------------------------------------------------------------------------
    def _per_device(self, cpus_per_device: float | None) -> dict[str, float]:
        if cpus_per_device is not None and (isinstance(cpus_per_device, bool) or
                                            not isinstance(cpus_per_device, (int, float)) or cpus_per_device < 0):
            raise ValueError(f"cpus_per_device={cpus_per_device!r} must be a number >= 0 (fractions are fine)")
        if self.cluster.device_kind == "cpu":
            cpus = 1.0 if cpus_per_device is None else float(cpus_per_device)
            if cpus <= 0:
                raise ValueError(f"cpus_per_device={cpus_per_device!r}: on a cpu cluster a device is a slot of "
                                 f"CPUs, so it must be > 0 (e.g. 0.5)")
            return {CPU: cpus}
        bundle = {self.cluster.resource: 1.0}
        if cpus_per_device:
            bundle[CPU] = float(cpus_per_device)
        return bundle

    def bundles(self, cpus_per_device: float | None = None) -> dict[int, list[dict[str, float]]]:
        """Node -> the Ray placement-group bundles for it, one per reserved device (see `bundle_devices`).

        A device is ``{"GPU": 1}`` / ``{"NPU": 1}`` (plus ``"CPU": cpus_per_device`` when given, for
        actors that ask for CPUs), or ``{"CPU": cpus_per_device}`` on a cpu cluster (default 1).
        """
        one = self._per_device(cpus_per_device)
        return {node: [dict(one) for _ in devs] for node, devs in self.bundle_devices().items()}

    def resource_needs(self, cpus_per_device: float | None = None) -> dict[str, float]:
        """Total Ray resources the bundles ask for."""
        one = self._per_device(cpus_per_device)
        n = len(self.devices())
        return {k: v * n for k, v in one.items()}

    def check_cluster(self, available: Mapping[str, float], cpus_per_device: float | None = None,
                      n_ray_nodes: int | None = None) -> None:
        """Fail fast when the plan needs more devices or nodes than Ray reports.

        `available` is ``ray.cluster_resources()`` (or ``ray.available_resources()``): resource name ->
        amount; its ``node:<ip>`` entries, when present, count the nodes.
        """
        per_device = self._per_device(cpus_per_device)
        used = self.devices()
        for res, amount in self.resource_needs(cpus_per_device).items():
            have = float(available.get(res, 0.0))
            if amount <= have + 1e-9:
                continue
            each = per_device[res]
            alone = [f"{n} ({p.mesh.size} devices x {each:g} = {p.mesh.size * each:g} {res})"
                     for n, p in self.placements.items() if p.mesh.size * each > have + 1e-9]
            sizes = ", ".join(f"{n}: {p.mesh.size} on {format_ids(p.mesh.devices)}" for n, p in self.placements.items())
            blame = (f"MFC(s) {', '.join(alone)} alone need more than that; " if alone else
                     f"the meshes together cover {len(used)} devices ({sizes}); ")
            if res == CPU and self.cluster.device_kind == "cpu":
                fix = "lower placement.cpus_per_device, shrink the meshes, or give Ray more CPUs (placement.ray_num_cpus)"
            elif res == CPU:
                fix = "lower placement.cpus_per_device (0 is fine for actors that ask for no CPU), or give Ray more CPUs"
            else:
                fix = f"shrink the meshes, or start Ray on nodes with more {res}s"
            raise ValueError(f"placement on {self.cluster} needs {amount:g} {res} ({len(used)} devices x {each:g}) "
                             f"but the Ray cluster reports {have:g} {res}; {blame}{fix}")
        # `n_ray_nodes` (count of ray.nodes()) is exact; node:<ip> keys undercount nodes that share an IP
        ray_nodes = n_ray_nodes or len([k for k in available if k.startswith("node:") and k != "node:__internal_head__"])
        nodes = self.bundle_devices()
        if ray_nodes and len(nodes) > ray_nodes:
            on = {node: [n for n, p in self.placements.items() if node in p.mesh.nodes] for node in nodes}
            raise ValueError(f"placement uses {len(nodes)} nodes ({', '.join(f'node{k}: {v}' for k, v in on.items())}) "
                             f"but the Ray cluster has {ray_nodes}; put the meshes on fewer nodes, or add "
                             f"nodes to the Ray cluster")

    # ---- dry run -----------------------------------------------------------------------------
    def format_table(self) -> str:
        """The plan as text: one row per MFC, then one row per device with the MFCs sharing it."""
        rows = [("MFC", "role", "mesh", "DP/TP/PP", "devices")]
        for name, p in self.placements.items():
            rows.append((name, self.roles[name], p.mesh.spec, p.strategy, format_ids(p.mesh.devices)))
        lines = _table(rows)
        dmap = self.device_map()
        per = self.cluster.n_devices_per_node
        drows = [("device", "node", "MFCs")]
        for d in range(self.cluster.n_devices):
            drows.append((str(d), f"{d // per}:{d % per}", ", ".join(dmap[d]) if d in dmap else "(idle)"))
        lines += [""] + _table(drows)
        used = len(dmap)
        lines.append(f"cluster: {self.cluster}; {used} of {self.cluster.n_devices} devices used, "
                     f"{sum(len(v) for v in dmap.values())} MFC ranks on them")
        return "\n".join(lines)

    def format_ranks(self, groups: Mapping[str, str] | None = None) -> str:
        """Each MFC's ranks: which device each sub-rank runs on, its TP/PP/DP groups and the ranks that
        read from and write to the dock (one each per DP replica; `topology.dock_reader_ranks`). Ranks are the
        MFC's sub-ranks, which are the worker ranks of its group; `groups` (MFC -> worker group name)
        adds the group column."""
        from .topology import dock_reader_ranks, dock_writer_ranks

        def grp(gs: list[list[int]]) -> str:
            return " ".join("[" + ",".join(str(r) for r in g) + "]" for g in gs)

        head = ("MFC",) + (("group",) if groups else ()) + ("DP/TP/PP", "rank:device", "TP groups", "PP groups",
                                                             "DP groups", "dock readers", "dock writers")
        rows = [head]
        for name, p in self.placements.items():
            t = p.topology
            devs = p.mesh.devices
            rows.append((name,) + ((groups.get(name, "-"),) if groups else ()) + (
                p.strategy, " ".join(f"{k}:{d}" for k, d in enumerate(devs)), grp(t.groups("tp")),
                grp(t.groups("pp")), grp(t.groups("dp")), ",".join(str(r) for r in dock_reader_ranks(t)),
                ",".join(str(r) for r in dock_writer_ranks(t))))
        return "\n".join(_table(rows))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def plan_placement(mfcs: Mapping[str, Mapping[str, Any] | MFCPlacement], roles: Mapping[str, str],
                   cluster: ClusterSpec) -> PlacementPlan:
    """Check every MFC's placement entry and return the plan.

    mfcs:  MFC name -> YAML entry ``{mesh: ..., dp: .., tp: .., pp: ..}`` (or an `MFCPlacement`).
    roles: MFC name -> the role/model it calls (``{"actor_gen": "actor", ...}``); every placed MFC
           needs one (extra names are ignored: e.g. CPU-only MFCs that are not placed).
    """
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"cluster={cluster!r}; pass a ClusterSpec(n_nodes, n_devices_per_node, device_kind)")
    if not isinstance(mfcs, Mapping) or not mfcs:
        raise ValueError("placement: no MFCs given; pass {mfc_name: {mesh: ..., dp: .., tp: .., pp: ..}}")
    if not isinstance(roles, Mapping):
        raise ValueError(f"roles={roles!r}; pass {{mfc name: role/model name}}, e.g. {{'actor_gen': 'actor'}}")
    placements: dict[str, MFCPlacement] = {}
    for name, entry in mfcs.items():
        if isinstance(entry, MFCPlacement):
            if entry.mfc != name:
                raise ValueError(f"placement key {name!r} holds the placement of MFC {entry.mfc!r}; key it by its "
                                 f"own name")
            cluster.mesh(entry.mesh)  # same cluster shape
            placements[name] = entry
        else:
            placements[name] = MFCPlacement.from_dict(name, entry, cluster)
    missing = [n for n in placements if not isinstance(roles.get(n), str) or not roles.get(n, "").strip()]
    if missing:
        raise ValueError(f"placement: MFC(s) {missing} have no role; give roles={{mfc: model name}}, e.g. "
                         f"{{{missing[0]!r}: 'actor'}}")
    return PlacementPlan(cluster=cluster, placements=placements, roles={n: roles[n] for n in placements})


# ---- Ray placement groups ----------------------------------------------------------------------

def create_placement_groups(plan: PlacementPlan, cpus_per_device: float | None = None,
                            timeout_s: float = 60.0) -> dict[int, tuple[Any, int]]:
    """Reserve the plan's devices in Ray: one STRICT_PACK placement group per node of the plan.

    Returns global device id -> (placement group, bundle index); pin an actor to a device with
    `scheduling_strategy`. Checks `ray.cluster_resources()` first (ValueError), then waits up to
    `timeout_s` for every group; on timeout the groups made so far are removed and TimeoutError
    names the node, its bundles and its MFCs. Remove them with `remove_placement_groups`.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plan.check_cluster(ray.cluster_resources(), cpus_per_device, n_ray_nodes=len(_ray_nodes_in_order()))
    bundles = plan.bundles(cpus_per_device)
    devices = plan.bundle_devices()
    targets = _ray_nodes_in_order() if len(bundles) > 1 else []
    made: list[tuple[int, Any]] = []
    try:
        for i, (node, node_bundles) in enumerate(bundles.items()):
            # the plan's i-th node asks for the cluster's i-th node (head first); a soft target, so
            # the check after `ready` below is what guarantees distinct nodes
            target = targets[i] if i < len(targets) else None
            made.append((node, placement_group(node_bundles, strategy="STRICT_PACK", _soft_target_node_id=target)))
        deadline = time.monotonic() + timeout_s
        for node, pg in made:
            try:
                ray.get(pg.ready(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                mfcs = sorted({m for d in devices[node] for m in plan.device_map()[d]})
                raise TimeoutError(
                    f"placement group for node {node} ({len(bundles[node])} bundles of {bundles[node][0]}, devices "
                    f"{format_ids(devices[node])}, MFCs {mfcs}) was not placed within {timeout_s:g}s; Ray has "
                    f"{_resources_text(ray.available_resources())} free of {_resources_text(ray.cluster_resources())}"
                    f" and one node must hold the whole group; free those resources (other placement groups, "
                    f"actors), lower cpus_per_device, or shrink the meshes") from None
        if len(made) > 1:
            landed: dict[str, int] = {}
            for node, pg in made:
                ray_node = _pg_node(pg)
                if ray_node in landed:
                    raise ValueError(f"plan nodes {landed[ray_node]} and {node} were both placed on Ray node "
                                     f"{ray_node[:12]}; the plan's nodes must be different machines: start Ray with "
                                     f"as many nodes as placement.n_nodes, each with room for one node's devices")
                landed[ray_node] = node
    except BaseException:
        for _, pg in made:
            remove_placement_group(pg)
        raise
    return {d: (pg, i) for node, pg in made for i, d in enumerate(devices[node])}


def _ray_nodes_in_order() -> list[str]:
    """Alive Ray node ids, the head node first, then by id: plan node i asks for the i-th."""
    import ray
    alive = [n for n in ray.nodes() if n.get("Alive")]
    alive.sort(key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeID"]))
    return [n["NodeID"] for n in alive]


def _pg_node(pg) -> str:
    from ray.util import placement_group_table
    nodes = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
    return next(iter(nodes)) if len(nodes) == 1 else ",".join(sorted(nodes))


def placement_group_nodes(placement_groups: Mapping[int, tuple[Any, int]]) -> dict[int, str]:
    """Global device id -> the Ray node id its bundle was placed on."""
    return {d: _pg_node(pg) for d, (pg, _) in placement_groups.items()}


def _resources_text(res: Mapping[str, float]) -> str:
    keep = {k: v for k, v in res.items() if k in RAY_RESOURCES.values()}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"


def scheduling_strategy(placement_groups: Mapping[int, tuple[Any, int]], device: int):
    """A Ray scheduling strategy that runs a task or actor on `device` of `create_placement_groups`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if device not in placement_groups:
        raise ValueError(f"device {device} is not reserved by these placement groups "
                         f"(devices {format_ids(list(placement_groups))})")
    pg, index = placement_groups[device]
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def create_group_placement_groups(bundles: Mapping[str, list[dict]], timeout_s: float = 60.0) -> dict[str, Any]:
    """Outside mode mesh: one PACK placement group per reservation (`bundles`: a worker group, or groups sharing
    devices, -> one resource bundle per actor index), so its actors are reserved all at once or not at all, on as
    few nodes as fit them, and actor k runs on bundle k. A reservation asking for no resource gets none. Waits up
    to `timeout_s` for all of them; on timeout removes what it made and raises TimeoutError naming the
    reservation, its bundles and what Ray has free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    made: dict[str, Any] = {}
    try:
        for name, group_bundles in bundles.items():
            kept = [{k: v for k, v in b.items() if v} for b in group_bundles]
            if kept and all(kept):
                made[name] = placement_group(kept, strategy="PACK", name=f"mindspeed_rl-{name}-{uuid.uuid4().hex[:8]}")
        deadline = time.monotonic() + timeout_s
        for name, pg in made.items():
            try:
                ray.get(pg.ready(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"placement group of worker group(s) '{name}' ({len(bundles[name])} bundle(s) of "
                    f"{_resources_text(bundles[name][0])}) was not placed within {timeout_s:g}s; Ray has "
                    f"{_resources_text(ray.available_resources())} free of {_resources_text(ray.cluster_resources())}; "
                    "free those resources or lower placement.groups.<name>.num_*") from None
    except BaseException:
        for pg in made.values():
            remove_placement_group(pg)
        raise
    return made


def remove_placement_groups(placement_groups: Mapping[int, tuple[Any, int]]) -> None:
    """Give back the groups `create_placement_groups` made (each once)."""
    from ray.util.placement_group import remove_placement_group

    seen = set()
    for pg, _ in placement_groups.values():
        if pg.id not in seen:
            seen.add(pg.id)
            remove_placement_group(pg)
