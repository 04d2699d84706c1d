"""What each kind of MFC computes on a micro-batch of rows: pure functions of (rows, engines).

The worker's loop (`stage.py`) is the same for every MFC; only the function differs. A function
gets the micro-batch as `{column: [row tensors]}` plus the row indexes, and returns the output
columns as `{column: [row tensors]}` (one per row) and a dict of metric sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..algorithms import agg_loss, broadcast_to_tokens, grpo_advantages, kl_penalty, policy_loss


@dataclass
class Output:
    columns: dict[str, list]
    metrics: dict[str, float]  # sums over rows/micro-batches; the driver turns them into means


def as_scalars(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(r).reshape(-1)[0].float() for r in rows])


def scalar_rows(values: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    return [v.reshape(1).to(dtype) for v in values]


def rollout_seed(seed: int, step: int, first_row: int) -> int:
    """Sampling seed of one micro-batch: the same rows at the same step sample the same tokens."""
    return int(np.random.SeedSequence([seed, step, first_row]).generate_state(1, dtype=np.uint64)[0] >> 1)


def generate(batch: dict, rows: list[int], *, engine, params, seed: int, step: int) -> Output:
    responses = engine.generate(batch["prompts"], params, rollout_seed(seed, step, rows[0]))
    lengths = [int(r.numel()) for r in responses]
    version = torch.tensor([engine.weight_version], dtype=torch.int64)
    return Output({"responses": responses,
                   "response_length": [torch.tensor([n], dtype=torch.int64) for n in lengths],
                   "weight_version": [version.clone() for _ in rows]},
                  {"response_length_sum": float(sum(lengths)), "rows": float(len(rows)),
                   "prompt_length_sum": float(sum(int(p.numel()) for p in batch["prompts"])),
                   "response_length_max": float(max(lengths) if lengths else 0)})


def log_probs(batch: dict, rows: list[int], *, engine, output_key: str, micro_batch_size: int) -> Output:
    lp = engine.log_probs(batch["prompts"], batch["responses"], micro_batch_size)
    return Output({output_key: lp}, {})


def rule_reward(batch: dict, rows: list[int], *, reward_fn: Callable, tokenizer, decode_label: Callable) -> Output:
    from ..rewards import score_batch

    responses = tokenizer.batch_decode([r.tolist() for r in batch["responses"]], skip_special_tokens=True)
    prompts = tokenizer.batch_decode([p.tolist() for p in batch["prompts"]], skip_special_tokens=True)
    answers = [decode_label(lbl) for lbl in batch["labels"]]
    scores = score_batch(reward_fn, responses, answers, prompts)
    t = torch.tensor(scores, dtype=torch.float32)
    return Output({"rm_scores": scalar_rows(t)},
                  {"reward_sum": float(t.sum()), "reward_rows": float(len(rows)),
                   "reward_max_count": float((t >= 1.0).sum())})


def grpo_advantage(batch: dict, rows: list[int], *, n_samples_per_prompt: int, eps: float,
                   norm_by_std: bool) -> Output:
    scores = as_scalars(batch["rm_scores"])
    groups = torch.tensor(rows, dtype=torch.int64) // n_samples_per_prompt
    adv = grpo_advantages(scores, groups, eps=eps, norm_by_std=norm_by_std)
    return Output({"advantages": scalar_rows(adv)}, {})


@dataclass
class PolicyLossConfig:
    clip_low: float
    clip_high: float
    clip_c: float
    agg: str
    use_kl_loss: bool
    kl_type: str
    entropy_coeff: float


def policy_train_micro_batch(batch: dict, *, engine, loss_cfg: PolicyLossConfig, kl_coef: float,
                             loss_scale: float, sync: bool) -> dict[str, float]:
    """Forward + backward of one micro-batch of the GRPO/PPO actor loss (no optimizer step)."""
    b = engine.batch(batch["prompts"], batch["responses"])
    mask = b.response_mask
    width = mask.shape[1]
    old = _rows_to_matrix(batch["old_log_prob"], width) * mask
    adv = broadcast_to_tokens(as_scalars(batch["advantages"]).to(mask.device), mask)
    with engine.no_sync(sync):
        logp, entropy = engine.forward(b, with_entropy=True)
        pg_loss, pg_metrics = policy_loss(logp, old.to(logp.device), adv, mask, clip_low=loss_cfg.clip_low,
                                          clip_high=loss_cfg.clip_high, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg)
        loss = pg_loss
        ent = agg_loss(entropy, mask, loss_cfg.agg)
        if loss_cfg.entropy_coeff:
            loss = loss - loss_cfg.entropy_coeff * ent
        kl_value = 0.0
        if loss_cfg.use_kl_loss and "ref_log_prob" in batch:
            ref = _rows_to_matrix(batch["ref_log_prob"], width).to(logp.device)
            kl = agg_loss(kl_penalty(logp, ref, loss_cfg.kl_type), mask, loss_cfg.agg)
            loss = loss + kl_coef * kl
            kl_value = float(kl.detach())
        (loss * loss_scale).backward()
    return {"pg_loss": float(pg_loss.detach()), "kl": kl_value, "entropy": float(ent.detach()),
            "pg_clipfrac": pg_metrics["pg_clipfrac"], "ppo_kl": pg_metrics["ppo_kl"],
            "pg_clipfrac_lower": pg_metrics["pg_clipfrac_lower"], "micro_batches": 1.0}


def _rows_to_matrix(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = min(int(r.numel()), width)
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.float32)
    return out


def merge_metrics(into: dict[str, float], more: dict[str, Any]) -> dict[str, float]:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + float(v)
    return into
