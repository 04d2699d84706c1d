"""cpu / cuda / npu in one place: which torch device a worker uses and which collective backend.

Code above this layer asks for `resolve_device("auto")` and `dist_backend(device)` and never
imports torch_npu itself; torch_npu is imported lazily, only when an NPU is asked for.
"""
from __future__ import annotations

import torch

DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _npu_available() -> bool:
    try:
        import importlib
        importlib.import_module("torch_npu")  # registers the 'npu' device with torch
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
    if kind == "npu" and not _npu_available():
        raise ValueError("device='npu' but torch_npu is not installed or sees no NPU; "
                         "install the `npu` extra on an Ascend machine, or use device=cpu")
    return torch.device(kind)


def dist_backend(device: torch.device | str) -> str:
    """gloo on CPU, nccl on CUDA, hccl on NPU: the backend for DDP and weight broadcasts."""
    return _BACKENDS[torch.device(device).type]


def ray_resource_key(device_kind: str) -> str | None:
    """The Ray resource an actor on this device kind asks for (None: CPU only)."""
    return {"cuda": "GPU", "npu": "NPU"}.get(device_kind)
