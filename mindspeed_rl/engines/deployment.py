"""How a backend spreads one worker group's models over Ray actors: its deployment.

A worker group gets a slice of the placement (dp, tp, pp, its devices). Which actors that slice
becomes, which process groups they form and which rank of a replica reads the dock and which
writes the results is the backend's decision, declared here once (`Deployment.roles`) and read by
the plan (what it prints and writes to plan.json), the driver (what it starts), the worker (what
each rank's stage loop does) and the engines (given their rank's `RankRole` in their spec: they
build the replica's process group from it and never work out roles themselves).
Nothing outside `engines/` interprets a backend flag.

Three shapes cover the built-ins, as verl's and MindSpeed-RL's workers do:
- `data_parallel`: one actor per DP replica, each a one-rank replica that reads and writes its own
  rows (torch DDP, FSDP, hf, simulate). With tp or pp > 1 a backend of this shape names the backend
  that splits for it (`Backend.split_backend`: torch and fsdp -> mesh, hf -> mesh).
- `mesh`: one actor per device, dp * tp * pp ranks on torch's default group; per replica the first
  stage's TP rank 0 reads the dock and the last stage's TP rank 0 writes (mesh, megatron).
- `engine`: one actor per DP replica whose engine starts its own tensor-parallel ranks (vLLM's
  tensor_parallel_size); to the trainer a data-parallel group.
`simulate` is `data_parallel` with no model and no process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.topology import ProcessTopology, dock_reader_ranks, dock_writer_ranks, replica_members

DATA_PARALLEL, MESH, ENGINE = "data_parallel", "mesh", "engine"
SHAPES = (DATA_PARALLEL, MESH, ENGINE)


@dataclass(frozen=True)
class Slice:
    """A worker group's share of the placement: what the backend deploys over."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    devices: tuple[int, ...] = ()      # placement.mode=mesh: the group's devices in topology order

    @property
    def split(self) -> bool:
        return self.tp * self.pp > 1


@dataclass(frozen=True)
class RankRole:
    """What one actor of a deployment does with the dock and within its replica (the ranks holding one copy of
    the model). The worker's stage loop and the engines receive it and compute none of it: the reader pulls
    micro-batches and broadcasts them to its replica, the writer pushes the replica's outputs. Ranks are the
    actors' ranks in the worker group (torch's default group where the deployment has one)."""
    rank: int
    replica: int                        # its DP replica
    reads: bool                         # pulls micro-batches from the dock
    writes: bool                        # pushes the replica's outputs
    devices: tuple[int, ...] = ()
    reader: int = 0                     # the replica's reader: the source of its broadcasts
    writer: int = 0                     # the replica's writer
    replica_ranks: tuple[int, ...] = (0,)  # the ranks of its replica, sorted
    replicas: tuple[tuple[int, ...], ...] = ((0,),)  # every replica's ranks, in DP order (process groups are
                                        # made by every rank for every replica, in this order)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def split(self) -> bool:
        """Is its replica several ranks (a model split by tp or pp over the actors)?"""
        return len(self.replica_ranks) > 1


@dataclass(frozen=True)
class Deployment:
    """What a backend makes of a slice: the actors to start and what each does."""
    backend: str                        # the backend whose engines run (may be the split backend)
    shape: str                          # DATA_PARALLEL, MESH or ENGINE
    dp: int
    tp: int = 1
    pp: int = 1
    devices: tuple[int, ...] = ()
    joins_default_process_group: bool = False  # its actors share torch's default process group (DDP, FSDP, meshes)

    @classmethod
    def refused(cls, slice_: Slice) -> "Deployment":
        """What a dry run plans for a slice its backend refuses (no backend: "-"), so the plan still prints it."""
        return cls(backend="-", shape=MESH if slice_.split else DATA_PARALLEL, dp=slice_.dp, tp=slice_.tp,
                   pp=slice_.pp, devices=tuple(slice_.devices))

    @property
    def over_actors(self) -> bool:
        """Is a replica's model split over several actors (a mesh), so the group's MFCs take turns on its ranks?"""
        return self.shape == MESH

    @property
    def actors(self) -> int:
        """Ray actors to start: one per device of a mesh, one per replica otherwise."""
        return self.dp * self.tp * self.pp if self.shape == MESH else self.dp

    @property
    def actor_tp(self) -> int:
        """Tensor-parallel ranks over the actors (mesh); 1 where the engine starts its own ranks."""
        return self.tp if self.shape == MESH else 1

    @property
    def actor_pp(self) -> int:
        return self.pp if self.shape == MESH else 1

    @property
    def engine_tp(self) -> int:
        """Tensor-parallel ranks one actor's engine starts itself (vLLM's tensor_parallel_size)."""
        return self.tp if self.shape == ENGINE else 1

    def actor_devices(self, k: int) -> tuple[int, ...]:
        """The devices actor k holds: its own device on a mesh, its replica's tp devices for an engine
        split, () outside placement.mode=mesh."""
        if not self.devices:
            return ()
        n = len(self.devices) // self.actors
        return tuple(self.devices[k * n:(k + 1) * n])

    def roles(self) -> list[RankRole]:
        """Per actor: its replica, whether it reads the dock and writes results, and its replica's reader and
        writer. A one-rank replica reads and writes its own rows; on a mesh the ranks are (pp, dp, tp)-major
        and the readers and writers are `parallel.topology`'s (MindSpeed-RL's rule: rank (pp 0, tp 0) of a
        replica reads, (last pp, tp 0) writes)."""
        if self.shape != MESH:
            replicas = tuple((k,) for k in range(self.actors))
            return [RankRole(k, k, True, True, self.actor_devices(k), reader=k, writer=k, replica_ranks=(k,),
                             replicas=replicas) for k in range(self.actors)]
        topo = ProcessTopology(self.dp, self.tp, self.pp)
        readers, writers = dock_reader_ranks(topo), dock_writer_ranks(topo)
        replicas = tuple(tuple(replica_members(topo, d)) for d in range(self.dp))
        out = []
        for k in range(self.actors):
            d = topo.coord(k).dp
            out.append(RankRole(k, d, k == readers[d], k == writers[d], self.actor_devices(k), reader=readers[d],
                                writer=writers[d], replica_ranks=replicas[d], replicas=replicas))
        return out

    def as_dict(self) -> dict:
        return {"backend": self.backend, "shape": self.shape, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "actors": self.actors, "engine_tp": self.engine_tp, "devices": list(self.devices),
                "joins_default_process_group": self.joins_default_process_group,
                "ranks": [{"rank": r.rank, "replica": r.replica, "reads": r.reads, "writes": r.writes,
                           "devices": list(r.devices)} for r in self.roles()]}


@dataclass
class DeployError(ValueError):
    """A backend cannot deploy a slice; the message says why and what to use instead."""
    message: str
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        return self.message
