"""A run's output directory: one run at a time, and never over another run's results.

Why: `trainer.output_dir` has a default (`outputs/grpo_tiny`), so running the same command twice
would cut the first run's `metrics.jsonl` to the second's steps and leave its newer checkpoints
beside the second run's, where pruning never reaches them; two runs at once would interleave both.
Hugging Face's Trainer refuses a non-empty output directory unless told to overwrite it
(`overwrite_output_dir`); we do the same, before Ray starts:

- a fresh run (`trainer.resume=false`) in a directory that holds a previous run's results (its
  `metrics.jsonl` or checkpoints) is refused with exit 2, naming what is there and the three ways on:
  resume it, choose another `trainer.output_dir`, or `trainer.overwrite=true`, which deletes those
  results (only the files a run writes) first;
- a running run holds an exclusive `flock` on `<output_dir>/.lock` (released by the kernel when the
  process ends, also by kill -9), so a second run on the same directory is refused, naming the first's
  pid;
- an output directory that cannot be created or written is refused at once, not after Ray started.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

from ..config import ConfigError

LOCK_NAME = ".lock"
# What a run writes into its output directory (trainer.overwrite=true deletes exactly these).
RUN_FILES = ("metrics.jsonl", "curve.png", "report.html", "dashboard.json", "plan.json")
RUN_DIRS = ("checkpoints", "tensorboard", "hf", "wandb", "mlruns", "samples")


class RunDirectory:
    """The lock on one output directory, held from before Ray starts until the run ends."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create the directory, check it is writable, and take its lock; ConfigError otherwise."""
        key = f"trainer.output_dir={str(self.path)!r}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{key}: cannot create or write it ({e.strerror or e}); choose a directory you can "
                              "write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"{key}: another run ({holder}) is using this directory; wait for it to end, or "
                              "choose another trainer.output_dir") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                     .encode())
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"{key}: cannot write into it ({e.strerror or e}); choose a directory you can write "
                              "to, with free space") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"


def previous_results(output_dir: str) -> list[str]:
    """What an earlier run left in `output_dir` that a fresh run would overwrite (empty: nothing)."""
    root = Path(output_dir)
    found = []
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())
        found.append(f"metrics.jsonl with {lines} steps")
    ckpts = root / "checkpoints"
    if ckpts.is_dir():
        steps = sorted(d.name for d in ckpts.iterdir() if d.is_dir() and d.name.startswith("step_"))
        if steps:
            found.append(f"checkpoints {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"checkpoint {steps[0]}")
    return found


def refuse_or_clear_previous(output_dir: str, overwrite: bool) -> None:
    """A fresh run: refuse an output directory holding a previous run's results (ConfigError), or,
    with `trainer.overwrite=true`, delete exactly the files and folders a run writes."""
    found = previous_results(output_dir)
    if not found:
        return
    if not overwrite:
        raise ConfigError(f"trainer.output_dir={output_dir!r} holds a previous run ({', '.join(found)}); a new run "
                          "would overwrite it: resume it with trainer.resume=true, choose another trainer.output_dir, "
                          "or set trainer.overwrite=true to delete those results first")
    root = Path(output_dir)
    for name in RUN_FILES:
        (root / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(root / name, ignore_errors=True)
