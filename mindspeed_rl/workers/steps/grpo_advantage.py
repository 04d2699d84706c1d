"""GRPO's advantage step: each response's reward normalized within its prompt's group of samples. The MFC
gets whole groups (get_n_samples), so a row's group is its index over n_samples_per_prompt; the
normalization itself is `algorithms.grpo_advantages`.
"""
from __future__ import annotations

import torch

from ...algorithms import grpo_advantages
from ..compute import Output, as_scalars, compute_step, scalar_rows
from ..impls import Impl, compute_count


def grpo_advantage(batch: dict, rows: list[int], *, n_samples_per_prompt: int, eps: float,
                   norm_by_std: bool) -> Output:
    scores = as_scalars(batch["rm_scores"])
    groups = torch.tensor(rows, dtype=torch.int64) // n_samples_per_prompt
    adv = grpo_advantages(scores, groups, eps=eps, norm_by_std=norm_by_std)
    return Output({"advantages": scalar_rows(adv)}, {})


@compute_step("grpo_advantage", "compute", ("rm_scores",), ("advantages",),
              doc="reward normalized within each prompt's group (needs get_n_samples)")
class GRPOAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        rl = cfg.rl_config
        return {"count": compute_count(cfg, mfc), "n_samples_per_prompt": rl.n_samples_per_prompt, "eps": rl.adv_eps,
                "norm_by_std": rl.norm_adv_by_std}

    def __call__(self, batch, rows):
        a = self.args
        return grpo_advantage(batch, rows, n_samples_per_prompt=a["n_samples_per_prompt"], eps=a["eps"],
                              norm_by_std=a["norm_by_std"])
