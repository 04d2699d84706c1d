"""The reward model's scoring step (inference, the `reward_model` MFC): its score of each response, at its
last token. A reward model may read other token ids than the policy's, so the re-tokenizer it needs (cached
per pair of tokenizers) sits beside the step, and the worker's engine set points here for it.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

from ..compute import Output, as_scalars, compute_step, scalar_rows
from ..impls import Forward, rows_per_get


def reward_model_score(batch: dict, rows: list[int], *, engine, micro_batch_size: int,
                       retokenize: Callable | None = None) -> Output:
    """One score per row (a [1] tensor) from the reward model; `retokenize(prompts, responses)` first when
    the reward model reads other token ids than the policy's."""
    prompts, responses = batch["prompts"], batch["responses"]
    if retokenize is not None:
        prompts, responses = retokenize(prompts, responses)
    scores = engine.scores(prompts, responses, micro_batch_size)
    t = as_scalars(scores)
    return Output({"model_scores": scalar_rows(t)},
                  {"model_score_sum": float(t.sum()), "model_score_rows": float(len(rows))})


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str):
    from ...models import load_tokenizer
    return load_tokenizer(path)


@functools.lru_cache(maxsize=8)
def retokenizer(policy_path: str, reward_path: str) -> Callable | None:
    """`retokenize(prompts, responses)` from the policy's tokenizer to the reward model's, or None when the two
    give the same ids (then the reward model reads the policy's ids directly)."""
    from ...models.reward import retokenize, same_tokenizer
    source, target = _tokenizer(policy_path), _tokenizer(reward_path)
    if same_tokenizer(source, target):
        return None
    return functools.partial(_retokenize, retokenize, source, target)


def _retokenize(fn, source, target, prompts: Sequence, responses: Sequence):
    return fn(prompts, responses, source, target)


@compute_step("reward_model_score", "inference", ("prompts", "responses"), ("model_scores",), engine="reward",
              doc="the reward model's score of each response, at its last token (re-tokenized for its own "
                  "tokenizer)")
class RewardModelScore(Forward):
    """The reward model's score of each response (`reward_model.micro_batch_size_per_device` rows a forward)."""
    method = "scores"

    @staticmethod
    def args(cfg, mfc, info):
        return {"count": rows_per_get(mfc, cfg.reward_model.micro_batch_size_per_device, cfg.rl_config.n_samples_per_prompt),
                "policy_path": cfg.actor_config.model_path, "reward_path": cfg.reward_model.model_path or ""}

    def __init__(self, ctx):
        super().__init__(ctx)
        tokenizes = ctx.host.tokenizer is not None   # engines without a model have no tokenizer
        self.retokenize = (None if not tokenizes or not self.args["reward_path"] else
                           retokenizer(self.args["policy_path"], self.args["reward_path"]))

    def compute(self, batch, rows, engine):
        return reward_model_score(batch, rows, engine=engine, micro_batch_size=self.count, retokenize=self.retokenize)
