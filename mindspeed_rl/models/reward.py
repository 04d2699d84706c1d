"""Reward models: one-label sequence classifiers (`AutoModelForSequenceClassification`, num_labels=1).

* `check_reward_model(key, path)`: refuses, before any worker starts, a path that is not a checkpoint
  or holds a model that is not a one-label sequence classifier, naming the config key.
* `load_reward_model(path, dtype)`: a trained reward model, to score with.
* `init_reward_model(path, dtype, pad_token_id)`: the model to train: a reward model as it is, or a
  causal LM's backbone with a fresh one-label head (OpenRLHF's and verl's way of starting one).
* `save_reward_model(model, tokenizer, directory)`: a plain HF checkpoint (safetensors, tokenizer files).
* `retokenize(...)`: prompt and response ids of the policy's tokenizer re-encoded for a reward model with
  a tokenizer of its own: decoded to text, rendered by the reward model's chat template when it has one
  (a user turn and an assistant turn, as verl switches templates), else the two texts one after the other.
* `same_tokenizer(a, b)`: do two tokenizers give the same ids (then the reward model reads the policy's
  ids directly)?
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .checkpoint import BUILTIN_PREFIX, check_model_path, is_builtin, resolve_model_path

CLASSIFIER_SUFFIX = "ForSequenceClassification"


def _num_labels(config: dict) -> int:
    if "num_labels" in config:
        return int(config["num_labels"])
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    return 2  # transformers' PretrainedConfig default


def describe_model(path: str | Path) -> tuple[list[str], int]:
    """(architectures, num_labels) of the checkpoint at `path` (from its config.json)."""
    config = json.loads((Path(resolve_model_path(str(path))) / "config.json").read_text())
    return list(config.get("architectures") or []), _num_labels(config)


def check_reward_model(key: str, path: str | None, trainable_from_lm: bool = False) -> None:
    """Raise ValueError naming `key` when `path` is no checkpoint, or not a one-label sequence classifier.

    `trainable_from_lm`: a causal LM (or the built-in tiny model) is also accepted: reward modeling starts
    from it with a fresh head."""
    if not path:
        raise ValueError(f"{key} is empty; set it to a reward model: a local HF checkpoint of a one-label "
                         f"sequence classifier (e.g. <trainer.output_dir>/final of cli/train_rm.py)")
    check_model_path(key, path)
    if is_builtin(path):
        if trainable_from_lm:
            return
        raise ValueError(f"{key}={path!r}: a built-in model is a causal LM, not a reward model (a one-label "
                         f"sequence classifier); train one with `python cli/train_rm.py --config-name rm_tiny "
                         f"trainer.output_dir=D` and set {key}=D/final")
    archs, labels = describe_model(path)
    classifier = [a for a in archs if a.endswith(CLASSIFIER_SUFFIX)]
    if classifier and labels == 1:
        return
    if trainable_from_lm and any(a.endswith("ForCausalLM") for a in archs):
        return
    if classifier:
        raise ValueError(f"{key}={path!r}: {classifier[0]} with {labels} labels; a reward model has one label "
                         f"(num_labels=1: one score per sequence)")
    raise ValueError(f"{key}={path!r}: architectures {archs or '(none in config.json)'} is not a sequence "
                     f"classifier; a reward model is an AutoModelForSequenceClassification with num_labels=1"
                     + ("" if trainable_from_lm else " (train one with cli/train_rm.py)"))


def load_reward_model(path: str, dtype: str = "float32", pad_token_id: int | None = None):
    """A one-label sequence classifier from `path` (refused otherwise, naming the path)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    check_reward_model("reward_model.model_path", path)
    model = AutoModelForSequenceClassification.from_pretrained(str(resolve_model_path(path)),
                                                               dtype=getattr(torch, dtype))
    if pad_token_id is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = int(pad_token_id)
    return model


