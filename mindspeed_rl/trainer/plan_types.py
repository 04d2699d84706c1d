"""The plan's records: a worker group's MFCs, resources and resolved backends (GroupPlan), and the whole
plan (Plan). `plan.py` fills them; the driver, the launch and the workers read them."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..config import GroupConfig
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..engines.deployment import Deployment
from ..engines.registry import Backend
from ..parallel import PlacementPlan
from .memory import MemoryPlan

MODEL_ENGINES = ("policy", "value", "reward")   # compute.FUNCTIONS' engine kinds that run on the train backend


def model_mfc(m: MFCDef) -> bool:
    """An MFC that runs a model (compute MFCs run none, so there is nothing to split)."""
    return InterfaceType(m.interface_type) is not InterfaceType.COMPUTE


def generates(m: MFCDef) -> bool:
    return InterfaceType(m.interface_type) is InterfaceType.GENERATE


def role_names(mfcs: list[MFCDef]) -> list[str]:
    """The group's model/interface pairs, as plan.json and the printed table give them."""
    return sorted({f"{m.model_name}/{InterfaceType(m.interface_type).value}" for m in mfcs})


@dataclass
class GroupPlan:
    name: str
    mfcs: list[MFCDef]
    resources: GroupConfig                  # resources.dp: the data-parallel replicas
    devices: list[int] = field(default_factory=list)  # placement.mode=mesh: the group's devices, topology order
    tp: int = 1                             # placement.mode=mesh: the tensor- and pipeline-parallel sizes of
    pp: int = 1                             # the group's slice (its backend's deployment decides the actors)
    deployment: Deployment | None = None    # what the backends make of the slice (engines/deployment.py)
    rollout_row: Backend | None = field(default=None, repr=False)  # the registry's row whose rollout engine
                                                                   # generates here (None: none)
    train_row: Backend | None = field(default=None, repr=False)    # the row whose engines run the group's other
                                                                   # models; both resolved once by the plan
    rollout_options: dict = field(default_factory=dict)  # their options, checked by their dataclasses
    train_options: dict = field(default_factory=dict)

    @property
    def rollout_backend(self) -> str:
        return self.rollout_row.name if self.rollout_row is not None else ""

    @property
    def train_backend(self) -> str:
        return self.train_row.name if self.train_row is not None else ""

    @property
    def world(self) -> int:
        """The group's actors (ranks) as its deployment starts them."""
        return self.deployment.actors if self.deployment is not None else self.resources.dp

    def actor_devices(self, k: int) -> list[int]:
        """The mesh devices actor k holds ([] outside placement.mode=mesh)."""
        return list(self.deployment.actor_devices(k)) if self.deployment is not None else []

    def as_dict(self) -> dict:
        """The group as plan.json gives it."""
        r = self.resources
        dep = self.deployment.as_dict() if self.deployment is not None else {}
        return {"mfcs": [m.name for m in self.mfcs], "roles": role_names(self.mfcs),
                "rollout_backend": self.rollout_backend or None, "train_backend": self.train_backend or None,
                "rollout_options": self.rollout_options, "train_options": self.train_options,
                "dp": r.dp, "tp": self.tp, "pp": self.pp, "devices": list(self.devices), "device": r.device,
                "num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "num_npus": r.num_npus,
                "actors": self.world, "deployment": dep}


@dataclass
class Plan:
    graph: nx.DiGraph
    order: list[MFCDef]
    columns: list[str]
    consumers: list[str]
    dataset_keys: tuple[str, ...]
    groups: dict[str, GroupPlan]
    trained: dict[str, str]                       # model -> train MFC
    sync_targets: dict[str, list[str]]            # model -> MFCs reading it
    same_step_outputs: dict[str, list[str]]       # train MFC -> columns written by same-step readers
    model_paths: dict[str, str]
    rows_per_step: int
    notes: list[str] = field(default_factory=list)
    placement: PlacementPlan | None = None        # placement.mode=mesh: meshes, groups, devices
    size_notes: list[str] = field(default_factory=list)  # row sizes rounded to what they must divide
    ahead: tuple[str, ...] = ()                   # MFCs that may run ahead of their step's training (staleness)
    tokenizer_model: str = "actor"                # whose tokenizer the run tokenizes with (reward modeling: reward)
    memory: MemoryPlan | None = None              # bytes per device and MFC, checked against the devices (memory.py)

    def group_of(self, mfc_name: str) -> str:
        return next(g for g, p in self.groups.items() if any(m.name == mfc_name for m in p.mfcs))

    def resource_totals(self) -> dict[str, float]:
        from ..device import RAY_RESOURCES, group_resources
        tot = dict.fromkeys(RAY_RESOURCES.values(), 0.0)
        for p in self.groups.values():  # per device of the group: an engine-split actor holds tp of them
            n = p.resources.dp * p.tp * p.pp
            for res, amount in group_resources(p.resources).items():
                tot[res] += amount * n
        return tot
