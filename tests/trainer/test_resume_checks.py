"""What a resume checks before Ray starts: the saved config against the new one, the checkpoint's files
(falling back to the previous complete checkpoint), and checkpoint writes that fail cleanly."""
from __future__ import annotations

import dataclasses
import os
import time
import subprocess

import pytest
import torch

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.models.files import CheckpointFileError, check_file, load_file, save_file
from mindspeed_rl.trainer.checkpoint import (checkpoint_dir, mark_latest, part_records, resume_point, save_driver_state,
                                             write_manifest)
from mindspeed_rl.trainer.resume import check_resume, config_changes, staleness_problem


def _cfg(**rl):
    cfg = config_from_dict({})
    return dataclasses.replace(cfg, rl_config=dataclasses.replace(cfg.rl_config, **rl))


def test_changes_that_alter_the_data_or_the_math_are_refused_each_named_with_both_values():
    saved = _cfg()
    new = _cfg(n_samples_per_prompt=4, prompts_per_step=8)
    new = dataclasses.replace(new, trainer=dataclasses.replace(new.trainer, seed=7, resume=True))
    with pytest.raises(ConfigError) as e:
        check_resume(saved, new, 10, [], "ckpt")
    text = str(e.value)
    for part in ("rl_config.n_samples_per_prompt: 8 at the checkpoint, 4 now",
                 "rl_config.prompts_per_step: 16 at the checkpoint, 8 now", "trainer.seed: 1 at the checkpoint, 7 now"):
        assert part in text
    assert "trainer.resume:" not in text  # the resume switch itself is no change


def test_other_changes_are_allowed_and_listed():
    saved = _cfg()
    new = dataclasses.replace(saved, actor_config=dataclasses.replace(saved.actor_config, lr=1e-5))
    assert check_resume(saved, new, 10, [], "ckpt") == [f"actor_config.lr {saved.actor_config.lr!r} -> 1e-05"]
    assert config_changes(saved, saved) == []


@pytest.mark.parametrize("saved_k, new_k, in_flight, refused", [
    (2, 0, [11, 12], True),     # two steps in flight, one dock: they would never train
    (2, 1, [11, 12], False),    # two docks hold them
    (1, 3, [11], False),        # a larger staleness always holds what was in flight
    (2, 0, [], False),          # nothing in flight: any staleness
])
def test_a_staleness_change_is_carried_out_when_the_steps_in_flight_fit_the_docks(saved_k, new_k, in_flight, refused):
    problem = staleness_problem(saved_k, new_k, in_flight, 11)
    assert (problem is not None) == refused
    if refused:
        assert "max_weight_staleness >= 1" in problem
        with pytest.raises(ConfigError, match="max_weight_staleness: 2 at the checkpoint, 0 now"):
            check_resume(_cfg(max_weight_staleness=saved_k), _cfg(max_weight_staleness=new_k), 11, in_flight, "c")
    else:
        check_resume(_cfg(max_weight_staleness=saved_k), _cfg(max_weight_staleness=new_k), 11, in_flight, "c")


def _checkpoint(root, step, models=("actor",), manifest=True, rng_run="run-a"):
    d = checkpoint_dir(str(root), step)
    written = []
    for m in models:
        (d / m).mkdir(parents=True)
        written.append(save_file({"w": torch.arange(4096.0)}, str(d / m / "engine.pt")))
        written.append(save_file({"torch": torch.get_rng_state(), "run_id": rng_run}, str(d / m / "rng_rank0.pt")))
    save_driver_state(d, {"step": step})
    if manifest:
        write_manifest(d, "run-a", step, {"actor/0": part_records(str(d), written)})
    mark_latest(str(root), d, step)
    return d


