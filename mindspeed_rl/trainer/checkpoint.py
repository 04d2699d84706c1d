"""Driver-side checkpoint state, the `latest` pointer, and pruning old checkpoints.

A checkpoint directory is complete before `latest` points at it (the pointer is written last,
atomically), so a crash while saving leaves the previous checkpoint the one a resume uses.
Pruning (`trainer.keep_checkpoints`) runs only after that, and deletes only complete directories
older than the one `latest` points to: never the pointed-to one, never one still being written.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")

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


def read_latest(output_dir: str) -> dict | None:
    """`{"step", "path"}` of the checkpoint `latest.json` points to (path made absolute), or None.

    Reads only the pointer: cheap enough for a message printed while the run stops.
    """
    pointer = Path(output_dir) / "checkpoints" / "latest.json"
    try:
        info = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return None
    return {"step": int(info["step"]), "path": str(pointer.parent / info["path"])}


def prune_checkpoints(output_dir: str, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0: keep all); returns what was deleted.

    Called after `mark_latest`, so the newest checkpoint is complete before an older one goes.
    Only directories older than the one `latest.json` points to are candidates, and only complete
    ones (`trainer_state.pt` is written last): a newer directory may still be being written, and an
    incomplete older one is not counted as a checkpoint one could resume from.
    """
    if keep <= 0:
        return []
    root = Path(output_dir) / "checkpoints"
    latest = read_latest(output_dir)
    if latest is None:
        return []
    pointed = Path(latest["path"]).name
    complete = sorted((int(m.group(1)), d) for d in root.iterdir() if d.is_dir()
                      for m in [STEP_DIR.match(d.name)] if m and (d / "trainer_state.pt").is_file())
    newest_first = [d for step, d in reversed(complete) if step <= latest["step"]]
    kept = [d for d in newest_first if d.name == pointed] + [d for d in newest_first if d.name != pointed]
    deleted = []
    for d in kept[keep:]:
        try:
            shutil.rmtree(d)
        except OSError as e:  # the run goes on; the disk fills more slowly than a crash costs
            warnings.warn(f"trainer.keep_checkpoints: could not delete {d}: {e}", RuntimeWarning, stacklevel=2)
            continue
        deleted.append(d)
    return deleted
