"""Offload between MFCs: where a train engine's parameters and optimizer state wait between the stages
that use them.

On a device shared by several MFCs (the actor's train stage, its log-prob pass, the reference's pass,
a colocated rollout) a trained engine would hold its parameters, gradients and AdamW moments on the
device all the time, though each is needed only while its own stages run. With
`actor_config.offload` / `critic_config.offload` ({params, optimizer}) and `ref_config.offload`
(params) the engine's `Offloader` moves them to host memory when no stage needs them and back before
one does (verl's `offload_fsdp_model_to_cpu` / `offload_fsdp_optimizer`, ReaLHF's parameter
reallocation to the CPU):

- a forward stage (log-probs, values) holds the parameters on the device, not the optimizer state;
- the train stage holds both; the last holder's exit offloads what the config names, so after the
  optimizer step of a step's last mini-batch the actor's state waits on the host;
- a weight export (sync) and a checkpoint hold what they read (the export gathers and sends device
  tensors: an FSDP gather over NCCL and a CUDA IPC handle need device memory, so the parameters come
  back for it and leave again after).

Holders are counted (`holding`): colocated stages run in threads of one worker, and the state goes
back to the host only when the last of them is done. Every transition is logged (`Move`: which part,
where to, for whom, bytes, seconds) and `where` says where each part is now: tests check the order
on the CPU, where the device is the host and a move copies nothing (the log says 0 bytes).

How a part moves:
- parameters of a plain module (the torch backend, the fsdp backend on one rank): storage by storage,
  whole, into a host buffer kept for the next time (page-locked where the device is an accelerator).
  Parameters that are views of one buffer (`base.flatten_parameters`) stay views of one buffer at the
  same offsets, so weight sync still sends a bucket as one broadcast. Gradients that exist move too.
  The Parameter objects stay (the optimizer, DDP and autograd keep working).
- parameters of an FSDP2 module (a mesh): `module.to(device)`; FSDP2's `_apply` reshards first and
  re-points its sharded parameters at the moved local shards (`reset_sharded_param`). Host copies
  are plain memory there (what `.to("cpu")` gives).
- AdamW's state: each tensor of `optimizer.state` to a host copy kept per (parameter, key), and back;
  a DTensor moves by `.to()`.
A part on an accelerator that moved is followed by a synchronize and `empty_cache`, so the freed
memory is free for the next user of the device, in this process or another.

FSDP2's own `CPUOffloadPolicy` (`fsdp_cpu_offload`) is another thing: the sharded parameters, their
gradients and the optimizer step live on the host for good and each layer is copied to the device for
its forward and backward (engines/train/fsdp_train.py passes it to `fully_shard`); nothing is left to move
between stages, so such an engine has no `Offloader`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import torch

from ...device import empty_cache, host_empty, is_accelerator, synchronize

ON_DEVICE, OFFLOADED = "on_device", "offloaded"
PARAMS, OPTIMIZER = "params", "optimizer"


def is_fsdp(model) -> bool:
    """Whether `model` is sharded by FSDP2 (its parameters are DTensors: moving one moves the local shard)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


@dataclass(frozen=True)
class OffloadOptions:
    """`TrainSpec.offload` (config.schema.OffloadConfig's fields), checked for a backend."""
    params: bool = False
    optimizer: bool = False
    fsdp_cpu_offload: bool = False

    @classmethod
    def of(cls, spec: dict | None, backend: str) -> "OffloadOptions":
        known = {f.name for f in fields(cls)}
        given = dict(spec or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"offload: unknown key(s) {unknown}; known: {sorted(known)}")
        for key, value in given.items():
            if not isinstance(value, bool):
                raise ValueError(f"offload.{key}={value!r}: true or false")
        out = cls(**given)
        if out.fsdp_cpu_offload and backend != "fsdp":
            raise ValueError(f"offload.fsdp_cpu_offload=true: FSDP2's CPUOffloadPolicy exists only on the fsdp "
                             f"backend, not on {backend}; use offload.params / offload.optimizer there")
        return out

    @property
    def moves(self) -> bool:
        """Does an `Offloader` have anything to move between stages?"""
        return (self.params or self.optimizer) and not self.fsdp_cpu_offload