def test_a_checkpoint_is_complete_only_with_its_manifest_and_every_part_it_lists(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, manifest=False)      # a save that did not finish
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2 and found.state["run_id"] == "run-a"
    assert "step_000004 is not complete (no manifest.json" in found.skipped[0]
    six = _checkpoint(tmp_path, 6)
    (six / "actor" / "engine.pt").unlink()          # a rank's part that never reached this disk
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2 and "step_000006/actor/engine.pt is missing: rank actor/0 wrote it" in found.skipped[0]
    eight = _checkpoint(tmp_path, 8)
    save_file({"w": torch.arange(8.0)}, str(eight / "actor" / "engine.pt"))   # another run's file at that path
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2 and "step_000008/actor/engine.pt is" in found.skipped[0]
    assert "another run's file" in found.skipped[0]
    ten = _checkpoint(tmp_path, 10)
    rng = ten / "actor" / "rng_rank0.pt"
    time.sleep(0.01)
    rng.write_bytes(rng.read_bytes())               # the same size, written later
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2 and ("step_000010/actor/rng_rank0.pt was written after rank actor/0 of run run-a"
                                in found.skipped[0])
    _checkpoint(tmp_path, 12, rng_run="run-b")      # a rank's part of another run, listed as it was written
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2 and ("step_000012/actor/rng_rank0.pt was written by run run-b, not by run run-a whose "
                                "manifest lists it" in found.skipped[0])


def test_resume_uses_the_newest_checkpoint_when_it_is_sound(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 4 and found.skipped == []


@pytest.mark.parametrize("damage", ["truncated_state", "torn_pointer", "deleted_dir", "flipped_engine_byte",
                                    "missing_rng"])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path, damage):
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    if damage == "truncated_state":
        os.truncate(newest / "trainer_state.pt", 100)
    elif damage == "torn_pointer":  # and the newest directory half-written: neither is used
        (tmp_path / "checkpoints" / "latest.json").write_text('{"st')
        os.truncate(newest / "trainer_state.pt", 100)
    elif damage == "deleted_dir":
        subprocess.run(["rm", "-rf", str(newest)], check=True)
    elif damage == "flipped_engine_byte":
        p = newest / "actor" / "engine.pt"
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        p.write_bytes(bytes(b))
    else:
        (newest / "actor" / "rng_rank0.pt").unlink()
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 2, found
    assert len(found.skipped) == (2 if damage == "torn_pointer" else 1)  # each passed over, named


def test_a_torn_pointer_alone_falls_back_to_the_newest_complete_directory(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    (tmp_path / "checkpoints" / "latest.json").write_text('{"st')
    found = resume_point(str(tmp_path), ["actor"])
    assert found.step == 4 and "latest.json is unreadable" in found.skipped[0]


def test_no_readable_checkpoint_names_every_one_tried(tmp_path):
    d = _checkpoint(tmp_path, 2)
    os.truncate(d / "trainer_state.pt", 10)
    with pytest.raises(CheckpointFileError, match=r"no readable checkpoint.*step_000002/trainer_state.pt is damaged"):
        resume_point(str(tmp_path), ["actor"])


def test_a_damaged_file_is_named_with_the_fix(tmp_path):
    p = tmp_path / "rng.pt"
    p.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointFileError, match=r"rng.pt is damaged .*delete its checkpoint directory"):
        load_file(str(p))
    with pytest.raises(CheckpointFileError, match="rng.pt is damaged"):
        check_file(str(p))
    with pytest.raises(CheckpointFileError, match="is missing"):
        load_file(str(tmp_path / "engine.pt"))


_FULL_DISK = """
import os, sys, torch
from mindspeed_rl.models.files import CheckpointFileError, save_file
mnt = sys.argv[1]
try:
    save_file({"w": torch.zeros(256 * 1024)}, os.path.join(mnt, "engine.pt"))
except CheckpointFileError as e:
    print("ERROR", e)
print("LEFT", os.listdir(mnt))
"""


def test_a_full_disk_says_so_and_leaves_no_tmp_file(tmp_path):
    """A 64 KiB tmpfs fills up under a 1 MiB save. The tmpfs is mounted in a user and mount namespace of a
    child (`unshare -rm`: no privileges needed, nothing to unmount), so the test runs wherever user
    namespaces are allowed, as root or not."""
    import shutil
    import sys
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not shutil.which("unshare"):
        pytest.fail("unshare (util-linux) is missing: it mounts the small tmpfs this test fills")
    script = f'mount -t tmpfs -o size=64k tmpfs "$1" && exec "{sys.executable}" -c "$2" "$1"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mnt), _FULL_DISK], capture_output=True,
                       text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, f"the child failed (user namespaces not allowed here?): {r.stderr[-2000:]}"
    assert "ERROR" in r.stdout and "disk full while writing" in r.stdout and "engine.pt" in r.stdout, r.stdout
    assert "free space" in r.stdout and "LEFT []" in r.stdout, r.stdout
