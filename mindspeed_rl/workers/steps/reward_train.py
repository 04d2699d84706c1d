"""Reward modeling's train step (`rm_train`): optimizer steps of the Bradley-Terry loss on preference pairs,
with the `reward_model` section's sizes. It is the actor's train step (policy_train.py) with another loss and
sizes, so it subclasses `PolicyTrain`. What the worker does with a reward model between steps, scoring
held-out pairs and writing a plain HF checkpoint, sits beside it: both read the same engine the step trains.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...algorithms import bradley_terry_loss, preference_accuracy, preference_margin
from ..compute import compute_step
from .policy_train import PolicyTrain


def reward_loss_fn() -> Callable:
    """The reward model's loss on one micro-batch of pairs, as a train engine calls it: its output's
    `scores` hold the chosen responses' scores, then the rejected ones' (`torch_train.pair_rows`)."""
    def loss_fn(out, mb) -> tuple[torch.Tensor, dict[str, float]]:
        n = len(mb.data["prompts"])
        chosen, rejected = out.scores[:n], out.scores[n:]
        loss = bradley_terry_loss(chosen, rejected)
        return loss, {"loss": float(loss.detach()), "accuracy": preference_accuracy(chosen, rejected),
                      "margin": preference_margin(chosen, rejected),
                      "chosen_score": float(chosen.detach().float().mean())}
    return loss_fn


@compute_step("reward_train", "train_step", ("prompts", "chosen", "rejected"), engine="reward",
              doc="Bradley-Terry loss of the reward model on preference pairs (reward modeling)")
class RewardTrain(PolicyTrain):
    """Optimizer steps of the Bradley-Terry loss over preference pairs (`reward_model` section's sizes)."""
    section = "reward_model"

    @classmethod
    def sizes(cls, cfg, info) -> dict:
        from ...config.sizes import train_sizes
        rm, rl = cfg.reward_model, cfg.rl_config
        s = train_sizes(rm.mini_batch_size, rm.micro_batch_size_per_device, rl.prompts_per_step, 1, info.dp)
        return {"rows_per_device": s.rows_per_device, "mini_rows_per_device": s.mini_rows_per_device,
                "count": s.micro_rows}

    @classmethod
    def args(cls, cfg, mfc, info):
        return cls.sizes(cfg, info)

    def loss_fn(self):
        return reward_loss_fn()


# ------------------------------------------------------------------------------------------------ between steps
def score_pairs(engine, columns: dict, micro_batch_size: int) -> dict[str, list[float]]:
    """The scores of held-out pairs (`columns`: token-id lists of prompts, chosen, rejected) by a reward model's
    engine: {"chosen": [...], "rejected": [...]}. Every rank of a sharded engine calls it with the same pairs."""
    prompts = [torch.tensor(p, dtype=torch.int64) for p in columns["prompts"]]
    responses = [torch.tensor(r, dtype=torch.int64) for r in list(columns["chosen"]) + list(columns["rejected"])]
    scores = [float(s.reshape(-1)[0]) for s in engine.scores(prompts + prompts, responses, micro_batch_size)]
    n = len(prompts)
    return {"chosen": scores[:n], "rejected": scores[n:]}


def save_pretrained(engine, model_path: str, tokenizer, directory: str, rank: int) -> str | None:
    """Write a reward model's engine as a plain HF checkpoint: its weights as `export_weights` gathers them (every
    rank iterates, a sharded engine's gathers being collective), rank 0 builds the classifier and saves."""
    from ...models.reward import save_reward_weights
    state: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(256 << 20):
        if rank == 0:
            state.update((name, t.detach().to("cpu", copy=True)) for name, t in bucket)
    if rank != 0:
        return None
    pad = getattr(engine, "pad_token_id", None)
    return str(save_reward_weights(state, model_path, pad, tokenizer, directory))
