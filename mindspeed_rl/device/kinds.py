"""Every spelling of a device kind, in one table; pure Python (no torch), so the config can import it.

A row per kind: placement's `device_kind` (cpu / gpu / npu), torch's device type (cpu / cuda / npu),
Ray's resource (CPU / GPU / NPU), the GroupConfig field of a worker's share (num_cpus / num_gpus /
num_npus), Ray's own `.options()` keyword for it, the collective backend, and the variable Ray sets to
the accelerators it gave an actor. Code above this layer looks spellings up here instead of writing its
own map; `mindspeed_rl.device` re-exports all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device in every spelling the layers above need."""
    name: str                # placement.device_kind
    torch_type: str          # torch.device(...).type, and a worker group's `device`
    ray_resource: str        # Ray's resource name
    group_field: str         # the GroupConfig field holding a worker's share of it
    ray_keyword: str | None  # Ray's own .options() keyword for it; None: a custom resource (`resources`)
    dist_backend: str        # DDP, FSDP and weight broadcasts
    visible_env: str | None  # the variable Ray sets to the accelerators it gave an actor
    memory_gb: float | None = None  # one device's memory for the memory plan when placement.device_memory_gb
                                    # is null (GB, 1e9 bytes); None: the plan is not checked (the CPU)


DEVICE_TABLE = (
    DeviceKind("cpu", "cpu", "CPU", "num_cpus", "num_cpus", "gloo", None),
    DeviceKind("gpu", "cuda", "GPU", "num_gpus", "num_gpus", "nccl", "CUDA_VISIBLE_DEVICES", 80.0),  # H100
    DeviceKind("npu", "npu", "NPU", "num_npus", None, "hccl", "ASCEND_RT_VISIBLE_DEVICES", 64.0),   # Ascend 910B
)
# other devices' memory, for placement.device_memory_gb (GB)
KNOWN_DEVICE_MEMORY_GB = {"H100": 80.0, "H200": 141.0, "A100-80GB": 80.0, "A100-40GB": 40.0, "910B": 64.0}
DEVICE_KINDS = tuple(k.name for k in DEVICE_TABLE)                 # placement.device_kind: cpu, gpu, npu
TORCH_DEVICE_TYPES = tuple(k.torch_type for k in DEVICE_TABLE)     # cpu, cuda, npu
WORKER_DEVICES = (*TORCH_DEVICE_TYPES, "auto")                     # placement.groups.<name>.device
RAY_RESOURCES = {k.group_field: k.ray_resource for k in DEVICE_TABLE}  # GroupConfig field -> Ray resource
VISIBLE_DEVICES_ENV = {k.torch_type: k.visible_env for k in DEVICE_TABLE if k.visible_env}
ACCELERATOR_TYPES = tuple(k.torch_type for k in DEVICE_TABLE if k.name != "cpu")  # cuda, npu
# the keys of Ray's .options() that ask for accelerators: num_gpus (Ray's keyword), resources (NPU)
ACCELERATOR_OPTION_KEYS = tuple(dict.fromkeys(k.ray_keyword or "resources" for k in DEVICE_TABLE if k.name != "cpu"))
# every accepted spelling, placement's ("gpu") and torch's ("cuda") alike
_BY_SPELLING = {**{k.name: k for k in DEVICE_TABLE}, **{k.torch_type: k for k in DEVICE_TABLE}}


def device_spec(kind: str) -> DeviceKind:
    """The table row of a device kind in either spelling ("gpu" or "cuda"; any case)."""
    row = _BY_SPELLING.get(str(kind).strip().lower())
    if row is None:
        raise ValueError(f"device kind {kind!r}; use one of {sorted(_BY_SPELLING)}")
    return row


def device_memory_gb(kind: str, configured: float | None = None) -> float | None:
    """The memory of one device of `kind` the memory plan checks against: `configured`
    (placement.device_memory_gb) when given, else the kind's default (gpu 80, an H100; npu 64, a 910B);
    None for the CPU, whose plan is not checked unless a figure is configured."""
    if configured is not None:
        return float(configured)
    return device_spec(kind).memory_gb


def torch_device_type(kind: str) -> str:
    """torch's device type of a device kind: "cpu", "cuda" (for "gpu") or "npu"."""
    return device_spec(kind).torch_type


def ray_resource(kind: str) -> str:
    """Ray's resource name of a device kind: "CPU", "GPU" (gpu/cuda) or "NPU"."""
    return device_spec(kind).ray_resource


def group_field(kind: str) -> str:
    """The GroupConfig field that holds a worker's share of this device kind: num_cpus, num_gpus, num_npus."""
    return device_spec(kind).group_field


def group_resources(group: Any) -> dict[str, float]:
    """What one actor of a worker group (anything with GroupConfig's num_* fields) asks Ray for, by Ray
    resource name: {"CPU": num_cpus, "GPU": num_gpus, "NPU": num_npus}."""
    return {resource: getattr(group, field) for field, resource in RAY_RESOURCES.items()}


def accelerator_share(group: Any) -> float:
    """The share of an accelerator one actor of a worker group holds (its num_gpus, else its num_npus); 0
    for a CPU-only group."""
    return next((getattr(group, k.group_field) for k in DEVICE_TABLE
                 if k.name != "cpu" and getattr(group, k.group_field)), 0.0)


def group_actor_options(group: Any) -> dict:
    """Ray `.options(...)` resources of one actor of a worker group: num_cpus always, and each accelerator it
    holds a share of (num_gpus, Ray's keyword; NPU as a custom resource), as `ray_actor_options` spells it."""
    opts: dict = {"num_cpus": group.num_cpus}
    for row in DEVICE_TABLE:
        if row.name != "cpu":
            for key, value in ray_actor_options(row.name, getattr(group, row.group_field)).items():
                if key == "resources":
                    opts.setdefault("resources", {}).update(value)
                else:
                    opts[key] = value
    return opts


def ray_resource_key(device_kind: str) -> str | None:
    """The Ray resource an actor on this device kind asks for besides CPUs: "GPU" (cuda/gpu), "NPU" (npu),
    None (cpu)."""
    row = device_spec(device_kind)
    return None if row.name == "cpu" else row.ray_resource


def ray_actor_options(device_kind: str, per_actor: float) -> dict:
    """Ray `.options(...)` for an actor holding `per_actor` devices: num_gpus for GPUs (Ray's own
    keyword), a custom-resource entry for NPUs (Ray has no num_npus keyword), nothing on the CPU."""
    key = ray_resource_key(device_kind)
    if key is None or not per_actor:
        return {}
    keyword = device_spec(device_kind).ray_keyword
    return {keyword: per_actor} if keyword else {"resources": {key: per_actor}}