@dataclass(frozen=True)
class Move:
    """One transition of one part of an engine's state."""
    seq: int            # order among this offloader's moves
    part: str           # PARAMS or OPTIMIZER
    to: str             # ON_DEVICE or OFFLOADED
    why: str            # who asked: a stage's name, "sync", "checkpoint", "built"
    nbytes: int         # bytes copied (0 where the device is the host: nothing moves)
    seconds: float
    t: float            # time.time() at the end of the move


# ---------------------------------------------------------------------------------------- moving tensors
def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _view_on(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor with `t`'s dtype, shape, stride and storage offset over `storage`."""
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def move_parameters(module: torch.nn.Module, device: torch.device | str, host: dict | None = None,
                    accelerator: torch.device | str | None = None) -> int:
    """Copy every storage that holds `module`'s parameters (and their gradients) to `device`, whole, and
    re-point the parameters at it; returns the bytes copied.

    Each storage moves as one copy, so parameters that share a buffer (`flatten_parameters`) share one
    again, at the same offsets. `host` (any dict, kept by the caller) keeps the host buffers across
    moves: a move to the host reuses the buffer of the same parameters, page-locked where
    `accelerator` (the device the parameters come from) is one. Copies to a page-locked buffer are
    asynchronous: synchronize before reading it. Always copies, also to the device a storage is on."""
    device = torch.device(device)
    groups: dict[tuple[str, int], list[tuple[torch.nn.Parameter, str]]] = {}
    for p in {id(p): p for p in module.parameters()}.values():
        groups.setdefault(("data", _storage_key(p.data)), []).append((p, "data"))
        if p.grad is not None:
            groups.setdefault(("grad", _storage_key(p.grad)), []).append((p, "grad"))
    moved = 0
    with torch.no_grad():
        for members in groups.values():
            first = getattr(members[0][0], members[0][1])
            old = first.untyped_storage()
            n = old.nbytes()
            key = (members[0][1], tuple(id(p) for p, _ in members))
            if device.type == "cpu":
                buf = (host or {}).get(key)
                if buf is None or buf.numel() != n:
                    buf = host_empty(n, accelerator or old.device)
                    if host is not None:
                        host[key] = buf
            else:
                buf = torch.empty(n, dtype=torch.uint8, device=device)
            src = torch.empty(0, dtype=torch.uint8, device=old.device).set_(old, 0, (n,))
            buf.copy_(src, non_blocking=buf.is_pinned() or device.type != "cpu")
            new = buf.untyped_storage()
            for p, attr in members:
                t = getattr(p, attr)
                if attr == "data":
                    p.data = _view_on(t, new)
                else:
                    p.grad = _view_on(t, new)
            moved += n
    return moved


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str, to_host: bool,
                         host: dict) -> int:
    """Copy the tensors of `optimizer.state` (AdamW's moments) between `device` and the host; returns the
    bytes copied.

    To the host (`to_host`) go the tensors on `device`'s type, each into the buffer `host` keeps for its
    (parameter, key), page-locked where `device` is an accelerator (a DTensor by `.to("cpu")`); AdamW's
    `step` counter, which it keeps on the host unless capturable, stays where it is. Back go exactly
    the tensors that an offload put on the host (`host` holds them), each as a fresh device tensor."""
    from torch.distributed.tensor import DTensor

    device = torch.device(device)
    moved = 0
    with torch.no_grad():
        for p, state in optimizer.state.items():
            for key, value in list(state.items()):
                if not torch.is_tensor(value):
                    continue
                slot = (id(p), key)
                if to_host:
                    if value.device.type != device.type:
                        continue
                    if isinstance(value, DTensor):
                        out = value.to("cpu")
                    else:
                        out = host.get(slot)
                        if out is None or out.shape != value.shape or out.dtype != value.dtype:
                            raw = host_empty(value.numel() * value.element_size(), device)
                            out = raw.view(value.dtype).view(value.shape)
                        out.copy_(value, non_blocking=out.is_pinned())
                    host[slot] = out
                else:
                    if host.get(slot) is not value:
                        continue
                    out = value.to(device, non_blocking=True, copy=True)
                state[key] = out
                moved += value.numel() * value.element_size()
    return moved


