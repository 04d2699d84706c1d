"""The log-prob step: per-token log-probs of the responses by a model's train engine (the actor's old
log-probs, the reference's), and how far they are from the rollout engine's own.

The declaration, the micro-batch size it takes from actor_config or ref_config and the call sit together, so
the default inference function of an algorithm is read in one place; `logprob_diff` is the check that the
rollout serves the trainer's weights.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..compute import Output, compute_step
from ..impls import Forward, rows_per_get


def log_probs(batch: dict, rows: list[int], *, engine, micro_batch_size: int) -> Output:
    """Log-probs of the responses; with `rollout_log_prob` in the batch also how far they are from
    the rollout engine's own (verl's rollout_probs_diff): ~1e-6 in an on-policy float32 run proves the
    rollout serves the trainer's weights, a gap means a sync that did not arrive or a numerics gap."""
    lp = engine.log_probs(batch["prompts"], batch["responses"], micro_batch_size)
    metrics = {}
    if "rollout_log_prob" in batch:
        metrics = logprob_diff(lp, batch["rollout_log_prob"], batch.get("loss_mask"))
    return Output({"log_prob": lp}, metrics)


def logprob_diff(log_prob: Sequence[torch.Tensor], rollout_log_prob: Sequence[torch.Tensor],
                 loss_mask: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
    """|log_prob - rollout_log_prob| over response tokens: its max, and sum and count for the mean.
    With `loss_mask`, over the model's own tokens only (a tool's output has no rollout log-prob)."""
    diffs = [(torch.as_tensor(a).float() - torch.as_tensor(b).float()).abs()
             for a, b in zip(log_prob, rollout_log_prob)]
    if loss_mask is not None:
        diffs = [d[torch.as_tensor(m).reshape(-1)[:d.numel()] > 0] for d, m in zip(diffs, loss_mask)]
    tokens = sum(int(d.numel()) for d in diffs)
    return {"logprob_diff_max": float(max((float(d.max()) for d in diffs if d.numel()), default=0.0)),
            "logprob_diff_sum": float(sum(float(d.sum()) for d in diffs)), "logprob_diff_tokens": float(tokens)}


@compute_step("log_probs", "inference", ("prompts", "responses"), ("log_prob",), engine="policy",
              optional=("rollout_log_prob", "loss_mask"),
              doc="per-token log-probs of the responses (and their distance to the rollout's, when given)")
class LogProbs(Forward):
    """Per-token log-probs of the responses (the actor's old log-probs, the reference's)."""
    method = "log_probs"

    @staticmethod
    def args(cfg, mfc, info):
        mbs = (cfg.actor_config.log_prob_micro_batch_size_per_device if mfc.model_name in info.trained_models
               else cfg.ref_config.log_prob_micro_batch_size_per_device)
        return {"count": rows_per_get(mfc, mbs, cfg.rl_config.n_samples_per_prompt)}

    def compute(self, batch, rows, engine):
        return log_probs(batch, rows, engine=engine, micro_batch_size=self.count)
