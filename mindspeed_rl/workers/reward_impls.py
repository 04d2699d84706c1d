"""The reward model's compute functions and their implementations (each declared above its class):

- `reward_model_score` (inference, the `reward_model` MFC): the reward model's score of each response, at
  its last token; re-tokenized first when the reward model's tokenizer is not the policy's;
- `combine_reward` (compute): the reward that trains, `rl_config.reward_weights`' sum of the model's and
  the rule's scores; its metrics give each source's mean beside the sum;
- `reward_train` (train_step, reward modeling's `rm_train`): optimizer steps of the Bradley-Terry loss on
  preference pairs.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..algorithms import bradley_terry_loss, combine_rewards, preference_accuracy, preference_margin
from . import compute as C
from .impls import Forward, Impl, PolicyTrain, compute_count, rows_per_get


# ------------------------------------------------------------------------------------------------ the math
def reward_model_score(batch: dict, rows: list[int], *, engine, micro_batch_size: int,
                       retokenize: Callable | None = None) -> C.Output:
    """One score per row (a [1] tensor) from the reward model; `retokenize(prompts, responses)` first when
    the reward model reads other token ids than the policy's."""
    prompts, responses = batch["prompts"], batch["responses"]
    if retokenize is not None:
        prompts, responses = retokenize(prompts, responses)
    scores = engine.scores(prompts, responses, micro_batch_size)
    t = C.as_scalars(scores)
    return C.Output({"model_scores": C.scalar_rows(t)},
                    {"model_score_sum": float(t.sum()), "model_score_rows": float(len(rows))})


def combine_reward(batch: dict, rows: list[int], *, weights: dict) -> C.Output:
    """`rm_scores` = the weighted sum of `model_scores` and (when the graph has a rule) `rule_scores`.

    Metrics: `reward_sum`/`reward_rows`/`reward_max_count` of the sum (the driver's `reward/mean`), and
    `model_reward_sum`, `rule_reward_sum` of each source alone, whatever its weight."""
    scores = {"model": C.as_scalars(batch["model_scores"])}
    if "rule_scores" in batch:
        scores["rule"] = C.as_scalars(batch["rule_scores"])
    total = combine_rewards(scores, weights)
    metrics = {"reward_sum": float(total.sum()), "reward_rows": float(len(rows)),
               "reward_max_count": float((total >= 1.0).sum())}
    for source, t in scores.items():
        metrics[f"{source}_reward_sum"] = float(t.sum())
    return C.Output({"rm_scores": C.scalar_rows(total)}, metrics)


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


# ------------------------------------------------------------------------------------------------ tokenizers
@functools.lru_cache(maxsize=8)
def _tokenizer(path: str):
    from ..models import load_tokenizer
    return load_tokenizer(path)


@functools.lru_cache(maxsize=8)
def retokenizer(policy_path: str, reward_path: str) -> Callable | None:
    """`retokenize(prompts, responses)` from the policy's tokenizer to the reward model's, or None when the two
    give the same ids (then the reward model reads the policy's ids directly)."""
    from ..models.reward import retokenize, same_tokenizer
    source, target = _tokenizer(policy_path), _tokenizer(reward_path)
    if same_tokenizer(source, target):
        return None
    return functools.partial(_retokenize, retokenize, source, target)


def _retokenize(fn, source, target, prompts: Sequence, responses: Sequence):
    return fn(prompts, responses, source, target)


# ------------------------------------------------------------------------------------------------ impls
@C.compute_step("reward_model_score", "inference", ("prompts", "responses"), ("model_scores",), engine="reward",
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


@C.compute_step("combine_reward", "compute", ("model_scores",), ("rm_scores",), optional=("rule_scores",),
                doc="rl_config.reward_weights' sum of the reward model's and the rule reward's scores")
class CombineReward(Impl):
    """rl_config.reward_weights over the model's and the rule's scores."""

    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc), "weights": dict(cfg.rl_config.reward_weights)}

    def __call__(self, batch, rows):
        return combine_reward(batch, rows, weights=self.args["weights"])


@C.compute_step("reward_train", "train_step", ("prompts", "chosen", "rejected"), engine="reward",
                doc="Bradley-Terry loss of the reward model on preference pairs (reward modeling)")
class RewardTrain(PolicyTrain):
    """Optimizer steps of the Bradley-Terry loss over preference pairs (`reward_model` section's sizes)."""
    section = "reward_model"

    @classmethod
    def sizes(cls, cfg, info) -> dict:
        from ..config.sizes import train_sizes
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
    from ..models.reward import save_reward_weights
    state: dict[str, torch.Tensor] = {}
    for bucket in engine.export_weights(256 << 20):
        if rank == 0:
            state.update((name, t.detach().to("cpu", copy=True)) for name, t in bucket)
    if rank != 0:
        return None
    pad = getattr(engine, "pad_token_id", None)
    return str(save_reward_weights(state, model_path, pad, tokenizer, directory))