# ---------------------------------------------------------------------------------------- the state machine
class Offloader:
    """Where one engine's parameters and optimizer state are, and the moves between stages.

    `module` / `optimizer` are callables (the engine's current ones: a wrapped or rebuilt model is
    found at each move); `device` is the engine's device. `params` / `optimizer_state`: the parts the
    config offloads; the others stay on the device and are never logged. Thread-safe: one lock over
    the counters and the moves."""

    def __init__(self, module: Callable[[], torch.nn.Module], optimizer: Callable[[], torch.optim.Optimizer | None],
                 device: torch.device | str, *, params: bool, optimizer_state: bool):
        self._module, self._optimizer = module, optimizer
        self.device = torch.device(device)
        self.parts = tuple(p for p, on in ((PARAMS, params), (OPTIMIZER, optimizer_state)) if on)
        self.where: dict[str, str] = {p: ON_DEVICE for p in self.parts}
        self.log: list[Move] = []
        self._lock = threading.RLock()
        self._holders = 0          # stages (and syncs, checkpoints) using the parameters now
        self._trainers = 0         # of them, the ones using the optimizer state too
        self._host: dict = {}      # host buffers kept across moves

    @classmethod
    def for_engine(cls, options: OffloadOptions, module: Callable[[], torch.nn.Module],
                   optimizer: Callable[[], torch.optim.Optimizer | None],
                   device: torch.device | str) -> "Offloader | None":
        """The engine's offloader, its state already on the host (None when the options move nothing)."""
        if not options.moves:
            return None
        out = cls(module, optimizer, device, params=options.params, optimizer_state=options.optimizer)
        out.offload("built")
        return out

    @property
    def real(self) -> bool:
        """Does a move copy anything? Only where the device is not the host."""
        return is_accelerator(self.device)

    # ---- the moves
    def _move(self, part: str, to: str, why: str) -> None:
        if part not in self.parts or self.where[part] == to:
            return
        t0 = time.perf_counter()
        nbytes = 0
        if self.real:
            if part == PARAMS:
                target = self.device if to == ON_DEVICE else torch.device("cpu")
                module = self._module()
                if is_fsdp(module):
                    module.to(target)
                    nbytes = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
                else:
                    nbytes = move_parameters(module, target, self._host, self.device)
            else:
                opt = self._optimizer()
                nbytes = move_optimizer_state(opt, self.device, to == OFFLOADED, self._host) if opt is not None else 0
        self.where[part] = to
        self.log.append(Move(len(self.log), part, to, why, nbytes, time.perf_counter() - t0, time.time()))

    def _settle(self, offloaded: bool) -> None:
        """After moves on an accelerator: the copies done, and (after an offload) the freed blocks
        given back to the device, for whoever runs next on it."""
        if self.real:
            synchronize(self.device)
            if offloaded:
                empty_cache(self.device)

    def offload(self, why: str) -> None:
        """Every offloaded part to the host now (callers: the last holder's exit, the engine's build)."""
        with self._lock:
            before = len(self.log)
            for part in (OPTIMIZER, PARAMS):
                self._move(part, OFFLOADED, why)
            if len(self.log) > before:
                self._settle(offloaded=True)

    def onload(self, for_training: bool, why: str) -> None:
        """The parameters to the device, and the optimizer state too `for_training`."""
        with self._lock:
            before = len(self.log)
            self._move(PARAMS, ON_DEVICE, why)
            if for_training:
                self._move(OPTIMIZER, ON_DEVICE, why)
            if len(self.log) > before:
                self._settle(offloaded=False)

    @contextlib.contextmanager
    def holding(self, for_training: bool, why: str) -> Iterator[None]:
        """The state a stage needs on the device while it runs; counted, so each part goes back to the
        host when the last holder that needs it is done (the optimizer state when the last trainer is)."""
        with self._lock:
            self._holders += 1
            self._trainers += int(for_training)
            try:
                self.onload(for_training, why)
            except BaseException:
                self._holders -= 1
                self._trainers -= int(for_training)
                raise
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                self._trainers -= int(for_training)
                before = len(self.log)
                if self._trainers == 0:
                    self._move(OPTIMIZER, OFFLOADED, why)
                if self._holders == 0:
                    self._move(PARAMS, OFFLOADED, why)
                if len(self.log) > before:
                    self._settle(offloaded=True)

    def moves(self) -> list[tuple[str, str, str]]:
        """The log as (part, to, why): what tests compare."""
        return [(m.part, m.to, m.why) for m in self.log]
