"""The output directory's promises, before Ray starts: one run at a time, a previous run's results are
never overwritten unless asked, an unwritable directory is refused at once."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.trainer.run_dir import RunDirectory, previous_results, refuse_or_clear_previous


def _fake_run(root):
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    for step in (2, 4):
        (root / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")


@pytest.mark.slow
def test_a_second_run_on_a_locked_directory_is_refused_naming_the_first(tmp_path):
    first = RunDirectory(str(tmp_path))
    first.acquire()
    try:
        code = ("import sys; from mindspeed_rl.trainer.run_dir import RunDirectory\n"
                "from mindspeed_rl.config import ConfigError\n"
                f"try:\n    RunDirectory({str(tmp_path)!r}).acquire()\nexcept ConfigError as e:\n"
                "    print(e); sys.exit(3)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 3, out.stderr
        assert "another run" in out.stdout and "pid" in out.stdout
    finally:
        first.release()
    again = RunDirectory(str(tmp_path))  # released: the next run takes it
    again.acquire()
    again.release()


@pytest.mark.slow
def test_the_lock_goes_with_a_killed_process(tmp_path):
    """A run killed with SIGKILL (no clean-up of its own) leaves no lock behind: the child holds the lock (a
    second acquire is refused while it lives), is killed, and the directory is free again."""
    import signal
    code = (f"from mindspeed_rl.trainer.run_dir import RunDirectory; RunDirectory({str(tmp_path)!r}).acquire(); "
            "print('HELD', flush=True); import time; time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "HELD", child.stderr.read() if child.poll() is not None else line
        with pytest.raises(ConfigError, match="another run"):
            RunDirectory(str(tmp_path)).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    d = RunDirectory(str(tmp_path))
    d.acquire()
    d.release()


def test_a_fresh_run_over_a_previous_one_is_refused_naming_what_is_there(tmp_path):
    _fake_run(tmp_path)
    assert previous_results(str(tmp_path)) == ["metrics.jsonl with 3 steps", "checkpoints step_000002..step_000004"]
    with pytest.raises(ConfigError, match=r"holds a previous run \(metrics.jsonl with 3 steps, checkpoints "
                                          r"step_000002..step_000004\).*trainer.resume=true.*trainer.overwrite=true"):
        refuse_or_clear_previous(str(tmp_path), overwrite=False)
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints" / "step_000004").is_dir()


def test_overwrite_deletes_only_what_a_run_writes(tmp_path):
    _fake_run(tmp_path)
    refuse_or_clear_previous(str(tmp_path), overwrite=True)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    refuse_or_clear_previous(str(tmp_path), overwrite=False)  # nothing left to refuse


def test_an_output_dir_that_cannot_be_created_is_refused_at_once(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.output_dir=.*cannot create or write it"):
        RunDirectory(str(tmp_path / "file" / "run")).acquire()
