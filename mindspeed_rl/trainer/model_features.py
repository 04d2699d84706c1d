"""What each model's own config section asks of the engine that runs it, and whether its backend can.

Token budgets, activation checkpointing, LoRA and offload are properties of a model (the actor's, the
critic's, the reference's section says them), not of a backend; a backend says which of them its engines
implement (`Backend.model_features`). The plan checks each model of each worker group against the backend
that runs it there (a split group runs on the mesh backend, whatever `actor_config.backend` says), before any
worker starts; the worker's engine declaration carries the same values into `TrainSpec`.
"""
from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError

# model name (dataflow) -> its config section
SECTION_OF = {"actor": "actor_config", "ref": "ref_config", "critic": "critic_config"}


def _offload(o) -> dict | None:
    values = dataclasses.asdict(o)
    return values if any(values.values()) else None


def features_of(cfg: Config, model: str, trained: bool) -> dict:
    """The `TrainSpec` model features (engines.base.MODEL_FEATURES) of `model`'s engine, only those set: a
    trained engine of the actor or critic takes all its section's; an inference engine (the reference, a
    reader of a model trained in another group) the token budget, and the reference its offload."""
    a, c = cfg.actor_config, cfg.critic_config
    out: dict = {}
    if model in ("actor", "ref"):
        if a.max_tokens_per_micro_batch:
            out["max_tokens_per_micro_batch"] = a.max_tokens_per_micro_batch
        if model == "ref" and cfg.ref_config.offload:
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
    if model == "ref" and feature == "max_tokens_per_micro_batch":
        return "actor_config.max_tokens_per_micro_batch"
    if feature == "lora":
        return "actor_config.lora.rank"
    return f"{SECTION_OF.get(model, model)}.{feature}"


def check_features(cfg: Config, group: str, backend, models: dict[str, bool], device: str = "auto") -> None:
    """Refuse a feature that `backend` (the registry row running worker group `group`) does not implement, for
    each of the group's `models` ({model: trained here}), naming the key, its value, the backend and the
    backends that do; and offload on a group whose `device` is the CPU, where there is no device memory to
    give back (the host is where offload would move the state to)."""
    from ..engines.registry import TRAIN_BACKENDS
    for model, trained in sorted(models.items()):
        for feature, value in features_of(cfg, model, trained).items():
            if feature == "offload" and device == "cpu":
                shown = "true" if model == "ref" else {k: v for k, v in value.items() if v}
                raise ConfigError(f"{_key(model, feature, trained)}={shown}: worker group '{group}' runs on the cpu, "
                                  "so there is no device memory to free: offload moves a model's state from an "
                                  "accelerator to host memory; turn it off, or put the group on a gpu or npu "
                                  f"(placement.groups.{group}.device, or placement.device_kind in mode mesh)")
            if feature in backend.model_features:
                continue
            able = [b.name for b in TRAIN_BACKENDS.values() if b.user and feature in b.model_features]
            shown = value.get("rank") if feature == "lora" else ({k: v for k, v in value.items() if v}
                                                                   if feature == "offload" else value)
            split = (f" (worker group '{group}' splits its model, tp or pp > 1, so it runs on the {backend.name} "
                     f"backend)" if not backend.user else "")
            raise ConfigError(f"{_key(model, feature, trained)}={shown}: the {backend.name} train backend does not "
                              f"implement {feature}{split}; backends that do: {able}; turn it off or use one of them")
