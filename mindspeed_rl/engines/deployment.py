"""How a backend spreads one worker group's models over Ray actors: its deployment.

A worker group gets a slice of the placement (dp, tp, pp, its devices). Which actors that slice
becomes, which process groups they form and which rank of a replica reads the dock and which
writes the results is the backend's decision, declared here once and read by the plan (what it
prints and writes to plan.json), the driver (what it starts) and the worker (what each rank does).
Nothing outside `engines/` interprets a backend flag.

Three shapes cover the built-ins, as verl's and MindSpeed-RL's workers do:
- `data_parallel`: one actor per DP replica, each a one-rank replica that reads and writes its own
  rows (torch DDP, FSDP, hf, simulate). With tp or pp > 1 a backend of this shape names the backend
  that splits for it (`Backend.split_backend`: torch and fsdp -> mesh, hf -> mesh).
- `mesh`: one actor per device, dp * tp * pp ranks on torch's default group; per replica the first
  stage's TP rank 0 reads the dock and the last stage's TP rank 0 writes (mesh, megatron).
- `engine`: one actor per DP replica whose engine starts its own tensor-parallel ranks (vLLM's
  tensor_parallel_size); to the trainer a data-parallel group.
`simulate` is `data_parallel` with no model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    """What one actor of a deployment does with the dock (before its engine is built; the engine's
    own `is_dock_reader` / `is_dock_writer` say the same at run time)."""
    rank: int
    replica: int                        # its DP replica
    reads: bool                         # pulls micro-batches from the dock
    writes: bool                        # pushes the replica's outputs
    devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Deployment:
    """What a backend makes of a slice: the actors to start and what each does."""
    backend: str                        # the backend whose engines run (may be the split backend)
    shape: str                          # DATA_PARALLEL, MESH or ENGINE
    dp: int
    tp: int = 1
    pp: int = 1
    devices: tuple[int, ...] = ()
    default_group: bool = False         # its actors share torch's default process group (DDP, FSDP, meshes)

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
        """Per actor: its replica and whether it reads the dock and writes results (MindSpeed-RL's rule on
        a mesh: rank (pp 0, tp 0) of a replica reads, (last pp, tp 0) writes; ranks are (pp, dp, tp)-major
        as parallel/topology.py orders them)."""
        out = []
        for k in range(self.actors):
            if self.shape != MESH:
                out.append(RankRole(k, k, True, True, self.actor_devices(k)))
                continue
            pp_rank, rest = divmod(k, self.dp * self.tp)
            replica, tp_rank = divmod(rest, self.tp)
            out.append(RankRole(k, replica, pp_rank == 0 and tp_rank == 0,
                                pp_rank == self.pp - 1 and tp_rank == 0, self.actor_devices(k)))
        return out

    def as_dict(self) -> dict:
        return {"backend": self.backend, "shape": self.shape, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "actors": self.actors, "engine_tp": self.engine_tp, "devices": list(self.devices),
                "default_group": self.default_group,
                "ranks": [{"rank": r.rank, "replica": r.replica, "reads": r.reads, "writes": r.writes,
                           "devices": list(r.devices)} for r in self.roles()]}


@dataclass
class DeployError(ValueError):
    """A backend cannot deploy a slice; the message says why and what to use instead."""
    message: str
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        return self.message
