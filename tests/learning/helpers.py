"""What the learning checks share: a config of configs/ run in-process on the session's Ray for a shortened
number of steps, and the 10-step mean reward it ends at.

Every check names its config, its seed, its step count and its threshold; the thresholds come from the
5-seed spreads in the docs (benchmarks/seed_spread.py, the command beside each table). The runs are
deterministic per seed (`rl_config.guarantee_order: true`), so on the machine the spread was measured on a
check reproduces its seed's number exactly; the margin under the lowest seed is for other CPUs, whose
float rounding takes other trajectories.

`MINDSPEED_RL_LEARNS_OVERRIDES="actor_config.lr=1e-12"` (space-separated `key=value`, YAML values) is
applied last to every run: with a learning rate of (almost) 0 every check must fail, which shows each one can
fail (the reward model's check: `reward_model.lr=1e-12` beside it). The config refuses lr=0 itself, and AdamW
at 1e-12 moves each weight by about 1e-12 a step.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import yaml

from mindspeed_rl.config import config_from_dict

REPO = Path(__file__).resolve().parents[2]
ENV = "MINDSPEED_RL_LEARNS_OVERRIDES"
# What a person watching needs, checkpoints and the HF export: off in every check (what is checked is the reward).
QUIET = {"trainer.progress": False, "trainer.logger": ["jsonl"], "trainer.plot": False, "trainer.dashboard": False,
         "trainer.report": False, "trainer.save_interval": 0, "trainer.save_hf": "never"}


def env_overrides() -> dict:
    out = {}
    for item in os.environ.get(ENV, "").split():
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{ENV}: {item!r} is not key=value")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML 1.1 reads 1e-12 (no dot) as a string
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        out[key] = parsed
    return out


def config_dict(name: str, overrides: dict) -> dict:
    """configs/<name>.yaml with dotted overrides, the quiet keys and the environment's overrides applied."""
    d = copy.deepcopy(yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text()))
    for dotted, value in {**QUIET, **overrides, **env_overrides()}.items():
        *parents, last = dotted.split(".")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return d


def train(name: str, out: Path, steps: int, **overrides) -> list[dict]:
    """Run configs/<name>.yaml for `steps` steps into `out` (seed: the config's, 1, unless overridden) and
    return the records of its metrics.jsonl."""
    from mindspeed_rl.trainer import Trainer
    cfg = config_from_dict(config_dict(name, {"trainer.total_steps": steps, "trainer.output_dir": str(out),
                                              **overrides}))
    Trainer(cfg).run()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last10(records: list[dict], key: str = "reward/mean") -> float:
    values = [r[key] for r in records if key in r]
    assert values, f"no record holds {key}"
    return sum(values[-10:]) / len(values[-10:])
