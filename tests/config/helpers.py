"""Shared helpers: the default config as a plain dict, dotted overrides, and the error a config raises."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from mindspeed_rl.config import ConfigError, config_from_dict, check_config
from mindspeed_rl.planning import make_plan

REPO = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "configs" / "grpo_tiny.yaml"
DOCS = REPO / "docs" / "configs.md"

_BASE = yaml.safe_load(DEFAULT_YAML.read_text())


def base_dict() -> dict:
    """configs/grpo_tiny.yaml as a plain dict (including Hydra's `defaults`/`hydra`, which loading ignores)."""
    return copy.deepcopy(_BASE)


def with_overrides(overrides: dict[str, Any]) -> dict:
    """The default config with `{"section.key": value}` overrides applied (nested dicts created as needed)."""
    d = base_dict()
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = d
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[last] = value
    return d


def run_stage(overrides: dict[str, Any], stage: str, check_files: bool = True) -> None:
    """load: config_from_dict only; validate: + check_config; plan: + make_plan."""
    cfg = config_from_dict(with_overrides(overrides))
    if stage == "validate":
        check_config(cfg)
    elif stage == "plan":
        make_plan(cfg, check_files=check_files)
    elif stage != "load":
        raise AssertionError(stage)


def error_of(overrides: dict[str, Any], stage: str, check_files: bool = True) -> str:
    """The ConfigError message `overrides` produce at `stage` (fails the test when there is none)."""
    try:
        run_stage(overrides, stage, check_files)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{overrides} raised no ConfigError at stage {stage!r}")
