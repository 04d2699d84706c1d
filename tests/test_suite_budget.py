"""The suite's time guard (tests/conftest.py): a test over the per-test limit fails unless it carries a
slow_budget mark with its seconds and a reason, and a marked test fails when it takes far more than its
budget. Checked on generated tests run by pytest in a subprocess with this repository's conftest and the
limit lowered to 0.2 s, so the slow tests here sleep 0.3 s instead of a minute."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TIMED = '''
import time
import pytest

def test_fast():
    pass

def test_slow_unmarked():
    time.sleep(0.3)

@pytest.mark.slow_budget(1.0, reason="sleeps past the lowered limit, within its budget")
def test_slow_marked():
    time.sleep(0.3)

@pytest.mark.slow_budget(0.05, reason="declares far less than it takes")
def test_over_its_own_budget():
    time.sleep(0.3)

def test_slow_and_failing():
    time.sleep(0.3)
    assert False, "its own failure"
'''


def _pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\ntest_time_limit_s = 0.2\n"
                                         "markers =\n    ray\n    slow\n")
    (tmp_path / "test_generated.py").write_text(source)
    # no installed plugins (hypothesis, hydra: seconds of imports); the guard needs none
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_generated.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)


def _outcomes(stdout: str) -> dict[str, str]:
    """test name -> PASSED/FAILED from the -rA summary."""
    out = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED") and "::" in rest:
            out[rest.split("::")[1].split(" ")[0]] = word
    return out


def test_a_test_over_the_limit_fails_unless_marked_and_within_its_budget(tmp_path):
    proc = _pytest(tmp_path, TIMED)
    assert _outcomes(proc.stdout) == {"test_fast": "PASSED", "test_slow_unmarked": "FAILED",
                                      "test_slow_marked": "PASSED", "test_over_its_own_budget": "FAILED",
                                      "test_slow_and_failing": "FAILED"}, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 1
    assert "over the suite's 0.2 s limit per test" in proc.stdout and "slow_budget(seconds, reason=" in proc.stdout
    assert "over 3x its slow_budget of 0.05 s" in proc.stdout
    assert "its own failure" in proc.stdout   # a failing test keeps its own report


def test_a_slow_budget_mark_without_a_reason_stops_the_run_before_any_test(tmp_path):
    proc = _pytest(tmp_path, "import pytest\n\n@pytest.mark.slow_budget(90)\ndef test_x():\n    assert 0\n")
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-2000:]   # pytest's usage error
    assert "slow_budget needs a reason" in proc.stdout + proc.stderr
    assert "test_x FAILED" not in proc.stdout and "1 failed" not in proc.stdout


# A stand-in for Ray (the real import takes seconds): what the conftest's count of ray.init calls needs.
FAKE_RAY = '''
_up = False

def init(**kwargs):
    global _up
    _up = True

def is_initialized():
    return _up

def shutdown():
    global _up
    _up = False
'''

RAY_USERS = '''
import pytest

@pytest.mark.ray
def test_starts_its_own():
    import ray
    ray.init()
    ray.shutdown()

@pytest.mark.ray
def test_uses_the_shared_one(ray_session):
    assert ray_session.is_initialized()

@pytest.mark.ray
def test_finds_it_started(ray_session):
    import ray
    if not ray.is_initialized():   # as the Trainer does
        ray.init()
'''


def test_a_test_that_starts_a_ray_of_its_own_in_process_fails_naming_the_shared_fixture(tmp_path):
    (tmp_path / "ray.py").write_text(FAKE_RAY)
    proc = _pytest(tmp_path, RAY_USERS)
    assert _outcomes(proc.stdout) == {"test_starts_its_own": "FAILED", "test_uses_the_shared_one": "PASSED",
                                      "test_finds_it_started": "PASSED"}, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "started a Ray instance of its own in the test process" in proc.stdout
    assert "request the `ray_session` fixture" in proc.stdout
