"""Ctrl-C and SIGTERM through the real CLI: one line (where the run got to, the last checkpoint, the
command that resumes it), exit 130 / 143, report.html written, no Ray process left behind, and the
printed command resumes the run. Simulated stages (no models) keep each run to its start-up time."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = str(REPO / "cli" / "train_grpo.py")
TOTAL_STEPS = 14


def start(args: list[str], cwd: Path, tag: str) -> subprocess.Popen:
    """The CLI in a session of its own (as a terminal runs it), its environment tagged so that every
    process it starts (Ray's, the workers) can be found afterwards."""
    env = {**os.environ, "MSRL_SIGNAL_TEST": tag,
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout_s: float = 240.0) -> None:
    deadline = time.time() + timeout_s
    while steps_logged(out) < n:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {n}: rc {proc.returncode}\n{proc.stderr.read()}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {n} steps within {timeout_s} s")
        time.sleep(0.2)


def tagged_processes(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (the CLI and everything it started)."""
    found = []
    needle = f"MSRL_SIGNAL_TEST={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:  # gone, or not ours
            pass
    return found


def stop_and_check(proc: subprocess.Popen, sig: int, to_group: bool, out: Path, tag: str) -> str:
    """Send `sig`, wait; check the exit code, the one line, report.html and that nothing is left."""
    assert tagged_processes(tag), "the probe must see the running CLI and its Ray processes"
    (os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig))
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {name} during step "), stderr
    assert "; last checkpoint: step " in line and "; resume with: python " in line, line
    assert (out / "report.html").stat().st_size > 10_000
    snapshot = json.loads((out / "dashboard.json").read_text())
    assert name in snapshot["error"]
    deadline = time.time() + 30  # ray.shutdown has stopped them; the kernel reaps them soon after
    while tagged_processes(tag) and time.time() < deadline:
        time.sleep(0.5)
    assert tagged_processes(tag) == [], "Ray processes outlived the run"
    return line


def resume_args(line: str) -> list[str]:
    words = shlex.split(line.split("; resume with: ", 1)[1])
    assert words[0] == "python" and words[-1] == "trainer.resume=true", words
    return [sys.executable, *words[1:]]


@pytest.mark.timeout(900)
@pytest.mark.slow_budget(70, reason="three CLI runs, each starting its own Ray, stopped by a signal or run to the "
                                    "end; each stop waits for every Ray process of the run to exit")
def test_sigint_and_sigterm_stop_with_one_line_and_the_printed_command_resumes(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, CLI, f"trainer.total_steps={TOTAL_STEPS}", "trainer.save_interval=2",
            "trainer.keep_checkpoints=2", "trainer.progress=false", "trainer.dashboard=false", "trainer.plot=false",
            "trainer.logger=[jsonl]", f"trainer.output_dir={out}", "placement.ray_num_cpus=4",
            "+trainer.simulate_cost_s_per_row.actor_rollout=0.004",  # ~0.5 s a step: time to send the signal
            f"hydra.run.dir={tmp_path / 'hydra'}"]

    # Ctrl-C in a terminal: SIGINT to the whole foreground process group
    tag = uuid.uuid4().hex
    proc = start(args, tmp_path, tag)
    wait_for_steps(proc, out, 3)
    line = stop_and_check(proc, signal.SIGINT, True, out, tag)
    done = int(line.split("(")[1].split(" of ")[0])
    assert done >= 3 and f"{done} of {TOTAL_STEPS} steps done" in line
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert f"last checkpoint: step {latest['step']} in {out / 'checkpoints' / latest['path']}" in line

    # `kill PID`: SIGTERM to the driver only, during the resumed run
    tag = uuid.uuid4().hex
    proc = start(resume_args(line), tmp_path, tag)
    wait_for_steps(proc, out, done + 2)
    line = stop_and_check(proc, signal.SIGTERM, False, out, tag)

    # the printed command again: the run finishes, every step logged once, two checkpoints kept
    tag = uuid.uuid4().hex
    proc = start(resume_args(line), tmp_path, tag)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(TOTAL_STEPS))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == \
        [f"step_{TOTAL_STEPS - 2:06d}", f"step_{TOTAL_STEPS:06d}"]