def init_reward_model(path: str, dtype: str = "float32", pad_token_id: int | None = None):
    """The reward model to train: `path` itself when it is one, else its backbone with a fresh one-label
    head (initialized from torch's seed; the checkpoint's LM head is dropped)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    check_reward_model("reward_model.model_path", path, trainable_from_lm=True)
    directory = str(resolve_model_path(path))
    config = AutoConfig.from_pretrained(directory, num_labels=1)
    config.architectures = [type_name(config)]
    if pad_token_id is not None:
        config.pad_token_id = int(pad_token_id)
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were not initialized: score.weight": that is the point
    try:
        return AutoModelForSequenceClassification.from_pretrained(directory, config=config, dtype=getattr(torch, dtype))
    finally:
        hf_logging.set_verbosity(level)


def type_name(config) -> str:
    """The sequence-classifier class name of a config's model type (Qwen2 -> Qwen2ForSequenceClassification)."""
    from transformers import AutoModelForSequenceClassification
    return AutoModelForSequenceClassification._model_mapping[type(config)].__name__


def save_reward_model(model, tokenizer, directory: str | Path) -> Path:
    """`model` (num_labels=1) and `tokenizer` as a plain HF checkpoint in `directory`, written to a
    temporary directory first and renamed (a crash leaves no half checkpoint). Parameters that share
    one storage (a flattened engine's) are saved from copies: safetensors refuses shared storage."""
    import shutil

    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().clone().contiguous().cpu() for k, v in model.state_dict().items()}
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


# ------------------------------------------------------------------ tokenizers
def same_tokenizer(a, b) -> bool:
    """Do `a` and `b` map text to the same ids (same vocabulary and the same pad and eos ids)?"""
    if a is b:
        return True
    return (a.get_vocab() == b.get_vocab() and a.pad_token_id == b.pad_token_id
            and a.eos_token_id == b.eos_token_id)


def retokenize(prompts: Sequence, responses: Sequence, source, target) -> tuple[list, list]:
    """Prompt and response ids of tokenizer `source` as the reward model's tokenizer `target` encodes them.

    Each prompt and response is decoded without special tokens. With a chat template `target` renders
    [user: prompt, assistant: response]; the prompt part is the rendering of the user turn with the
    generation prompt, the response part what the full rendering adds after it (all of it goes in the
    prompt part when the template does not render the user turn as a prefix). Without one, the prompt
    text and the response text are encoded one after the other. Returns two lists of int64 tensors."""
    import torch

    def ids(text: str) -> list[int]:
        return target(text, add_special_tokens=False)["input_ids"]

    p_text = source.batch_decode([torch.as_tensor(p).tolist() for p in prompts], skip_special_tokens=True)
    r_text = source.batch_decode([torch.as_tensor(r).tolist() for r in responses], skip_special_tokens=True)
    out_p, out_r = [], []
    template = getattr(target, "chat_template", None)
    for p, r in zip(p_text, r_text):
        if template:
            head = target.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True)
            full = target.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                              tokenize=False)
            if full.startswith(head):
                pi, ri = ids(head), ids(full[len(head):])
            else:
                pi, ri = ids(full), []
        else:
            pi, ri = ids(p), ids(r)
        if not pi and not ri:
            pi = [target.eos_token_id if target.eos_token_id is not None else 0]
        if not pi:  # the engine's layout wants a prompt token: move the first response token over
            pi, ri = ri[:1], ri[1:]
        out_p.append(torch.tensor(pi, dtype=torch.int64))
        out_r.append(torch.tensor(ri, dtype=torch.int64))
    return out_p, out_r


__all__ = ["BUILTIN_PREFIX", "check_reward_model", "describe_model", "init_reward_model", "load_reward_model",
           "retokenize", "same_tokenizer", "save_reward_model"]


def save_reward_weights(state: dict, model_path: str, pad_token_id: int | None, tokenizer, directory: str | Path) -> Path:
    """Weights by HF name (a trained engine's export) as a one-label classifier checkpoint in `directory`: the
    architecture of `model_path` (a reward model, or the causal LM reward modeling started from) with one label.
    A weight the classifier needs but `state` lacks is refused, naming it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(resolve_model_path(model_path)), num_labels=1)
    config.architectures = [type_name(config)]
    if pad_token_id is not None:
        config.pad_token_id = int(pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"saving the reward model to {directory}: the exported weights do not fit "
                         f"{config.architectures[0]} (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return save_reward_model(model, tokenizer, directory)
