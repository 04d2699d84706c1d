"""cpu / cuda / npu in one place: which torch device a worker uses, which collective backend, which
Ray resource.

Every spelling of a device kind is in one table, `DEVICE_TABLE` (kinds.py): placement's `device_kind`
(cpu / gpu / npu), torch's device type (cpu / cuda / npu), Ray's resource (CPU / GPU / NPU), the
GroupConfig field of a worker's share (num_cpus / num_gpus / num_npus), the collective backend and the
variable Ray sets to the accelerators it gave an actor. Code above this layer looks spellings up here
(`torch_device_type(kind)`, `ray_resource(kind)`, `group_field(kind)`, `group_resources(group)`,
`group_actor_options(group)`, `RAY_RESOURCES`) instead of writing its own map. torch is imported inside
the functions that use it, so importing this package (the config does, to check device names) imports
no torch.

Code above this layer asks for `resolve_device("auto")`, `dist_backend(device)`, `set_device(device)`
and `ray_resource_key(kind)` and never imports torch_npu itself; torch_npu is imported lazily, only
when an NPU is asked for (`require_torch_npu`), because importing it is what registers the 'npu'
device type with torch: before that, even `torch.device("npu")` is an error.

Ascend NPU end to end: `device: npu` resolves through torch_npu; DDP, FSDP and weight broadcasts use
`hccl`; Ray actors and placement bundles ask for Ray's built-in `NPU` resource (Ray's
NPUAcceleratorManager then sets ASCEND_RT_VISIBLE_DEVICES for the actor, as it sets
CUDA_VISIBLE_DEVICES for `GPU`). Rollout on NPU is vLLM with the vllm-ascend platform plugin: the same
`vllm.LLM` API, device "npu" (docs/engines.md).
"""
from __future__ import annotations

import importlib

from .kinds import (ACCELERATOR_OPTION_KEYS, ACCELERATOR_TYPES, DEVICE_KINDS, DEVICE_TABLE, RAY_RESOURCES,
                    TORCH_DEVICE_TYPES, VISIBLE_DEVICES_ENV, WORKER_DEVICES, DeviceKind, accelerator_share,
                    device_spec, group_actor_options, group_field, group_resources, ray_actor_options, ray_resource,
                    ray_resource_key, torch_device_type)

__all__ = ["ACCELERATOR_OPTION_KEYS", "ACCELERATOR_TYPES", "DEVICE_KINDS", "DEVICE_TABLE", "RAY_RESOURCES",
           "TORCH_DEVICE_TYPES", "TORCH_NPU_INSTALL", "VISIBLE_DEVICES_ENV", "WORKER_DEVICES", "DeviceKind",
           "accelerator_share", "device_spec", "device_type", "dist_backend", "empty_cache", "group_actor_options",
           "group_field", "group_resources", "host_empty", "is_accelerator", "ray_actor_options", "ray_resource",
           "ray_resource_key", "require_torch_npu", "resolve_device", "set_device", "synchronize",
           "torch_device_type"]

TORCH_NPU_INSTALL = ("install torch_npu (Ascend Extension for PyTorch) matching your torch and CANN on an "
                     "Ascend machine: pip install torch-npu, or the project's `npu` extra")


def require_torch_npu():
    """Import torch_npu (registering the 'npu' device and `torch.npu`), or say how to get it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise ImportError(f"device 'npu' needs torch_npu, which does not import here ({e}); "
                          f"{TORCH_NPU_INSTALL}") from e


def _npu_available() -> bool:
    import torch
    try:
        require_torch_npu()
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def resolve_device(kind: str = "auto") -> torch.device:
    """The device a worker computes on; `auto` prefers cuda, then npu, then cpu."""
    import torch
    if kind not in WORKER_DEVICES:
        raise ValueError(f"device={kind!r}; it must be one of {WORKER_DEVICES}")
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available():
            return torch.device("npu", torch.npu.current_device())
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device=cpu or auto")
    if kind == "npu":
        try:
            require_torch_npu()
        except ImportError as e:
            raise ValueError(f"device='npu' but torch_npu is not installed: {e}; or use device=cpu") from None
        if not _npu_available():
            raise ValueError("device='npu' but torch_npu sees no NPU (check npu-smi info and "
                             "ASCEND_RT_VISIBLE_DEVICES); use device=cpu or auto")
    return torch.device(kind)


def device_type(device: torch.device | str) -> str:
    """'cpu', 'cuda' or 'npu' of a device or device string ("npu:3" works without torch_npu)."""
    import torch
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0].strip().lower()
    if kind not in TORCH_DEVICE_TYPES:
        raise ValueError(f"device {device!r}: type {kind!r} is not one of {sorted(TORCH_DEVICE_TYPES)}")
    return kind


def dist_backend(device: torch.device | str) -> str:
    """gloo on CPU, nccl on CUDA, hccl on NPU: the backend for DDP and weight broadcasts."""
    return device_spec(device_type(device)).dist_backend


def set_device(device: torch.device | str) -> None:
    """Make `device` the current one of its kind (what NCCL/HCCL and megatron's
    `torch.<kind>.current_device()` use); nothing on the CPU."""
    import torch
    kind = device_type(device)
    if kind == "cpu":
        return
    if kind == "npu":
        require_torch_npu()
        torch.npu.set_device(torch.device(device))
    else:
        torch.cuda.set_device(torch.device(device))


def is_accelerator(device: torch.device | str) -> bool:
    """Is `device` a cuda or npu device (memory of its own, apart from the host's)?"""
    return device_type(device) != "cpu"


def _accelerator_module(device: torch.device | str):
    """torch.cuda or torch.npu for an accelerator device; None on the CPU."""
    import torch
    kind = device_type(device)
    if kind == "cpu":
        return None
    if kind == "npu":
        require_torch_npu()
    return getattr(torch, kind)


def empty_cache(device: torch.device | str) -> None:
    """Give the caching allocator's free blocks back to the driver, so another process sharing the
    device (a colocated vLLM waking from sleep) can take them; nothing on the CPU."""
    from .capture import capture_lock
    mod = _accelerator_module(device)
    if mod is not None and mod.is_initialized():
        with capture_lock():   # never beside a CUDA graph capture of this process (capture.py)
            mod.empty_cache()


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (non-blocking copies included); nothing on the CPU."""
    from .capture import capture_lock
    mod = _accelerator_module(device)
    if mod is not None and mod.is_initialized():
        with capture_lock():   # a device-wide wait would wait on another thread's capturing stream (capture.py)
            mod.synchronize()


def host_empty(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A host byte buffer that holds what `device` offloads: page-locked (pinned) where `device` is an
    accelerator, so copies to and from it run asynchronously at full bus speed; plain memory where the
    device is the CPU (pinning needs an accelerator runtime: torch without one refuses it)."""
    import torch
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=is_accelerator(device))
