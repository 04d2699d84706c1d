"""One place for a run's files: every node that hosts a worker sees the driver's output directory.

Workers write their checkpoint parts (engine state, DCP shards, RNG state) and the policy's Hugging Face
export under `trainer.output_dir`, the driver its own parts and `latest.json` beside them. On a Ray cluster
whose machines do not share that directory (no shared filesystem, or one mounted at another path) those
parts land on different disks: the export's `hf/final` fails after the last step, and a resume finds half
a checkpoint. So before any model loads, the driver writes a token file there and each worker reads it
back; a node that cannot stops the run (exit 2) naming the nodes and the fix.

`trainer.output_dir` is made absolute on the driver first: a relative one would otherwise resolve against
the directory each node's `ray start` ran in.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

from ..config import Config, ConfigError

TOKEN_FILE = ".run-token"


def with_absolute_output_dir(cfg: Config) -> Config:
    """`cfg` with trainer.output_dir resolved against the driver's working directory."""
    out = os.path.abspath(os.path.expanduser(cfg.trainer.output_dir))
    if out == cfg.trainer.output_dir:
        return cfg
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=out))


def write_token(output_dir: str) -> str:
    """A fresh token in `<output_dir>/.run-token`, for the workers to read back."""
    token = uuid.uuid4().hex
    path = Path(output_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}")
    tmp.write_text(token)
    os.replace(tmp, path)
    return token


def sees_token(output_dir: str, token: str) -> bool:
    """Whether this process reads `token` in `<output_dir>/.run-token` (what a worker answers)."""
    try:
        return (Path(output_dir) / TOKEN_FILE).read_text() == token
    except OSError:
        return False


def check_seen(output_dir: str, answers: list[tuple[str, dict]]) -> None:
    """answers: (group/rank, its ping info with `seen`) per worker; refuse naming every node that does not see
    the driver's output directory."""
    blind: dict[str, list[str]] = {}
    for who, info in answers:
        if not info["seen"]:
            blind.setdefault(f"{info.get('host', '?')} (node {str(info.get('node_id', '?'))[:12]})", []).append(who)
    if blind:
        nodes = "; ".join(f"{node}: {', '.join(ws)}" for node, ws in blind.items())
        raise ConfigError(
            f"trainer.output_dir={output_dir}: the workers on {len(blind)} node(s) do not see the driver's output "
            f"directory ({nodes}), so their checkpoint parts and the Hugging Face export would land on their own "
            "disks; put trainer.output_dir on a filesystem every node mounts at the same path (NFS, a cluster "
            "filesystem), or run on one node")
