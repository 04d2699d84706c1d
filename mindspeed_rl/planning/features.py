"""What each model's own config section asks of the engine that runs it, and whether its backend can.

Token budgets, activation checkpointing, LoRA and offload are properties of a model (the actor's, the
critic's, the reference's section says them), not of a backend; a backend says which of them its engines
implement (`Backend.model_features`). The plan checks each model of each worker group against the backend
that runs it there (a split group runs on the mesh backend, whatever `actor_config.backend` says), before any
worker starts; the worker's engine declaration carries the same values into `TrainSpec`. LoRA's target
modules are checked here too, against the policy's layers as its config.json describes them.
"""
from __future__ import annotations

import dataclasses

from ..config import ActorConfig, ConfigError, TrainerConfig
from ..models.checkpoint import read_config
from .keys import GROUPS_KEY, LORA_RANK_KEY, SECTION_OF, TOKEN_BUDGET_KEY
from .models import ModelSections


def _offload(o) -> dict | None:
    values = dataclasses.asdict(o)
    return values if any(values.values()) else None


def features_of(models: ModelSections, model: str, trained: bool) -> dict:
    """The `TrainSpec` model features (engines.base.MODEL_FEATURES) of `model`'s engine, only those set: a
    trained engine of the actor or critic takes all its section's; an inference engine (the reference, a
    reader of a model trained in another group) the token budget, and the reference its offload."""
    a, c = models.actor, models.critic
    out: dict = {}
    if model in ("actor", "ref"):
        if a.max_tokens_per_micro_batch:
            out["max_tokens_per_micro_batch"] = a.max_tokens_per_micro_batch
        if model == "ref" and models.ref.offload:
            out["offload"] = {"params": True, "optimizer": False, "fsdp_cpu_offload": False}
        if model == "actor" and trained:
            if a.gradient_checkpointing:
                out["gradient_checkpointing"] = True
            if a.lora.rank:
                out["lora"] = dataclasses.asdict(a.lora)
            if _offload(a.offload):
                out["offload"] = _offload(a.offload)
    elif model == "critic":
        if c.max_tokens_per_micro_batch:
            out["max_tokens_per_micro_batch"] = c.max_tokens_per_micro_batch
        if trained:
            if c.gradient_checkpointing:
                out["gradient_checkpointing"] = True
            if _offload(c.offload):
                out["offload"] = _offload(c.offload)
    return out


def _key(model: str, feature: str, trained: bool) -> str:
    """The key that sets a feature of a model: the reference takes the actor's token budget and LoRA is the
    actor's."""
    if model == "ref" and feature == "max_tokens_per_micro_batch":
        return TOKEN_BUDGET_KEY
    if feature == "lora":
        return LORA_RANK_KEY
    return f"{SECTION_OF.get(model, model)}.{feature}"


def check_features(models: ModelSections, group: str, backend, trained_here: dict[str, bool],
                   device: str = "auto") -> None:
    """Refuse a feature that `backend` (the registry row running worker group `group`) does not implement, for
    each of the group's models (`trained_here`: {model: trained here}), naming the key, its value, the backend and the
    backends that do; and offload on a group whose `device` is the CPU, where there is no device memory to
    give back (the host is where offload would move the state to)."""
    from ..engines.registry import TRAIN_BACKENDS
    for model, trained in sorted(trained_here.items()):
        for feature, value in features_of(models, model, trained).items():
            if feature == "offload" and device == "cpu":
                shown = "true" if model == "ref" else {k: v for k, v in value.items() if v}
                raise ConfigError(f"{_key(model, feature, trained)}={shown}: worker group '{group}' runs on the cpu, "
                                  "so there is no device memory to free: offload moves a model's state from an "
                                  "accelerator to host memory; turn it off, or put the group on a gpu or npu "
                                  f"({GROUPS_KEY}.{group}.device, or placement.device_kind in mode mesh)")
            if feature in backend.model_features:
                continue
            able = [b.name for b in TRAIN_BACKENDS.values() if b.user and feature in b.model_features]
            shown = value.get("rank") if feature == "lora" else ({k: v for k, v in value.items() if v}
                                                                   if feature == "offload" else value)
            split = (f" (worker group '{group}' splits its model, tp or pp > 1, so it runs on the {backend.name} "
                     f"backend)" if not backend.user else "")
            raise ConfigError(f"{_key(model, feature, trained)}={shown}: the {backend.name} train backend does not "
                              f"implement {feature}{split}; backends that do: {able}; turn it off or use one of them")


def check_lora_targets(actor: ActorConfig, trainer: TrainerConfig, model_paths: dict[str, str], trained) -> None:
    """actor_config.lora.target_modules against the policy's linear layers and lora.modules_to_save against its
    modules, before any worker starts, when its config.json is readable here (the model is built on the meta
    device: no weights read)."""
    lora = actor.lora
    if not lora.rank or "actor" not in trained or trainer.simulate_cost_s_per_row:
        return
    config = read_config(model_paths.get("actor", actor.model_path))
    if config is None:
        return
    from ..engines.train.lora import check_target_modules_of_config
    try:
        check_target_modules_of_config(config, lora.target_modules, lora.modules_to_save)
    except ValueError as e:
        raise ConfigError(str(e)) from None
