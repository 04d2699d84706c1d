"""What the trainer does differently when its graph is reward modeling (`rl_config.algorithm:
reward_modeling`, `cli/train_rm.py`): nothing in the step, which is the graph's one `rm_train` MFC run
by the same loop as any algorithm; only the data and what happens between steps.

- `make_loader`: the dataset is preference pairs (`data/preferences.py`), of which `data.eval_size` are
  held out; an RL graph keeps the prompt loader.
- `Evaluation`: every `trainer.eval_interval` steps and after the last one, the trained reward model
  scores the held-out pairs (on every rank of its group, so a sharded engine's forwards stay collective)
  and the record gets `eval/accuracy` (chosen scored above rejected) and `eval/margin`.
- `save_final`: after the last step the model is written as a plain Hugging Face checkpoint (a one-label
  `...ForSequenceClassification` and its tokenizer) to `<trainer.output_dir>/final`: what
  `reward_model.model_path` of an RL run reads.
"""
from __future__ import annotations

import os
from typing import Any

REWARD = "reward"   # the reward model's model name in the graphs (dataflow/options.py, reward_modeling.py)
FINAL = "final"


def trains_reward_model(plan) -> bool:
    return REWARD in plan.trained


def make_loader(cfg, plan, tokenizer) -> tuple[Any, Any]:
    """(the step's loader, the held-out preference pairs or None)."""
    d, t = cfg.data, cfg.trainer
    if trains_reward_model(plan):
        from ..data.preferences import PreferenceLoader, load_preference_dataset, split_held_out
        pairs = load_preference_dataset(d.dataset, d.prompt_key, d.chosen_key, d.rejected_key, d.num_digits,
                                        d.size, t.seed)
        train, held = split_held_out(pairs, d.eval_size, t.seed)
        loader = PreferenceLoader(train, tokenizer, cfg.rl_config.prompts_per_step, seed=t.seed, shuffle=d.shuffle,
                                  max_prompt_length=d.max_prompt_length, apply_chat_template=d.chat_template)
        return loader, held
    from ..data.loader import PromptLoader
    from .validation import load_train_dataset
    dataset = load_train_dataset(cfg)
    return PromptLoader(dataset, tokenizer, cfg.rl_config.prompts_per_step, seed=t.seed, shuffle=d.shuffle,
                        max_prompt_length=d.max_prompt_length, apply_chat_template=d.chat_template), None


class Evaluation:
    """Held-out accuracy and margin of the reward model being trained."""

    def __init__(self, trainer, held, tokenizer):
        from ..data.preferences import encode_pairs
        self.trainer = trainer
        cfg = trainer.cfg
        self.interval, self.total = cfg.trainer.eval_interval, cfg.trainer.total_steps
        self.micro = cfg.reward_model.micro_batch_size_per_device
        self.columns = None
        if held is not None and len(held):
            columns, _ = encode_pairs(tokenizer, held.records, cfg.data.chat_template, cfg.data.max_prompt_length)
            self.columns = {k: [x.tolist() for x in v] for k, v in columns.items()}

    def due(self, step: int) -> bool:
        done = step + 1
        return self.columns is not None and (done == self.total or bool(self.interval and done % self.interval == 0))

    def __call__(self, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        from ..algorithms import preference_accuracy, preference_margin
        import torch
        tr = self.trainer
        workers = tr.workers[tr.plan.group_of(tr.plan.trained[REWARD])]
        out = tr.collect([w.score_pairs.remote(REWARD, self.columns, self.micro) for w in workers],
                         "evaluating the reward model on the held-out pairs")[0]
        chosen, rejected = torch.tensor(out["chosen"]), torch.tensor(out["rejected"])
        return {"eval/accuracy": preference_accuracy(chosen, rejected), "eval/margin": preference_margin(chosen, rejected),
                "eval/pairs": float(len(chosen))}


def save_final(trainer) -> str:
    """The trained reward model as a plain HF checkpoint in <trainer.output_dir>/final (every rank of its group
    takes part in gathering the weights; rank 0 writes)."""
    tr = trainer
    directory = os.path.join(tr.cfg.trainer.output_dir, FINAL)
    workers = tr.workers[tr.plan.group_of(tr.plan.trained[REWARD])]
    tr.collect([w.save_pretrained.remote(REWARD, directory) for w in workers],
               f"saving the reward model to {directory}")
    return directory
