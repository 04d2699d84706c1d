"""cpu / cuda / npu in one place: which torch device a worker uses, which collective backend, which
Ray resource.

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

import torch

DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
# Ray's resource per device kind (placement.device_kind says "gpu" where torch says "cuda")
_RAY_RESOURCES = {"cpu": None, "cuda": "GPU", "gpu": "GPU", "npu": "NPU"}
# the variable Ray sets to the accelerators it gave an actor
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
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
    try:
        require_torch_npu()
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def resolve_device(kind: str = "auto") -> torch.device:
    """The device a worker computes on; `auto` prefers cuda, then npu, then cpu."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device={kind!r}; it must be one of {DEVICE_KINDS}")
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
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0].strip().lower()
    if kind not in _BACKENDS:
        raise ValueError(f"device {device!r}: type {kind!r} is not one of {sorted(_BACKENDS)}")
    return kind


def dist_backend(device: torch.device | str) -> str:
    """gloo on CPU, nccl on CUDA, hccl on NPU: the backend for DDP and weight broadcasts."""
    return _BACKENDS[device_type(device)]


def set_device(device: torch.device | str) -> None:
    """Make `device` the current one of its kind (what NCCL/HCCL and megatron's
    `torch.<kind>.current_device()` use); nothing on the CPU."""
    kind = device_type(device)
    if kind == "cpu":
        return
    if kind == "npu":
        require_torch_npu()
        torch.npu.set_device(torch.device(device))
    else:
        torch.cuda.set_device(torch.device(device))


def ray_resource_key(device_kind: str) -> str | None:
    """The Ray resource an actor on this device kind asks for: "GPU" (cuda/gpu), "NPU" (npu), None (cpu)."""
    kind = str(device_kind).strip().lower()
    if kind not in _RAY_RESOURCES:
        raise ValueError(f"device kind {device_kind!r}; use one of {sorted(_RAY_RESOURCES)}")
    return _RAY_RESOURCES[kind]


def ray_actor_options(device_kind: str, per_actor: float) -> dict:
    """Ray `.options(...)` for an actor holding `per_actor` devices: num_gpus for GPUs (Ray's own
    keyword), a custom-resource entry for NPUs (Ray has no num_npus keyword), nothing on the CPU."""
    key = ray_resource_key(device_kind)
    if key is None or not per_actor:
        return {}
    return {"num_gpus": per_actor} if key == "GPU" else {"resources": {key: per_actor}}
