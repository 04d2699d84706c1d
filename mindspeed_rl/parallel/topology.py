"""DP/TP/PP layout of the ranks of one MFC, and which of them talk to the TransferDock.

An MFC runs on ``dp * tp * pp`` ranks. Its *sub-ranks* ``0..dp*tp*pp-1`` are laid out as in
ReaLHF's ``ProcessTopology``: pipeline stage outermost, then data-parallel replica, tensor-parallel
rank innermost::

    sub_rank = pp_idx * dp * tp + dp_idx * tp + tp_idx

TP innermost puts a TP group on neighbouring devices (one host, fastest links), since TP talks at
every layer; PP, which only passes activations between stages, is outermost. `parallel_groups`
maps the layout onto the MFC's global ranks (the device ids of its mesh).

Only a few ranks touch the dock (one reader and one writer per replica; the others get the
micro-batch by broadcast); `dock_reader_ranks`, `dock_writer_ranks` and `replica_members` say
which, as pure functions of the topology. A deployment (engines/deployment.py `Deployment.roles`)
gives each rank its role from them; workers and engines read that role.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

AXES = ("pp", "dp", "tp")  # outermost first


class Coord(NamedTuple):
    """Where a sub-rank sits: pipeline stage, data-parallel replica, tensor-parallel rank."""

    pp: int
    dp: int
    tp: int


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1; use 1 to not split along {name.upper()}")


@dataclass(frozen=True)
class ProcessTopology:
    """The (pp, dp, tp) grid of one MFC's ranks; see the module doc for the layout."""

    dp: int
    tp: int
    pp: int

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            _check_size(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def _check_rank(self, sub_rank: int) -> None:
        if isinstance(sub_rank, bool) or not isinstance(sub_rank, int) or not 0 <= sub_rank < self.world_size:
            raise ValueError(f"sub_rank={sub_rank!r} is not a rank of {self} (ranks 0-{self.world_size - 1})")

    def coord(self, sub_rank: int) -> Coord:
        """``(pp, dp, tp)`` of `sub_rank`."""
        self._check_rank(sub_rank)
        pp_idx, rest = divmod(sub_rank, self.dp * self.tp)
        dp_idx, tp_idx = divmod(rest, self.tp)
        return Coord(pp_idx, dp_idx, tp_idx)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """The sub-rank at ``(pp, dp, tp)``."""
        for name, idx, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < size:
                raise ValueError(f"{name}={idx!r} is out of range for {self} ({name} index 0-{size - 1})")
        return pp * self.dp * self.tp + dp * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Sub-rank groups along `axis` ("dp", "tp" or "pp"): ranks that differ only in that
        coordinate, one group per value of the other two, in rank order."""
        if axis not in AXES:
            raise ValueError(f"axis={axis!r}; use one of {list(AXES)}")
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        outer, inner = (a for a in AXES if a != axis)
        out = []
        for i in range(sizes[outer]):
            for j in range(sizes[inner]):
                out.append([self.rank(**{outer: i, inner: j, axis: k}) for k in range(sizes[axis])])
        return out

    def __str__(self) -> str:
        return f"topology dp={self.dp} tp={self.tp} pp={self.pp}"


@dataclass(frozen=True, eq=False)
class ParallelGroups(Mapping):
    """The DP, TP and PP groups of one MFC in global ranks, and its sub-rank -> global-rank mapping.

    Reads as a dict with the keys ``"dp"``, ``"tp"``, ``"pp"`` and ``"mapping"``
    (``groups["tp"] == [[8, 9], ...]``, ``dict(groups)``, and ``==`` against a dict compare as a
    dict would); the `topology` it came from rides along as an attribute.
    """

    topology: ProcessTopology
    dp: list[list[int]]
    tp: list[list[int]]
    pp: list[list[int]]
    mapping: dict[int, int]

    _KEYS = ("dp", "tp", "pp", "mapping")

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(f"{key!r}; parallel groups have the keys {list(self._KEYS)}")
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def global_rank(self, sub_rank: int) -> int:
        return self.mapping[sub_rank]

    def sub_rank(self, global_rank: int) -> int:
        for sub, g in self.mapping.items():
            if g == global_rank:
                return sub
        raise ValueError(f"global rank {global_rank} is not one of this MFC's ranks {list(self.mapping.values())}")

    @property
    def replicas(self) -> list[list[int]]:
        """Global ranks of each DP replica (index = dp_idx): the ranks of one micro-batch broadcast,
        ready for ``torch.distributed.new_group``."""
        return [[self.mapping[r] for r in replica_members(self.topology, d)] for d in range(self.topology.dp)]


def parallel_groups(global_ranks: Sequence[int], dp: int, tp: int, pp: int) -> ParallelGroups:
    """Lay ``dp x tp x pp`` out on `global_ranks` (sub-rank i runs on ``global_ranks[i]``).

    Example (ReaLHF docs, a 2x8 cluster): ``parallel_groups(range(8, 16), dp=2, tp=2, pp=2)`` has
    TP groups ``[8,9],[10,11],[12,13],[14,15]``, DP groups ``[8,10],[9,11],[12,14],[13,15]`` and PP
    groups ``[8,12],[9,13],[10,14],[11,15]``.
    """
    topo = ProcessTopology(dp, tp, pp)
    ranks = list(global_ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ValueError(f"global ranks {bad!r} are not non-negative integers; give the MFC's device ids")
    if len(ranks) != topo.world_size:
        raise ValueError(f"dp*tp*pp = {dp}*{tp}*{pp} = {topo.world_size} but {len(ranks)} global ranks were "
                         f"given ({ranks}); choose dp, tp, pp whose product is {len(ranks)}, or give "
                         f"{topo.world_size} ranks")
    dups = sorted({r for r in ranks if ranks.count(r) > 1})
    if dups:
        raise ValueError(f"global ranks {dups} are listed more than once in {ranks}; each rank runs one "
                         f"sub-rank, list it once")

    def lift(axis: str) -> list[list[int]]:
        return [[ranks[r] for r in group] for group in topo.groups(axis)]

    return ParallelGroups(topology=topo, dp=lift("dp"), tp=lift("tp"), pp=lift("pp"),
                          mapping={i: r for i, r in enumerate(ranks)})


# ---- who talks to the dock ---------------------------------------------------------------------

def dock_reader_ranks(topology: ProcessTopology) -> list[int]:
    """For each DP replica (list index = dp_idx), the sub-rank that pulls its micro-batches from the
    dock: TP rank 0 of the first PP stage, where the input enters the model."""
    return [topology.rank(0, d, 0) for d in range(topology.dp)]


def dock_writer_ranks(topology: ProcessTopology) -> list[int]:
    """For each DP replica, the sub-rank that pushes results to the dock: TP rank 0 of the last PP
    stage, where the outputs come out (with PP=1 it is the reader)."""
    return [topology.rank(topology.pp - 1, d, 0) for d in range(topology.dp)]


def replica_members(topology: ProcessTopology, dp_idx: int) -> list[int]:
    """Sorted sub-ranks of replica `dp_idx`, reader included: every rank that gets the reader's
    broadcast. All PP stages take part because the last stage needs the loss inputs (masks,
    advantages) and every stage needs the micro-batch's shapes."""
    if isinstance(dp_idx, bool) or not isinstance(dp_idx, int) or not 0 <= dp_idx < topology.dp:
        raise ValueError(f"dp_idx={dp_idx!r} is not a replica of {topology} (replicas 0-{topology.dp - 1})")
    return sorted(topology.rank(p, dp_idx, t) for p in range(topology.pp) for t in range(topology.tp))
