"""Device meshes: which devices of the cluster one MFC runs on.

The cluster is ``n_nodes`` hosts of ``n_devices_per_node`` devices each; a device has the global id
``node * n_devices_per_node + local``. A mesh is a set of global ids with one of two shapes (the
ReaLHF rule):

* **whole hosts**: every device of each node it touches (``node0-1``, ``all``); or
* **an aligned slice of one host**: consecutive devices of a single node, whose count divides
  ``n_devices_per_node`` and whose first local id is a multiple of that count (on 8-device hosts:
  ``[0,1]``, ``[2,3]``, ``[4..7]``; not ``[1,2]``, ``[0,1,2]`` or ``[6,7,8,9]``).

Why: a slice of a host keeps all its traffic on the host's fast links (NVLink, HCCS) and never
straddles two hosts; aligned slices of one size tile a host exactly, so two meshes either share
whole slices or none, and a device is never half-used by a mesh that also reaches another host.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

_SPEC_HELP = ("write 'all', a list of global device ids such as [0, 1], a range '4-7', a list '0,1,2,3', "
              "'node1:0-3' (local devices 0-3 of node 1) or 'node0-1' (whole nodes 0 and 1)")


def format_ids(ids: Sequence[int]) -> str:
    """Compact text for sorted ids: ``[0, 1, 2, 3, 6, 7]`` -> ``'0-3,6-7'``; ``[5]`` -> ``'5'``."""
    parts: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def _parse_id_list(text: str, spec: Any) -> list[int]:
    """``'0-3,6,7'`` -> ``[0, 1, 2, 3, 6, 7]``; a ValueError naming `spec` when it is not of that shape."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", part)
        if not m:
            raise ValueError(f"mesh spec {spec!r}: cannot read {part!r} as a device id or range; {_SPEC_HELP}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"mesh spec {spec!r}: range {part!r} runs backwards; write it low-high, "
                             f"e.g. '{hi}-{lo}'")
        ids.extend(range(lo, hi + 1))
    return ids


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeviceMesh: {name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class DeviceMesh:
    """A set of devices of an ``n_nodes`` x ``n_devices_per_node`` cluster, checked against the mesh
    rules of the module doc on construction.

    device_ids: the global ids (``node * n_devices_per_node + local``), any order; kept sorted.
    """

    n_nodes: int
    n_devices_per_node: int
    device_ids: tuple[int, ...]

    def __post_init__(self):
        _check_positive("n_nodes", self.n_nodes)
        _check_positive("n_devices_per_node", self.n_devices_per_node)
        ids = self.device_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"DeviceMesh: device_ids={ids!r} must be a sequence of global device ids; "
                             f"to parse text use DeviceMesh.from_spec ({_SPEC_HELP})")
        bad = [d for d in ids if isinstance(d, bool) or not isinstance(d, int)]
        if bad:
            raise ValueError(f"DeviceMesh: device ids {bad!r} are not integers; list global device ids "
                             f"such as [0, 1, 2, 3]")
        if not ids:
            raise ValueError("DeviceMesh: the mesh has no devices; give at least one device id, or 'all'")
        total = self.n_nodes * self.n_devices_per_node
        out = sorted(d for d in ids if not 0 <= d < total)
        if out:
            raise ValueError(f"DeviceMesh: device ids {out} are outside the cluster of {self.n_nodes} node(s) x "
                             f"{self.n_devices_per_node} devices (global ids 0-{total - 1}); use ids in that "
                             f"range, or describe a bigger cluster")
        dups = sorted({d for d in ids if list(ids).count(d) > 1})
        if dups:
            raise ValueError(f"DeviceMesh: device ids {dups} are listed more than once; list each device once")
        object.__setattr__(self, "device_ids", tuple(sorted(ids)))
        self._check_shape()

    def _check_shape(self) -> None:
        per = self.n_devices_per_node
        ids = self.device_ids
        nodes = self.nodes
        if all(self.local_devices(n) == list(range(per)) for n in nodes):
            return  # whole hosts
        if len(nodes) > 1:
            raise ValueError(
                f"DeviceMesh: devices {format_ids(ids)} cross hosts (they touch nodes {format_ids(nodes)} "
                f"without covering them whole, {per} devices per node); a mesh that spans hosts must take "
                f"whole hosts (e.g. 'node{nodes[0]}-{nodes[-1]}'), otherwise keep it "
                f"inside one host")
        node = nodes[0]
        local = self.local_devices(node)
        size = len(local)
        where = f"DeviceMesh: devices {format_ids(ids)} (node {node}, local devices {format_ids(local)})"
        if local != list(range(local[0], local[0] + size)):
            raise ValueError(f"{where} are not consecutive; a part of one host must be a consecutive run of "
                             f"its devices, e.g. node{node}:{local[0]}-{local[0] + size - 1}")
        if per % size:
            sizes = ", ".join(str(s) for s in range(1, per + 1) if per % s == 0)
            raise ValueError(f"{where}: size {size} does not divide the {per} devices of a host, so such "
                             f"meshes cannot tile a host; use a size that divides {per} ({sizes})")
        if local[0] % size:
            lo = local[0] - local[0] % size
            raise ValueError(f"{where} start at local device {local[0]}, which is not a multiple of the mesh "
                             f"size {size}; a part of a host must be aligned to its size so meshes of that "
                             f"size tile the host without overlap: use node{node}:{lo}-{lo + size - 1} or "
                             f"node{node}:{lo + size}-{lo + 2 * size - 1}")

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def whole(cls, n_nodes: int, n_devices_per_node: int) -> "DeviceMesh":
        """Every device of the cluster."""
        _check_positive("n_nodes", n_nodes)
        _check_positive("n_devices_per_node", n_devices_per_node)
        return cls(n_nodes, n_devices_per_node, tuple(range(n_nodes * n_devices_per_node)))

    @classmethod
    def from_spec(cls, spec: Any, n_nodes: int, n_devices_per_node: int) -> "DeviceMesh":
        """Build a mesh from a config value (see `_SPEC_HELP` for the accepted shapes).

        ``"all"``; a list of global ids ``[0, 1]`` or one id ``3``; text ``"4-7"``, ``"0,1,2,3"``,
        ``"0-3,8-11"``; ReaLHF-style ``"node1:0-3"`` (local devices 0-3 of node 1), ``"node1"`` or
        ``"node0-1"`` (whole nodes). A `DeviceMesh` of the same cluster passes through.
        """
        if isinstance(spec, DeviceMesh):
            if (spec.n_nodes, spec.n_devices_per_node) != (n_nodes, n_devices_per_node):
                raise ValueError(f"mesh {spec} belongs to a {spec.n_nodes}x{spec.n_devices_per_node} cluster, not "
                                 f"{n_nodes}x{n_devices_per_node}; build it for this cluster")
            return spec
        if isinstance(spec, bool):
            raise ValueError(f"mesh spec {spec!r} is a boolean; {_SPEC_HELP}")
        if isinstance(spec, int):
            return cls(n_nodes, n_devices_per_node, (spec,))
        if isinstance(spec, (list, tuple)):
            return cls(n_nodes, n_devices_per_node, tuple(spec))
        if not isinstance(spec, str):
            raise ValueError(f"mesh spec {spec!r} has type {type(spec).__name__}; {_SPEC_HELP}")
        text = spec.strip()
        if text.lower() == "all":
            return cls.whole(n_nodes, n_devices_per_node)
        m = re.fullmatch(r"node\s*(\d+)\s*(?:-\s*(\d+))?\s*(?::\s*(.+))?", text, flags=re.IGNORECASE)
        if m:
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) is not None else first
            if last < first:
                raise ValueError(f"mesh spec {spec!r}: node range runs backwards; write node{last}-{first}")
            if not last < n_nodes:
                raise ValueError(f"mesh spec {spec!r}: node {last} is outside the cluster of {n_nodes} node(s) "
                                 f"(nodes 0-{n_nodes - 1}); use a node in that range, or describe a bigger cluster")
            if m.group(3) is None:
                ids = [n * n_devices_per_node + d for n in range(first, last + 1) for d in range(n_devices_per_node)]
                return cls(n_nodes, n_devices_per_node, tuple(ids))
            if last != first:
                raise ValueError(f"mesh spec {spec!r}: local devices can follow one node only (node1:0-3); for "
                                 f"several nodes take them whole (node{first}-{last})")
            local = _parse_id_list(m.group(3), spec)
            out = [d for d in local if d >= n_devices_per_node]
            if out:
                raise ValueError(f"mesh spec {spec!r}: local devices {out} do not exist on a host of "
                                 f"{n_devices_per_node} devices (local ids 0-{n_devices_per_node - 1})")
            return cls(n_nodes, n_devices_per_node, tuple(first * n_devices_per_node + d for d in local))
        if not text:
            raise ValueError(f"mesh spec {spec!r} is empty; {_SPEC_HELP}")
        return cls(n_nodes, n_devices_per_node, tuple(_parse_id_list(text, spec)))

    # ---- views --------------------------------------------------------------------------------
    @property
    def devices(self) -> list[int]:
        """Global device ids, sorted."""
        return list(self.device_ids)

    @property
    def size(self) -> int:
        return len(self.device_ids)

    @property
    def nodes(self) -> list[int]:
        """The nodes this mesh touches, sorted."""
        return sorted({d // self.n_devices_per_node for d in self.device_ids})

    @property
    def whole_hosts(self) -> bool:
        """True when the mesh covers every device of each node it touches."""
        return self.size == len(self.nodes) * self.n_devices_per_node

    def local_devices(self, node: int) -> list[int]:
        """Local ids (0..n_devices_per_node-1) of this mesh's devices on `node`."""
        per = self.n_devices_per_node
        return [d - node * per for d in self.device_ids if d // per == node]

    def overlaps(self, other: "DeviceMesh") -> bool:
        """True when the two meshes share a device (they are of the same cluster)."""
        if (other.n_nodes, other.n_devices_per_node) != (self.n_nodes, self.n_devices_per_node):
            raise ValueError(f"cannot compare mesh {self} of a {self.n_nodes}x{self.n_devices_per_node} cluster "
                             f"with mesh {other} of a {other.n_nodes}x{other.n_devices_per_node} cluster; build "
                             f"both for the same cluster")
        return not set(self.device_ids).isdisjoint(other.device_ids)

    def __contains__(self, device: object) -> bool:
        return device in self.device_ids

    @property
    def spec(self) -> str:
        """The ReaLHF-style text of this mesh, which `from_spec` reads back: ``'node0-1'``,
        ``'node1:0-3'``; ``'all'`` for the whole cluster."""
        nodes = self.nodes
        if self.whole_hosts:
            if len(nodes) == self.n_nodes:
                return "all"
            if nodes == list(range(nodes[0], nodes[-1] + 1)):
                return f"node{nodes[0]}" if len(nodes) == 1 else f"node{nodes[0]}-{nodes[-1]}"
            return format_ids(self.device_ids)  # whole hosts with a gap: only global ids say it
        return f"node{nodes[0]}:{format_ids(self.local_devices(nodes[0]))}"

    def __str__(self) -> str:
        return f"{self.spec} (devices {format_ids(self.device_ids)})"
