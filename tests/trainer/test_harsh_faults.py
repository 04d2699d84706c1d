"""Faults harsher than a worker that raises: a dock that stops answering (SIGSTOP), and a rank of a
data-parallel group killed mid-step, whose surviving peer fails first with a gloo error."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import psutil
import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer import Trainer, TrainingError

pytestmark = pytest.mark.slow


def _run_in_thread(trainer: Trainer) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go():
        try:
            out["history"] = trainer.run()
        except BaseException as e:  # handed to the test
            out["error"] = e
        out["t_end"] = time.time()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _newest_dock_process() -> psutil.Process:
    docks = [p for p in psutil.Process().children(recursive=True)
             if "TransferDockActor" in " ".join(_cmdline(p))]
    return max(docks, key=lambda p: p.create_time())


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.ray
def test_a_silent_dock_ends_the_run_naming_the_call_and_the_step(ray_session, tmp_path):
    """SIGSTOP of the dock actor mid-run: the driver reports "the dock did not answer ... within N s"
    (trainer.stage_timeout_s) with the step, instead of waiting forever."""
    cfg = config_from_dict({"trainer": {"total_steps": 200, "output_dir": str(tmp_path / "run"), "progress": False,
                                        "logger": ["jsonl"], "plot": False, "dashboard": False, "report": False,
                                        "save_interval": 0, "stage_timeout_s": 10,
                                        "simulate_cost_s_per_row": {"actor_rollout": 0.0005}}})
    trainer = Trainer(cfg)
    thread, out = _run_in_thread(trainer)
    _wait_for(lambda: trainer.steps_done >= 2 or "error" in out, 240, "two steps")
    assert "error" not in out, out.get("error")
    dock = _newest_dock_process()
    dock.suspend()
    t_stop = time.time()
    try:
        thread.join(timeout=120)
        assert not thread.is_alive(), "the driver still waits on a stopped dock"
    finally:
        try:
            dock.resume()
        except psutil.Error:
            pass
    err = out.get("error")
    assert isinstance(err, TrainingError), err
    # the stages that were waiting are named when the dock stopped mid-step, not when it stopped during a call
    # between two steps (clear(), the next step's prompts)
    assert re.search(r"^step \d+(, stages \[.*\] running)?: the dock did not answer \S+ within 10 s "
                     r"\(trainer.stage_timeout_s\)", str(err)), err
    assert out["t_end"] - t_stop < 90  # the 10 s timeout, then a bounded clean-up


@pytest.mark.ray
def test_a_killed_data_parallel_rank_is_named_not_its_surviving_peer(ray_session, tmp_path):
    """DDP over gloo with dp 2: rank 1 is killed (SIGKILL) while the group trains; rank 0's allreduce
    fails with "Connection reset by peer" first, but the run names the dead rank."""
    cfg = config_from_dict({"trainer": {"total_steps": 300, "output_dir": str(tmp_path / "run"), "progress": False,
                                        "logger": ["jsonl"], "plot": False, "dashboard": False, "report": False,
                                        "save_interval": 0, "stage_timeout_s": 60},
                            "placement": {"groups": {"integrated": {"dp": 2}}}})
    trainer = Trainer(cfg)
    thread, out = _run_in_thread(trainer)
    _wait_for(lambda: trainer.steps_done >= 2 or "error" in out, 300, "two steps")
    assert "error" not in out, out.get("error")
    victim = trainer.worker_info[("integrated", 1)]["pid"]
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=180)
    assert not thread.is_alive()
    msg = str(out.get("error"))
    assert isinstance(out.get("error"), TrainingError), msg
    assert re.search(rf"^step \d+: worker integrated/1 \(Ray actor [0-9a-f]+, pid {victim} on \S+\) died while "
                     r"running stage '\w+'", msg), msg
