"""What may change between a run and its resume.

A checkpoint keeps the config it was saved with. A resume that changes a key the saved state depends
on (the data order, the rows in flight, the model the weights belong to) would silently train
something else: the loader's position means nothing for another dataset or seed, in-flight steps of
a larger staleness were skipped, a checkpoint of another model failed late with a size-mismatch dump.
So such changes are refused before Ray starts, each named with its old and new value. Other keys
(learning rate, timeouts, logging, total_steps, ...) may change, as verl and HF allow, and are listed
once so the user sees what differs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from ..config import Config, ConfigError

# Keys whose change makes the checkpoint mean something else. `rl_config.max_weight_staleness` is
# handled apart (`staleness_change`): a change the dock slots can hold is carried out.
FIXED_KEYS = (
    "rl_config.algorithm", "rl_config.n_samples_per_prompt", "rl_config.prompts_per_step", "rl_config.reward_fn",
    "trainer.seed",
    "data.dataset", "data.num_digits", "data.size", "data.prompt_key", "data.answer_key", "data.max_prompt_length",
    "data.shuffle", "data.chat_template",
    "actor_config.model_path", "actor_config.backend", "ref_config.model_path", "critic_config.model_path",
)
IGNORED_KEYS = ("trainer.resume", "trainer.overwrite", "trainer.dry_run")


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass as {"section.key": value}."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def _get(flat: dict[str, Any], key: str) -> Any:
    return flat.get(key, "<absent>")


def config_changes(saved: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key that differs, in the schema's order."""
    old, cur = flatten(saved), flatten(new)
    return [(k, _get(old, k), _get(cur, k)) for k in list(cur) + [k for k in old if k not in cur]
            if k not in IGNORED_KEYS and _get(old, k) != _get(cur, k)]


def check_resume(saved: Config | None, new: Config, step: int, in_flight: Iterable[int], path: str) -> list[str]:
    """Refuse (ConfigError) a resume whose config changes what the checkpoint at `step` depends on;
    return notes on the keys that changed and are allowed."""
    if saved is None or not dataclasses.is_dataclass(saved):
        return []
    changes = config_changes(saved, new)
    refused = [f"{k}: {old!r} at the checkpoint, {cur!r} now" for k, old, cur in changes if k in FIXED_KEYS]
    staleness = staleness_problem(saved.rl_config.max_weight_staleness, new.rl_config.max_weight_staleness,
                                  sorted(in_flight), step)
    if staleness:
        refused.append(staleness)
    if refused:
        raise ConfigError(f"trainer.resume=true from {path} changes what the checkpoint depends on: "
                          + "; ".join(refused) + ". Resume with the saved values (set them back on the command "
                          "line), or start a new run in another trainer.output_dir")
    allowed = [f"{k} {old!r} -> {cur!r}" for k, old, cur in changes
               if k not in FIXED_KEYS and k != "rl_config.max_weight_staleness"]
    if saved.rl_config.max_weight_staleness != new.rl_config.max_weight_staleness:
        allowed.append(f"rl_config.max_weight_staleness {saved.rl_config.max_weight_staleness} -> "
                       f"{new.rl_config.max_weight_staleness} (the steps in flight at the checkpoint are trained as "
                       "they were generated)")
    return allowed


def staleness_problem(saved_k: int, new_k: int, in_flight: list[int], step: int) -> str | None:
    """Why the steps in flight at the checkpoint cannot continue under staleness `new_k`, or None.

    With staleness k the trainer keeps k + 1 docks, step s in dock s % (k + 1); the checkpoint holds
    the steps `in_flight` (launched, not trained). They continue when the new docks give each its own
    slot, i.e. when the number of steps held at once (those in flight, and `step` itself) fits in
    new_k + 1. A larger staleness always fits; a smaller one fits only if few steps were in flight.
    """
    if saved_k == new_k:
        return None
    held = len(set(in_flight) | {step}) if in_flight else 0
    if held <= new_k + 1:
        return None
    return (f"rl_config.max_weight_staleness: {saved_k} at the checkpoint, {new_k} now, but {len(in_flight)} steps "
            f"({in_flight[0]}..{in_flight[-1]}) were in flight at step {step} and need "
            f"max_weight_staleness >= {held - 1} to be trained rather than skipped")
