"""What a run checks before Ray starts, so a user's mistake costs seconds, not a cluster start.

The output directory must be writable, not another run's, not in use (`run_dir.py`); a resume's
checkpoint must be readable (else the previous complete one is taken, with a warning), its config
compatible with this one (`resume.py`), and its engine files in a format this run's train backends
read (`layouts`). Every refusal is a ConfigError (exit 2) naming the key and the fix.
"""
from __future__ import annotations

import sys

from ..config import Config, ConfigError
from ..models.files import CheckpointFileError
from .checkpoint import ResumePoint, resume_point
from .resume import check_resume
from .run_dir import RunDirectory, refuse_or_clear_previous


def preflight(cfg: Config, plan, run_dir: RunDirectory) -> tuple[int | None, ResumePoint | None]:
    """(the step the run starts at, or None when a resume has nothing left to train; the checkpoint a
    resume starts from, or None). Locks `run_dir` first."""
    t = cfg.trainer
    run_dir.acquire()
    found = None
    if t.resume:
        try:
            found = resume_point(t.output_dir, list(plan.trained))
        except CheckpointFileError as e:
            raise ConfigError(str(e)) from None
    if found is None:
        if t.resume:
            print(f"trainer.resume=true but no checkpoint in {t.output_dir}/checkpoints; starting at step 0",
                  file=sys.stderr)
        refuse_or_clear_previous(t.output_dir, t.overwrite)
        return 0, None
    for why in found.skipped:
        print(f"warning: resume: skipped a newer checkpoint: {why}; resuming from {found.directory} "
              f"(step {found.step}) instead", file=sys.stderr)
    notes = check_resume(found.state.get("config"), cfg, found.step,
                         [int(s) for s in found.state.get("in_flight", {})], str(found.directory))
    check_layouts(found, layouts(plan))
    if notes:
        print("resume: changed since the checkpoint: " + "; ".join(notes), file=sys.stderr)
    if found.step >= t.total_steps:
        print(f"trainer.resume=true: the checkpoint {found.directory} is at step {found.step} and "
              f"trainer.total_steps={t.total_steps}: nothing left to train; raise trainer.total_steps to go on",
              file=sys.stderr)
        return None, found
    return found.step, found


def layouts(plan) -> dict[str, dict]:
    """Per trained model, the train backend and dp/tp/pp its checkpoint files are written in."""
    out = {}
    for model, train_mfc in plan.trained.items():
        g = plan.groups[plan.group_of(train_mfc)]
        out[model] = {"backend": g.train_backend, "dp": g.resources.dp, "tp": g.tp, "pp": g.pp}
    return out


def check_layouts(found: ResumePoint, now: dict[str, dict]) -> None:
    """A checkpoint's engine files are in its train backend's format: another backend cannot read them
    (a tp 2 checkpoint of the mesh backend has no engine.pt for one torch rank)."""
    saved = found.state.get("layouts")
    if not isinstance(saved, dict):
        return
    for model, layout in now.items():
        old = saved.get(model)
        if old and old.get("backend") != layout["backend"]:
            raise ConfigError(
                f"trainer.resume=true: the checkpoint {found.directory} holds {model!r} as written by the "
                f"{old['backend']} train backend (dp {old['dp']}, tp {old['tp']}, pp {old['pp']}), but this run "
                f"trains it on {layout['backend']} (dp {layout['dp']}, tp {layout['tp']}, pp {layout['pp']}), "
                "which cannot read those files; resume with the placement and actor_config.backend it was saved with")
