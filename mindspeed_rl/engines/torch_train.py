"""Training with plain torch: AdamW, gradient accumulation over micro-batches, grad clipping, and
DDP over gloo (nccl/hccl on devices) when a stage has DP > 1.

The engine knows nothing about RL: it turns rows into a padded batch, returns per-token log-probs
(and entropies) of the responses, runs a mini-batch of micro-batches through the worker's loss
function (`train_step`), and steps the optimizer. The RL loss is built by the worker from
`mindspeed_rl.algorithms`.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Iterable, Iterator, Sequence

import torch

from ..algorithms import entropy_from_logits, log_probs_from_logits
from .base import (Bucket, LossFn, MicroBatch, ModelOutput, NamedTensors, OptimConfig, TrainEngine, TrainSpec,
                   bucketed, flatten_parameters, hf_named_weights, load_named)
from .batching import SequenceBatch, collate, unpad_rows


def response_logits(model: torch.nn.Module, batch: SequenceBatch, temperature: float) -> torch.Tensor:
    """Logits that predict each response token: positions P-1 .. P+R-2 of the full sequence."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    p, r = batch.prompt_width, batch.responses.shape[1]
    logits = out.logits[:, p - 1:p + r - 1, :].float()
    return logits / temperature if temperature not in (0, 1.0) else logits


def response_values(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """A critic's value of each response token's state: positions P-1 .. P+R-2, as the logits above.

    V_t is read where the model has seen the prompt and the response up to token t-1, the state in
    which token t is chosen (verl's `values[:, -response_length - 1:-1]`).
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    p, r = batch.prompt_width, batch.responses.shape[1]
    return out.logits[:, p - 1:p + r - 1, 0].float()


class TorchTrainEngine(TrainEngine):
    def __init__(self, model: torch.nn.Module, pad_token_id: int, optim: OptimConfig | None = None,
                 temperature: float = 1.0, device: torch.device | str = "cpu", process_group=None,
                 model_kind: str = "causal_lm"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.module = model  # the bare model, also when wrapped in DDP
        # parameters in one buffer, in HF order (before DDP and the optimizer see them): weight sync
        # sends each bucket as one broadcast straight from it, and an inference copy receives into
        # it the same way. Checkpoints are torch.save of the state dict, which views do not hurt.
        flatten_parameters(self.module)
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.model_kind = model_kind
        self.optim_config = optim
        self.optimizer = None
        self.process_group = process_group
        self.version = 0
        if optim is not None:
            self.model.train()
            if process_group is not None:
                from torch.nn.parallel import DistributedDataParallel
                self.model = DistributedDataParallel(self.module, process_group=process_group)
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=optim.lr, betas=optim.betas,
                                               eps=optim.eps, weight_decay=optim.weight_decay)
        else:
            self.module.eval()
            for p in self.module.parameters():
                p.requires_grad_(False)

    @classmethod
    def build(cls, spec: TrainSpec) -> "TorchTrainEngine":
        from ..models import load_causal_lm, load_value_model
        torch.manual_seed(spec.seed)  # a value head is initialized from it
        loader = load_value_model if spec.model_kind == "value" else load_causal_lm
        return cls(loader(spec.model_path, spec.dtype), spec.pad_token_id, spec.optim, temperature=spec.temperature,
                   device=spec.device, process_group=spec.process_group if spec.optim is not None else None,
                   model_kind=spec.model_kind)

    def batch(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> SequenceBatch:
        b = collate(prompts, responses, self.pad_token_id)
        if self.device.type != "cpu":
            b = SequenceBatch(*(x.to(self.device) if torch.is_tensor(x) else x for x in
                                (b.input_ids, b.attention_mask, b.position_ids, b.responses, b.response_mask)),
                              prompt_width=b.prompt_width)
        return b

    def forward(self, batch: SequenceBatch, with_entropy: bool = False):
        """Per-token log-probs [B, R] (and entropies) of the responses, with grad when training."""
        logits = response_logits(self.model, batch, self.temperature)
        logp = log_probs_from_logits(logits, batch.responses)
        return logp, (entropy_from_logits(logits) if with_entropy else None)

    def model_output(self, batch: SequenceBatch) -> ModelOutput:
        """What a loss function sees: log-probs and entropies of a causal LM, values of a value model."""
        if self.model_kind == "value":
            return ModelOutput(response_mask=batch.response_mask, values=response_values(self.model, batch))
        logp, entropy = self.forward(batch, with_entropy=True)
        return ModelOutput(response_mask=batch.response_mask, log_probs=logp, entropy=entropy)

    @torch.no_grad()
    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """Inference: per-token log-probs, one 1-D tensor per row, micro-batch by micro-batch."""
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), micro_batch_size):
            b = self.batch(prompts[i:i + micro_batch_size], responses[i:i + micro_batch_size])
            logits = response_logits(self.module, b, self.temperature)
            out.extend(r.cpu() for r in unpad_rows(log_probs_from_logits(logits, b.responses), b.response_mask))
        return out

    @torch.no_grad()
    def values(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        """Inference of a critic: per-token values, one 1-D tensor per row."""
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), micro_batch_size):
            b = self.batch(prompts[i:i + micro_batch_size], responses[i:i + micro_batch_size])
            out.extend(r.cpu() for r in unpad_rows(response_values(self.module, b), b.response_mask))
        return out

    def no_sync(self, sync: bool):
        """DDP all-reduces only on the last micro-batch of an update (gradient accumulation)."""
        if sync or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def train_step(self, micro_batches: Iterable[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an inference-only engine (built without OptimConfig)")
        metrics: dict[str, float] = {}
        count = 0
        for mb in micro_batches:
            b = self.batch(mb.data["prompts"], mb.data["responses"])
            with self.no_sync(mb.last):
                loss, m = loss_fn(self.model_output(b), mb)
                (loss * mb.loss_scale).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
            count += 1
        metrics["micro_batches"] = float(count)
        metrics.update(self.optimizer_step())
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on an inference-only engine (built without OptimConfig)")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.optim_config.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(grad_norm)}

    def parameters(self) -> list[torch.Tensor]:
        return [p.data for _, p in self.module.named_parameters()]

    # ---- weights
    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        return bucketed(hf_named_weights(self.module), bucket_bytes)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        load_named(self.module, named_tensors)
        self.version = int(version)

    def state_checksum(self) -> str:
        from .weight_sync import checksum
        return checksum(hf_named_weights(self.module))

    def receive_targets(self) -> dict[str, torch.Tensor] | None:
        """An inference copy's parameters by HF name (tied ones under each name); None for a trained
        engine, which is never a reader: its parameters belong to its optimizer and DDP."""
        if self.optimizer is not None:
            return None
        return {n: p.detach() for n, p in self.module.named_parameters(remove_duplicate=False)}

    # ---- checkpoints
    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "version": self.version,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.version = int(state["version"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            # a copy: torch keeps the given moment tensors, so two engines would share them
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))

    def _rank(self) -> int:
        if self.process_group is None:
            return 0
        import torch.distributed as dist
        return dist.get_rank(self.process_group)

    def save_checkpoint(self, directory: str) -> list[str]:
        """DDP ranks hold the same state: rank 0 writes `engine.pt` (atomically)."""
        if self._rank() != 0:
            return []
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "engine.pt")
        torch.save(self.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        return [path]

    def load_checkpoint(self, directory: str) -> None:
        path = os.path.join(directory, "engine.pt")
        self.load_state_dict(torch.load(path, map_location=self.device, weights_only=False))
