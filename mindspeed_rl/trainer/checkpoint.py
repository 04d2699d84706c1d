"""Driver-side checkpoint state and the `latest` pointer.

A checkpoint directory is complete before `latest` points at it (the pointer is written last,
atomically), so a crash while saving leaves the previous checkpoint the one a resume uses.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def checkpoint_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def save_driver_state(directory: Path, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / "trainer_state.pt.tmp")
    os.replace(directory / "trainer_state.pt.tmp", directory / "trainer_state.pt")


def mark_latest(output_dir: str, directory: Path, step: int) -> None:
    root = Path(output_dir) / "checkpoints"
    tmp = root / "latest.json.tmp"
    tmp.write_text(json.dumps({"step": step, "path": directory.name}))
    os.replace(tmp, root / "latest.json")


def latest_checkpoint(output_dir: str) -> tuple[Path, dict] | None:
    pointer = Path(output_dir) / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    info = json.loads(pointer.read_text())
    directory = pointer.parent / info["path"]
    return directory, torch.load(directory / "trainer_state.pt", weights_only=False)
