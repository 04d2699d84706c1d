"""The critic's train step: optimizer steps of the clipped value loss against the GAE returns. It is the
actor's train step (policy_train.py) with critic_config's sizes and its own loss, so it subclasses
`PolicyTrain` and takes its loss over the same `token_mask`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...algorithms import value_loss
from ..compute import compute_step, rows_to_matrix
from .policy_train import PolicyTrain, token_mask


@dataclass
class ValueLossConfig:
    clip_value: float
    agg: str


def value_loss_fn(loss_cfg: ValueLossConfig) -> Callable:
    """The critic's clipped value loss on one micro-batch: (model output, micro-batch) -> (loss, metrics)."""
    def loss_fn(out, mb) -> tuple[torch.Tensor, dict[str, float]]:
        mask = token_mask(out.response_mask, mb.data)
        width = mask.shape[1]
        old = rows_to_matrix(mb.data["values"], width).to(mask.device)
        returns = rows_to_matrix(mb.data["returns"], width).to(mask.device)
        loss, m = value_loss(out.values, returns, old, mask, loss_cfg.clip_value, loss_cfg.agg)
        return loss, {"vf_loss": float(loss.detach()), "vf_clipfrac": float(m["vf_clipfrac"]),
                      "vpred_mean": float(m["vpred_mean"])}
    return loss_fn


@compute_step("value_train", "train_step", ("prompts", "responses", "values", "returns"), engine="value",
              doc="clipped value loss")
class ValueTrain(PolicyTrain):
    """Optimizer steps of the clipped value loss."""
    section = "critic_config"

    @classmethod
    def args(cls, cfg, mfc, info):
        o = cfg.critic_config
        return {**cls.sizes(cfg, info), "loss": {"clip_value": o.cliprange_value, "agg": o.loss_agg_mode}}

    def loss_fn(self):
        return value_loss_fn(ValueLossConfig(**self.args["loss"]))
