"""Which models the mesh backends (mesh_train.py, mesh_rollout.py) can split.

Their pipeline stages and tensor-parallel plan are written for the HF decoder-only layout of
Qwen2 and Llama (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`). Another architecture (GPT-2's `transformer.h`,
say) used to fail 49 s into a run, inside a worker, with `'GPT2Model' object has no attribute
'embed_tokens'`; the plan now asks `check_model` first (`Backend.check_model`).
"""
from __future__ import annotations

import json
from pathlib import Path

# HF `model_type`s whose modules have the layout above.
SPLITTABLE_MODEL_TYPES = ("qwen2", "llama", "mistral", "qwen3")


def check_model(model_path: str, device_type: str) -> None:
    """ValueError naming the model type and what would run it, when the mesh backends cannot split it."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader names an unreadable checkpoint itself
    kind = config.get("model_type")
    if kind not in SPLITTABLE_MODEL_TYPES:
        raise ValueError(f"its model_type {kind!r} is not one the mesh backends split (TP/PP placement needs one of "
                         f"{list(SPLITTABLE_MODEL_TYPES)}); use tp: 1 and pp: 1 for it (then actor_config.backend "
                         "runs it, e.g. fsdp or torch)")
