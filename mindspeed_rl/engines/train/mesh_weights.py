"""The mesh backend's weights and checkpoints (`MeshTrainEngine`, mesh_train.py): full HF-named tensors
gathered from the TP shards and pipeline stages for export, a stage's slice kept on update, and
`torch.distributed.checkpoint` of the stage module and its optimizer.

A mixin of `MeshTrainEngine`: it uses the engine's mesh, stage module and manifest, and is used by
nothing else.
"""
from __future__ import annotations

import os
from typing import Iterator

import torch
import torch.distributed as dist

from ..base import Bucket, NamedTensors, bucketed
from .mesh_stage import is_dtensor


class MeshWeights:
    """Export, update and checkpoints (see the module doc)."""

    def _stage_params(self) -> dict[str, torch.Tensor]:
        return dict(self.stage.named_parameters(remove_duplicate=False))

    def _full(self) -> Iterator[tuple[str, torch.Tensor]]:
        own = self._stage_params()
        for name, shape, owner in self.manifest:
            t = None
            if owner == self.pp_rank:
                p = own[name]
                with torch.no_grad():
                    t = p.full_tensor() if is_dtensor(p) else p.detach()
                    t = t.to(self.export_dtype)
            if self.pp > 1:
                if t is None:
                    t = torch.empty(shape, dtype=self.export_dtype, device=self.device)
                else:
                    t = t.contiguous()
                src = int(self._grid[owner, self.dp_rank, self.tp_rank])
                dist.broadcast(t, src=src, group=self.pp_group)
            yield name, t

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        self._reshard()
        yield from bucketed(self._full(), bucket_bytes)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        from torch.distributed.tensor import distribute_tensor

        self._reshard()
        own = self._stage_params()
        known = {n for n, _, _ in self.manifest}
        alias = {}
        if self.tied:
            alias = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}
        with torch.no_grad():
            for name, full in named_tensors:
                if name not in known:
                    raise KeyError(f"update_weights: {name!r} is no parameter of this model")
                for target in (name, alias.get(name)):
                    p = own.get(target) if target else None
                    if p is None:
                        continue
                    if tuple(full.shape) != tuple(p.shape):
                        raise ValueError(f"update_weights: {name!r} has shape {tuple(full.shape)}, the model's is "
                                         f"{tuple(p.shape)}")
                    src = full.to(device=p.device, dtype=p.dtype)
                    if is_dtensor(p):
                        part = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
                        p.to_local().copy_(part.to_local())
                    else:
                        p.copy_(src)
        self.version = int(version)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.stage, self.optimizer, options=opts)
            return {"model": model_sd, "optim": optim_sd, "version": self.version}
        return {"model": get_model_state_dict(self.stage, options=opts), "version": self.version}

    def save_checkpoint(self, directory: str) -> list[str]:
        import torch.distributed.checkpoint as dcp

        self._reshard()
        os.makedirs(directory, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=directory)
        prefix = f"__{self.rank}_"
        return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                      if f.startswith(prefix) or (self.rank == 0 and f == ".metadata"))

    def load_checkpoint(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_state_dict)

        self._reshard()
        state = self._state()
        dcp.load(state, checkpoint_id=directory)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        if self.optimizer is not None:
            set_state_dict(self.stage, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            set_model_state_dict(self.stage, state["model"], options=opts)
        self.version = int(state["version"])
