"""Driver-side checkpoint state, the manifest, the `latest` pointer, and pruning old checkpoints.

A checkpoint is every training rank's part (engine state or its shards, and the rank's own RNG states with
the id of the run that wrote them; written by the workers, on their nodes, into the shared run directory) and
the driver's state. It is complete when its
`manifest.json` exists: written by the driver after every rank has reported its part and the driver state
is written, it lists each rank's files with the size and modification time its writer read right after
writing them, and the id of the run. `latest` points at a complete checkpoint only (it is written after the
manifest, atomically), so a crash while saving leaves the previous checkpoint the one a resume uses. A
resume checks every listed file: present, the same size and modification time (a part another run left at
that path, even of the same size, as DCP shards of one model are, is refused naming the file and the rank
and run that wrote the one listed), readable, each rank's RNG file of the manifest's run; each rank then loads
its own part. Pruning (`trainer.keep_checkpoints`) runs
only after that, and deletes only complete directories older than the one `latest` points to: never the
pointed-to one, never one still being written.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..models.files import CheckpointFileError, check_file, load_file, save_file

STEP_DIR = re.compile(r"^step_(\d+)$")
RNG_FILE = re.compile(r"^rng_rank\d+\.pt$")


def rng_file(rank: int) -> str:
    """A training rank's RNG states (and its run's id) in each trained model's checkpoint directory: each rank
    restores its own (workers/engine_set.py)."""
    return f"rng_rank{rank}.pt"


def checkpoint_dir(output_dir: str, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def save_driver_state(directory: Path, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "trainer_state.pt"))


MANIFEST = "manifest.json"


def part_records(directory: str, paths: list[str]) -> list[dict]:
    """What a rank wrote into checkpoint `directory`, as its manifest entry: each file relative to the
    directory, with its size and modification time (read by the writer, on its node)."""
    records = []
    for p in paths:
        st = os.stat(p)
        records.append({"file": os.path.relpath(p, directory), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return records


def write_manifest(directory: Path, run_id: str, step: int, parts: dict[str, list[dict]]) -> None:
    """The checkpoint's list of parts (`parts`: "group/rank" -> its `part_records`), written whole or not at
    all, after every part and the driver state: from then on the checkpoint is complete."""
    _write_json(directory / MANIFEST, {"run_id": run_id, "step": step, "parts": parts})


def _write_json(path: Path, obj: dict) -> None:
    """`obj` as `path`, through `<path>.tmp` and an atomic rename; a failed write leaves neither."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointFileError(f"cannot write {path} ({e.strerror or e}): free space on that disk or point "
                                  "trainer.output_dir elsewhere; the previous checkpoint stays the latest") from None


