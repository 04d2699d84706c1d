"""The mesh backend's optimizer step (`MeshTrainEngine.train_step`, mesh_train.py): rounds of micro-batches
through the pipeline or the local model, token-budget groups, the global grad norm and clipping.

A mixin of `MeshTrainEngine`: it uses the engine's mesh, stage module and helpers (`_next_round`,
`_padded_round`, `_pipeline`, `_forward_chunks`, ...), and is used by nothing else.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ...algorithms.metrics import merge_metrics
from ..base import LossFn, MicroBatch, ModelOutput
from ..batching import SequenceBatch, collate, forward_groups, join_groups, right_pad
from .mesh_stage import is_dtensor


class MeshTrainStep:
    """`train_step` and its pieces (see the module doc)."""

    def train_step(self, micro_batches: Iterable[MicroBatch] | None, loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without optim)")
        it = iter(micro_batches) if self.is_dock_reader else None
        sums: dict[str, float] = {}
        n = 0
        round_size = 1 if self.pp == 1 else self.pp_microbatches
        last_seen = False
        while True:
            rnd = self._next_round(it, round_size)
            if not rnd:
                break
            metrics = self._train_round(rnd, loss_fn)
            for m in metrics:
                merge_metrics(sums, m)  # _max maxed, _min minned, the rest summed
            n += len(rnd)
            last_seen = rnd[-1].last
        if n == 0:
            raise ValueError("train_step got no micro-batches")
        if self.fsdp and self.pp == 1 and not last_seen:
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError("the last micro-batch of train_step had last=False: the step's micro-batches "
                               "ended early, so its gradients were dropped")
        grad_norm = self._clip()
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.pp > 1:  # the loss metrics live on the last stage: the replica reports them
            sums = self._bcast_obj(sums, self.writer_rank, self.replica_group)
        return {**sums, "micro_batches": n, "grad_norm": grad_norm}

    def _train_round(self, rnd: list[MicroBatch], loss_fn: LossFn, split: bool = True) -> list[dict]:
        if split and self.pp > 1 and self.max_tokens is not None:
            return self._train_round_split(rnd, loss_fn)
        cpu = [collate(mb.data["prompts"], mb.data["responses"], self.pad_token_id) for mb in rnd]
        batches = [self._to_device(b) for b in cpu]
        self.stage.with_entropy = True
        if self.pp == 1:
            out = []
            for mb, b in zip(rnd, batches):   # FSDP reduce-scatters each micro-batch's gradients
                o, zero = self._local_output(mb, b)
                loss, m = loss_fn(o, mb)
                loss = loss * mb.loss_scale
                (loss if zero is None else loss + zero).backward()
                out.append(m)
            return out
        ids, masks, pos, P, R, rows = self._padded_round(cpu)
        metrics: list[dict] = [{} for _ in rnd]

        def pp_loss(head_out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            j = int(target[0])
            b = batches[j]
            o = self._output(head_out[:b.input_ids.shape[0], :b.responses.shape[1]], b)
            loss, m = loss_fn(o, rnd[j])
            metrics[j] = m
            return loss * rnd[j].loss_scale

        self.stage.response_slice = (P, R)
        sched = self._pipeline(len(rnd), rows, ids.shape[1], R, has_backward=True, loss_fn=pp_loss, head="log_probs")
        target = torch.arange(len(rnd)).repeat_interleave(rows)
        ids, masks, pos, target = self._dev(ids, masks, pos, target)
        kwargs = {"attention_mask": masks, "position_ids": pos}
        args = (ids,) if self.is_first else ()
        # a new PipelineStage clears the gradients of FSDP modules when the schedule initializes it
        # (`_post_metadata_inference_cleanup`): earlier rounds' reduced gradients are set aside
        # around the step and added back
        saved = []
        if self.fsdp:
            saved = [(p, p.grad) for p in self.stage.parameters() if p.grad is not None]
            for p, _ in saved:
                p.grad = None
        with self.autocast():
            sched.step(*args, target=target if self.is_last else None, return_outputs=False, **kwargs,
                       **self._round_labels(ids, P))
        with torch.no_grad():
            for p, g in saved:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return metrics

    def _train_round_split(self, rnd: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """pp > 1 with a token budget. A pipeline schedule runs each pipeline micro-batch's backward right
        after its loss, but the loss must see the whole micro-batch, whose token-budget groups are separate
        pipeline micro-batches. So the groups first run forward-only; the last stage computes each
        micro-batch's loss on its joined outputs (`join_groups`) and the loss's gradient with respect to
        them; then the groups run the training schedule with the loss sum(output * that gradient), whose
        parameter gradients are the micro-batch loss's (the chain rule through the same forwards, same
        shapes, same values). The price of exact losses is one forward-only pass more per update. Dummy
        groups (zero gradient) give every FSDP replica as many pipeline micro-batches."""
        pad = self.pad_token_id
        flat: list[tuple[int, list[int]]] = []   # (micro-batch, its rows) of each group
        for j, mb in enumerate(rnd):
            p, r = mb.data["prompts"], mb.data["responses"]
            flat += [(j, g) for g in forward_groups(p, r, len(p), self.max_tokens)]
        rows = [([rnd[j].data["prompts"][i] for i in g], [rnd[j].data["responses"][i] for i in g]) for j, g in flat]
        dummy = [torch.tensor([pad])]
        rows += [(dummy, dummy)] * (self._max_over_replicas(len(rows)) - len(rows))
        self.stage.with_entropy = True
        outs = self._forward_chunks([collate(p, r, pad) for p, r in rows])
        self._reshard()
        grads: list[torch.Tensor | None] = [None] * len(rows)
        metrics: list[dict] = [{} for _ in rnd]
        if self.is_last:
            for j, mb in enumerate(rnd):
                ks = [k for k, (owner, _) in enumerate(flat) if owner == j]
                leaves = [outs[k].detach().requires_grad_() for k in ks]
                parts = [self._output(leaf, self._to_device(collate(*rows[k], pad))) for leaf, k in zip(leaves, ks)]
                mask = right_pad(mb.data["responses"], pad)[1].to(self.device)
                loss, metrics[j] = loss_fn(join_groups([flat[k][1] for k in ks], parts, mask), mb)
                for k, g in zip(ks, torch.autograd.grad(loss * mb.loss_scale, leaves, allow_unused=True)):
                    grads[k] = torch.zeros_like(outs[k]) if g is None else g
            for k in range(len(flat), len(rows)):
                grads[k] = torch.zeros_like(outs[k])

        def surrogate(o: ModelOutput, group: MicroBatch) -> tuple[torch.Tensor, dict]:
            head = o.values if o.values is not None else torch.stack([o.log_probs, o.entropy], dim=-1)
            return (head * grads[group.data["index"]]).sum(), {}

        groups = [MicroBatch({"prompts": p, "responses": r, "index": k}, 1.0) for k, (p, r) in enumerate(rows)]
        for k in range(0, len(groups), self.pp_microbatches):
            self._train_round(groups[k:k + self.pp_microbatches], surrogate, split=False)
        return metrics

    def _local_output(self, mb: MicroBatch, b: SequenceBatch) -> tuple[ModelOutput, torch.Tensor | None]:
        """pp=1: a training micro-batch's output, in token-budget forwards joined before the loss when a
        budget is set (`join_groups`: the loss sees what one padded forward gives it); with FSDP over dp, a
        zero that depends on this replica's dummy forwards, so its backward gathers and reduces as often
        as the replica with the most forwards (None when it ran none)."""
        if self.max_tokens is None:
            return self._output(self._run_local(b), b), None
        prompts, responses = mb.data["prompts"], mb.data["responses"]
        groups = forward_groups(prompts, responses, len(prompts), self.max_tokens)
        total = self._max_over_replicas(len(groups))
        outs = []
        for g in groups:
            gb = self._to_device(collate([prompts[i] for i in g], [responses[i] for i in g], self.pad_token_id))
            outs.append(self._output(self._run_local(gb), gb))
        out = outs[0] if len(groups) == 1 else join_groups(groups, outs, b.response_mask)
        zero = None
        for _ in range(total - len(groups)):
            t = self._run_local(self._to_device(self._dummy_batch())).sum() * 0.0
            zero = t if zero is None else zero + t
        return out, zero

    def _clip(self) -> float:
        """Global grad norm over TP shards, FSDP shards and pipeline stages; clip all by it."""
        params = [p for p in self.stage.parameters() if p.grad is not None]
        counted = params
        if self.tied and self.pp > 1:
            tied = self._tied_param()
            if tied is not None and tied.grad is not None and self.embed_group is not None:
                g = tied.grad.to_local() if is_dtensor(tied.grad) else tied.grad
                dist.all_reduce(g, group=self.embed_group)
            if self.is_last and not self.is_first:
                counted = [p for p in params if p is not tied]   # the same weight as stage 0's embedding
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for grads in self._by_kind([p.grad for p in counted]):
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if is_dtensor(norm):
                norm = norm.full_tensor()
            sq = sq + norm.float() ** 2
        if self.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        total = sq.sqrt()
        for group in self._by_kind(params):
            torch.nn.utils.clip_grads_with_norm_(group, self.optim_config.grad_clip, total)
        return float(total)

    @staticmethod
    def _by_kind(tensors: list) -> list[list]:
        """Group tensors by kind: plain tensors, and DTensors per (mesh, placements); a parameter is
        grouped by its gradient. torch's foreach norm/scale kernels take one kind per call."""
        groups: dict[Any, list] = {}
        for t in tensors:
            g = t.grad if isinstance(t, nn.Parameter) else t
            key = (id(g.device_mesh), tuple(g.placements)) if is_dtensor(g) else None
            groups.setdefault(key, []).append(t)
        return list(groups.values())

    def _tied_param(self):
        if self.is_first:
            return self.stage.model.embed_tokens.weight
        if self.is_last:
            return self.stage.lm_head.weight
        return None
