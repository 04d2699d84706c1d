"""The rule reward step: rl_config.reward_fn on the decoded responses and answers, with DAPO's soft overlong
penalty. Its declaration, its arguments from rl_config and generate_config and the scoring sit in this one
module; it also hands the decoded rows on as samples for people to read (trainer/samples.py), since it decodes
them anyway.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...algorithms import overlong_penalty
from ..compute import Output, compute_step, scalar_rows
from ..impls import Impl, compute_count


def rule_reward(batch: dict, rows: list[int], *, reward_fn: Callable, tokenizer, decode_label: Callable,
                overlong: tuple[int, int, float] | None = None) -> Output:
    """rl_config.reward_fn on the decoded responses. `overlong` = (max_new_tokens, buffer, factor): DAPO's soft
    penalty on long responses is added to rm_scores (`reward_sum` stays the function's own score; the
    penalty's sum is `overlong_penalty_sum`). A reward function with a `parts` dict (name -> function)
    also logs each part's mean (`reward/<name>_mean`)."""
    from ...rewards import score_batch

    responses = tokenizer.batch_decode([r.tolist() for r in batch["responses"]], skip_special_tokens=True)
    prompts = tokenizer.batch_decode([p.tolist() for p in batch["prompts"]], skip_special_tokens=True)
    answers = [decode_label(lbl) for lbl in batch["labels"]]
    scores = score_batch(reward_fn, responses, answers, prompts)
    t = torch.tensor(scores, dtype=torch.float32)
    metrics = {"reward_sum": float(t.sum()), "reward_rows": float(len(rows)),
               "reward_max_count": float((t >= 1.0).sum())}
    for name, part in getattr(reward_fn, "parts", {}).items():
        metrics[f"reward_part_{name}_sum"] = float(sum(score_batch(part, responses, answers, prompts)))
    if overlong is not None and overlong[1] > 0:
        penalty = overlong_penalty([int(r.numel()) for r in batch["responses"]], *overlong)
        t = t + penalty
        metrics["overlong_penalty_sum"] = float(penalty.sum())
    samples = [{"row": int(r), "prompt": p, "response": s, "answer": a, "reward": float(x)}
               for r, p, s, a, x in zip(rows, prompts, responses, answers, t.tolist())]
    return Output({"rm_scores": scalar_rows(t)}, metrics, samples)


@compute_step("rule_reward", "compute", ("prompts", "responses", "labels"), ("rm_scores",),
              doc="rl_config.reward_fn on the decoded response and answer")
class RuleReward(Impl):
    """rl_config.reward_fn on the decoded responses and answers."""

    @staticmethod
    def args(cfg, mfc, info):
        ob = cfg.rl_config.overlong_buffer  # DAPO's soft overlong penalty (length 0: off)
        return {"count": compute_count(cfg, mfc), "reward_fn": cfg.rl_config.reward_fn,
                "overlong": [cfg.generate_config.max_new_tokens, ob.length, ob.penalty_factor] if ob.length else None}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.reward_fn = ctx.host.reward_fn(self.args["reward_fn"])

    def __call__(self, batch, rows):
        from ...data.loader import decode_label
        return rule_reward(batch, rows, reward_fn=self.reward_fn, tokenizer=self.ctx.host.tokenizer,
                           decode_label=decode_label, overlong=self.args.get("overlong"))
