"""Checkpoints a long run leaves behind (`trainer.keep_checkpoints`), and resuming after a driver
that was killed while it appended to metrics.jsonl."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.config.checks import check_config
from mindspeed_rl.trainer import Trainer, TrainingError
from mindspeed_rl.trainer.checkpoint import (checkpoint_dir, mark_latest, part_records, prune_checkpoints,
                                             save_driver_state, write_manifest)
from mindspeed_rl.trainer.run_log import MetricsFileError, RunLog


def fake_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    d = checkpoint_dir(str(out), step)
    d.mkdir(parents=True)
    (d / "actor.pt").write_bytes(b"weights")
    if complete:
        save_driver_state(d, {"step": step})
        write_manifest(d, "run", step, {"actor/0": part_records(str(d), [str(d / "actor.pt")])})
    return d


def names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


# ---------------------------------------------------------------------------------------- pruning
def test_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    mark_latest(str(tmp_path), checkpoint_dir(str(tmp_path), 4), 4)
    deleted = prune_checkpoints(str(tmp_path), 2)
    assert sorted(p.name for p in deleted) == ["step_000001", "step_000002"]
    assert names(tmp_path) == ["step_000003", "step_000004"]


def test_never_deletes_latest_nor_one_being_written(tmp_path):
    """`latest` at step 2 (a resume went back there); step 3 is complete but newer than `latest`,
    step 4 is still being written: neither is touched, nor is `latest`'s own directory."""
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 4, complete=False)
    mark_latest(str(tmp_path), checkpoint_dir(str(tmp_path), 2), 2)
    prune_checkpoints(str(tmp_path), 1)
    assert names(tmp_path) == ["step_000002", "step_000003", "step_000004"]


def test_incomplete_older_directory_is_not_counted(tmp_path):
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2, complete=False)  # a crash while saving, before latest moved
    fake_checkpoint(tmp_path, 3)
    mark_latest(str(tmp_path), checkpoint_dir(str(tmp_path), 3), 3)
    prune_checkpoints(str(tmp_path), 2)
    assert names(tmp_path) == ["step_000001", "step_000002", "step_000003"]


def test_zero_keeps_all_and_no_latest_deletes_nothing(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    assert prune_checkpoints(str(tmp_path), 1) == []  # no latest.json: nothing is known complete
    mark_latest(str(tmp_path), checkpoint_dir(str(tmp_path), 3), 3)
    assert prune_checkpoints(str(tmp_path), 0) == []
    assert names(tmp_path) == ["step_000001", "step_000002", "step_000003"]


def test_keep_checkpoints_must_be_a_count():
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints=-1: must be >= 0; 0 keeps every checkpoint"):
        check_config(config_from_dict({"trainer": {"keep_checkpoints": -1}}))
    with pytest.raises(ConfigError, match="trainer.keep_checkpoints=None: expected an integer"):
        config_from_dict({"trainer": {"keep_checkpoints": None}})


# ---------------------------------------------------------------------------------------- metrics.jsonl
def write_metrics(out: Path, steps: int, tail: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(steps)) + tail)
    return path


def test_torn_last_line_is_dropped_with_a_warning(tmp_path):
    path = write_metrics(tmp_path, 4, tail='{"step": 4, "reward/me')
    with pytest.warns(RuntimeWarning, match=f"{path}: dropped its last line 5, cut short"):
        log = RunLog(str(tmp_path), ["jsonl"], resume_step=4)
    assert [r["step"] for r in log.history] == [0, 1, 2, 3]
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_torn_line_in_the_middle_is_refused_naming_file_and_line(tmp_path):
    path = write_metrics(tmp_path, 2, tail='{"step": 2, "rew\n{"step": 3}\n')
    before = path.read_text()
    with pytest.raises(MetricsFileError, match=f"{path} line 3 is not JSON .* not the last line"):
        RunLog(str(tmp_path), ["jsonl"], resume_step=4)
    assert path.read_text() == before  # refused: nothing changed


def test_fresh_run_does_not_read_the_old_file(tmp_path):
    path = write_metrics(tmp_path, 2, tail='garbage\n{"step": 3}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log = RunLog(str(tmp_path), ["jsonl"], resume_step=0)
    assert log.history == [] and path.read_text() == ""


# ---------------------------------------------------------------------------------------- through the driver
def sim(tmp: Path, **trainer) -> dict:
    return {"trainer": {"total_steps": 4, "output_dir": str(tmp / "run"), "progress": False, "logger": ["jsonl"],
                        "plot": False, "dashboard": False, "report": False, "stage_timeout_s": 60,
                        "simulate_cost_s_per_row": {"actor_rollout": 0.0005}, **trainer}}


@pytest.fixture(scope="module")
def saved_run(ray_session, tmp_path_factory) -> Path:
    """4 steps, a checkpoint after each and the newest 2 kept: the run each test below resumes a copy of."""
    tmp = tmp_path_factory.mktemp("saved")
    history = Trainer(config_from_dict(sim(tmp, save_interval=1, keep_checkpoints=2))).run()
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    return tmp / "run"


def copy_of(run: Path, tmp: Path) -> Path:
    shutil.copytree(run, tmp / "run")
    return tmp / "run"


@pytest.mark.slow
@pytest.mark.ray
def test_save_every_step_keeps_two_and_resume_after_a_torn_line(saved_run, tmp_path):
    assert names(saved_run) == ["step_000003", "step_000004"]
    run = copy_of(saved_run, tmp_path)
    # the driver was killed while appending a step after its last checkpoint
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/mean": 0.1')
    with pytest.warns(RuntimeWarning, match="metrics.jsonl: dropped its last line 5"):
        resumed = Trainer(config_from_dict(sim(tmp_path, total_steps=6, save_interval=1, keep_checkpoints=2,
                                               resume=True))).run()
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert names(run) == ["step_000005", "step_000006"]


@pytest.mark.slow
@pytest.mark.ray
def test_resume_refuses_a_file_damaged_in_the_middle(saved_run, tmp_path):
    run = copy_of(saved_run, tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0][:10], *lines[1:]]) + "\n")
    with pytest.raises(TrainingError, match=f"trainer.resume=true: {path} line 1 is not JSON"):
        Trainer(config_from_dict(sim(tmp_path, total_steps=5, save_interval=1, keep_checkpoints=2,
                                     resume=True))).run()
