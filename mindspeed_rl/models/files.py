"""Checkpoint files written and read so that a failure names the file, the cause and the fix.

Why a module of its own: the driver (`trainer_state.pt`), the train engines (`engine.pt`) and the
workers (`rng.pt`) all write with `torch.save` and read with `torch.load`, whose own errors say
`inline_container.cc:672 unexpected pos` for a full disk and `PytorchStreamReader failed` or
`invalid load key` for a damaged file, without naming the file. Every write goes to `<path>.tmp`
first and is renamed into place only when complete, and a failed write removes its `.tmp`, so a full
disk never leaves half a file where a resume would read it.
"""
from __future__ import annotations

import errno
import os
import shutil
import zipfile
from typing import Any

import torch

# A file bigger than this is checked by its zip directory only (a CRC pass reads every byte).
CRC_CHECK_MAX_BYTES = 4 * 2**30


class CheckpointFileError(RuntimeError):
    """A checkpoint file that cannot be written or read; the message names it and the fix."""


def _free_space(path: str) -> str:
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return "unknown"
    return f"{free / 2**20:.1f} MiB"


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's zip writer reports a short write as a RuntimeError (`unexpected pos`, `file write failed`)
    text = str(e)
    return "unexpected pos" in text or "file write failed" in text or "No space left" in text


def save_file(obj: Any, path: str) -> str:
    """`torch.save(obj, path)` through `<path>.tmp` and an atomic rename; a failed write leaves neither."""
    tmp = path + ".tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if _is_disk_full(e):
            raise CheckpointFileError(f"disk full while writing {path} ({_free_space(path)} free there): free space, "
                                      "lower trainer.keep_checkpoints, or point trainer.output_dir at a larger disk; "
                                      "the previous checkpoint is untouched") from None
        if isinstance(e, OSError):
            raise CheckpointFileError(f"cannot write {path}: {e.strerror or e}; check that trainer.output_dir is "
                                      "writable") from None
        raise
    return path


def load_file(path: str, map_location: Any = None, what: str = "checkpoint file") -> Any:
    """`torch.load(path)` whose failure names the file and the fix (damaged: resume from the one before)."""
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{what} {path} is missing: the checkpoint in {os.path.dirname(path)} is "
                                  "incomplete or was written by another backend or layout; delete that directory to "
                                  "resume from the previous checkpoint, or resume with the config it was saved with")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # torch.load's errors for damage: RuntimeError, UnpicklingError, EOFError, ...
        raise CheckpointFileError(damaged_message(path, what, e)) from None


def damaged_message(path: str, what: str, e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return (f"{what} {path} is damaged ({type(e).__name__}: {first}); delete its checkpoint directory "
            f"{os.path.dirname(path)} to resume from the previous checkpoint")


def check_file(path: str, what: str = "checkpoint file") -> None:
    """Cheap integrity check of a file `torch.save` wrote, without loading it: its zip directory opens
    and (up to CRC_CHECK_MAX_BYTES) every member's CRC matches. Raises CheckpointFileError."""
    if not os.path.isfile(path):
        load_file(path, what=what)  # raises the missing-file message
    try:
        with zipfile.ZipFile(path) as z:
            if os.path.getsize(path) <= CRC_CHECK_MAX_BYTES:
                bad = z.testzip()
                if bad is not None:
                    raise zipfile.BadZipFile(f"member {bad} fails its CRC check")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointFileError(damaged_message(path, what, e)) from None
