"""Weight sync from a train engine to the engines that read the same model (rollout, inference).

Parameters travel as one flat buffer: one collective instead of one per tensor. In one process
(colocated) that is a copy; across processes (disaggregated) it is a broadcast in a process group
of its own, built from a TCPStore beside Ray and never registered as torch's default group (the
way vLLM's RLHF examples use a stateless group), so it does not collide with DDP's group.
Both sides compute a checksum of what they hold after the sync, so a test can compare them.
"""
from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """All tensors, in order, as one 1-D float32 buffer (reused when `out` is given)."""
    total = sum(t.numel() for t in tensors)
    if out is None or out.numel() != total:
        out = torch.empty(total, dtype=torch.float32)
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset:offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return out


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    need = sum(t.numel() for t in tensors)
    if flat.numel() != need:
        raise ValueError(f"weight sync: received {flat.numel()} values for parameters that hold {need}; "
                         "the rollout model's architecture differs from the trained model's")
    offset = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"weight sync: received {flat.numel()} values for parameters that hold {offset}; "
                         "the rollout model's architecture differs from the trained model's")


def checksum(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the parameters' float32 bytes: equal on both sides iff the weights are identical."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def stateless_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                    timeout_s: float = 60.0):
    """A process group of its own over a TCPStore; rank 0 hosts the store.

    Every member must call this at about the same time (the constructor rendezvous); the
    timeout bounds that wait so a missing member fails with an error instead of hanging.
    """
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=True)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo
        pg = ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL
        pg = ProcessGroupNCCL(store, rank, world_size)
    else:
        raise ValueError(f"weight sync backend={backend!r}; gloo and nccl are supported here "
                         "(hccl needs torch_npu's ProcessGroupHCCL)")
    return SyncGroup(pg=pg, store=store, rank=rank, world_size=world_size)


@dataclass
class SyncGroup:
    pg: object
    store: object  # held so the store lives as long as the group
    rank: int
    world_size: int


def broadcast_flat(group: SyncGroup, flat: torch.Tensor, src: int = 0) -> torch.Tensor:
    group.pg.broadcast(flat, src).wait()
    return flat