def check_manifest(directory: Path) -> dict:
    """The manifest of a complete checkpoint whose every listed part is there as written; CheckpointFileError
    naming the first missing or changed file and the rank that wrote it."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        parts = manifest["parts"]
        str(manifest["run_id"])
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint {directory} is not complete (no {MANIFEST}: a save that did not "
                                  "finish, or a checkpoint of a version without manifests)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{path} is unreadable ({type(e).__name__}: {e}); delete its checkpoint "
                                  "directory to resume from the previous one") from None
    for who, records in parts.items():
        for r in records:
            f = directory / r["file"]
            try:
                st = f.stat()
            except OSError:
                raise CheckpointFileError(f"{f} is missing: rank {who} wrote it (run {manifest['run_id']}); was it "
                                          "written on a disk this machine does not see? Delete its checkpoint "
                                          "directory to resume from the previous one") from None
            if st.st_size != r["bytes"]:
                raise CheckpointFileError(f"{f} is {st.st_size} bytes where rank {who} of run {manifest['run_id']} wrote "
                                          f"{r['bytes']}: another run's file, or a changed one; delete its "
                                          "checkpoint directory to resume from the previous one")
            if st.st_mtime_ns != r["mtime_ns"]:
                raise CheckpointFileError(f"{f} was written after rank {who} of run {manifest['run_id']} wrote the "
                                          "one the manifest lists: another run's file, or a changed one; delete its "
                                          "checkpoint directory to resume from the previous one")
    return manifest


def mark_latest(output_dir: str, directory: Path, step: int) -> None:
    _write_json(Path(output_dir) / "checkpoints" / "latest.json", {"step": step, "path": directory.name})


@dataclass
class ResumePoint:
    """The checkpoint a resume starts from, its driver state, and the newer ones passed over (with why)."""
    directory: Path
    state: dict
    skipped: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.state["step"])


def check_checkpoint(directory: Path, models: list[str]) -> dict:
    """The driver state of a complete, readable checkpoint, with its manifest's `run_id`; CheckpointFileError
    naming the first bad file.

    Cheap: every part its manifest lists is there as written (size, time); the driver state is loaded (it is
    small and needed anyway); each trained model's directory must exist with rank 0's RNG file; each rank's RNG
    file (a few kB) is loaded and must carry the manifest's run id; every other `*.pt` passes `check_file` (zip
    directory and CRCs) without being loaded. Sharded formats (DCP's `.metadata` and shards) are checked for
    presence."""
    if not directory.is_dir():
        raise CheckpointFileError(f"checkpoint directory {directory} is missing")
    manifest = check_manifest(directory)
    state = load_file(str(directory / "trainer_state.pt"), what="driver state")
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointFileError(f"driver state {directory / 'trainer_state.pt'} holds no step: it is not a "
                                  "mindspeed_rl checkpoint; delete that directory to resume from the previous one")
    for model in models:
        where = directory / model
        if not where.is_dir():
            raise CheckpointFileError(f"checkpoint {directory} has no {model}/ directory: it was written by a run "
                                      f"that did not train {model!r}")
        check_file(str(where / rng_file(0)), what="RNG state")
        for f in sorted(where.glob("*.pt")):
            if not RNG_FILE.match(f.name):
                check_file(str(f), what=f"{model} engine state")
                continue
            written_by = load_file(str(f), what="RNG state").get("run_id")
            if written_by != manifest["run_id"]:
                raise CheckpointFileError(f"{f} was written by run {written_by}, not by run {manifest['run_id']} "
                                          "whose manifest lists it: another run's file; delete its checkpoint "
                                          "directory to resume from the previous one")
    return {**state, "run_id": manifest["run_id"]}


def resume_point(output_dir: str, models: list[str]) -> ResumePoint | None:
    """The newest complete, readable checkpoint under `output_dir`, or None when there is none.

    `latest.json` names the newest one; when it, or what it points to, cannot be read (a torn or
    deleted file, a damaged engine state), the previous complete checkpoint is used, and `skipped`
    names each newer one passed over and why (the caller warns)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    skipped: list[str] = []
    candidates: list[Path] = []
    pointer = root / "latest.json"
    if pointer.exists():
        try:
            info = json.loads(pointer.read_text())
            candidates.append(root / str(info["path"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            skipped.append(f"{pointer} is unreadable ({type(e).__name__}: {e})")
    steps = sorted(((int(m.group(1)), d) for d in root.iterdir() if d.is_dir()
                    for m in [STEP_DIR.match(d.name)] if m), reverse=True)
    newest_pointed = None
    if candidates:
        m = STEP_DIR.match(candidates[0].name)
        newest_pointed = int(m.group(1)) if m else None
    for step, d in steps:  # older than the pointed one (a newer one may be a save that never completed)
        if d not in candidates and (newest_pointed is None or step < newest_pointed):
            candidates.append(d)
    for d in candidates:
        try:
            return ResumePoint(d, check_checkpoint(d, models), skipped)
        except CheckpointFileError as e:
            skipped.append(str(e))
    if skipped:
        raise CheckpointFileError("trainer.resume=true: no readable checkpoint in " + str(root) + ": "
                                  + "; ".join(skipped))
    return None


def latest_checkpoint(output_dir: str) -> tuple[Path, dict] | None:
    """(directory, driver state) of the checkpoint a resume would use (see `resume_point`)."""
    found = resume_point(output_dir, [])
    return None if found is None else (found.directory, found.state)


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
    ones (with their manifest, written last): a newer directory may still be being written, and an
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
                      for m in [STEP_DIR.match(d.name)] if m and (d / MANIFEST).is_file())
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
