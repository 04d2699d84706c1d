"""Shared fixtures, and the suite's two guards on its time.

Ray starts once per test session (`ray_session`): a fresh ray.init costs ~7 s, and a Trainer run
in-process uses the instance it finds. A test whose own process starts another instance (a Trainer run
without `ray_session` starts and stops one of its own) fails, naming the fixture to request. Tests that need
a Ray of their own (a CLI, a kill -9 of a driver, a two-node cluster) start it in a subprocess.

The time guard: a test whose call phase takes longer than `test_time_limit_s` (ini option, 60 s) fails,
unless it carries `@pytest.mark.slow_budget(seconds, reason="...")`, where `seconds` is what its call takes
on a quiet 2-core machine and `reason` says why it needs that long. A marked test still fails when it takes
more than SLOW_BUDGET_MARGIN times its own budget. The whole suite has to stay within CI's time (README);
one unmarked minute-long test is how it grows past that unnoticed. On a machine much slower than 2 quiet
cores, raise the limit for the run: `python -m pytest -o test_time_limit_s=120`.
"""
import importlib.util
import numbers
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Logical CPUs for the shared instance: actors in the tests ask for fractions of these.
RAY_TEST_CPUS = 4

TEST_TIME_LIMIT_S = 60.0
# A marked test may take this many times its declared budget (the budget is a quiet machine's figure; a
# busy or slower machine takes 2-3x) before it fails as a regression.
SLOW_BUDGET_MARGIN = 3.0


def pytest_addoption(parser):
    parser.addini("test_time_limit_s", f"seconds a test's call phase may take without a slow_budget mark "
                  f"(default {TEST_TIME_LIMIT_S:g})", default=str(TEST_TIME_LIMIT_S))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow_budget(seconds, reason): this test's call takes `seconds` on a quiet 2-core machine, "
                   "over the suite's per-test limit (test_time_limit_s), for `reason` (tests/conftest.py)")


# ---------------------------------------------------------------------------------------- one Ray instance
class _RayStarts:
    """Counts the ray.init calls of this process that are not the shared instance's own."""

    def __init__(self):
        self.shared_starting = False
        self.others = 0

    def watch(self) -> None:
        """Wrap ray.init (once): Ray is imported here for a test that may use it."""
        import ray
        if getattr(ray.init, "_counted_by_conftest", False):
            return
        real = ray.init

        def init(*args, **kwargs):
            if not self.shared_starting:
                self.others += 1
            return real(*args, **kwargs)

        init._counted_by_conftest = True
        ray.init = init


_RAY_STARTS = _RayStarts()


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        _RAY_STARTS.watch()
        _RAY_STARTS.shared_starting = True
        try:
            ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=False,
                     object_store_memory=512 * 1024 * 1024,
                     # workers import test helpers (custom rewards) by dotted path, as users' own code
                     runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        finally:
            _RAY_STARTS.shared_starting = False
    yield ray
    ray.shutdown()


TINY_RM_STEPS = 300


@pytest.fixture(scope="session")
def tiny_reward_model(ray_session, tmp_path_factory):
    """configs/rm_tiny.yaml, seed 1, shortened to TINY_RM_STEPS steps: (its output_dir, its metrics.jsonl
    records). One run shared by the reward model's learning check (tests/learning/test_rlhf_learns.py) and the
    pipeline's checks of it (tests/trainer/test_reward_model_e2e.py); the classifier is in <output_dir>/final."""
    from .learning.helpers import train
    out = tmp_path_factory.mktemp("rm_tiny") / "run"
    return out, train("rm_tiny", out, TINY_RM_STEPS)


def _may_use_ray(item) -> bool:
    return (item.get_closest_marker("slow") is not None or item.get_closest_marker("ray") is not None) \
        and ("ray" in sys.modules or importlib.util.find_spec("ray") is not None)


@pytest.hookimpl(tryfirst=True)   # before the test's fixtures: ray_session may start the instance here
def pytest_runtest_setup(item):
    if _may_use_ray(item):
        _RAY_STARTS.watch()
    _RAY_STARTS.others = 0


# ---------------------------------------------------------------------------------------- time
def _slow_budget(item) -> float | None:
    """The test's declared budget in seconds, None when unmarked; a mark without a positive number of
    seconds and a non-empty reason is a usage error."""
    mark = item.get_closest_marker("slow_budget")
    if mark is None:
        return None
    seconds = mark.args[0] if mark.args else mark.kwargs.get("seconds")
    reason = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("reason")
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or seconds <= 0:
        raise pytest.UsageError(f"{item.nodeid}: slow_budget needs its seconds, a positive number: "
                                f"@pytest.mark.slow_budget(90, reason=...)")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: slow_budget needs a reason saying why the test needs "
                                f"{seconds:g} s: @pytest.mark.slow_budget({seconds:g}, reason=...)")
    return float(seconds)


def pytest_collection_modifyitems(config, items):
    for item in items:   # a malformed mark stops the run before any test runs, not after the slow one
        _slow_budget(item)


def _time_limit(config) -> float:
    try:
        return float(config.getini("test_time_limit_s"))
    except ValueError:   # pytest_addoption above did not run: this conftest was not loaded at start-up
        return TEST_TIME_LIMIT_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" or not report.passed:
        return
    if _RAY_STARTS.others:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a Ray instance of its own in the test process (ray.init, "
                           f"a Trainer run without the shared one): request the `ray_session` fixture "
                           f"(tests/conftest.py), or start the other Ray in a subprocess")
        return
    if report.when != "call":
        return
    limit = _time_limit(item.config)
    budget = _slow_budget(item)
    took = report.duration
    if budget is None and took > limit:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {took:.1f} s, over the suite's {limit:g} s limit per test "
                           f"(test_time_limit_s, tests/conftest.py): make it faster, or mark it "
                           f"@pytest.mark.slow_budget(seconds, reason=...) with its time on a quiet 2-core "
                           f"machine and why it needs that long")
    elif budget is not None and took > max(limit, SLOW_BUDGET_MARGIN * budget):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {took:.1f} s, over {SLOW_BUDGET_MARGIN:g}x its slow_budget of "
                           f"{budget:g} s: it has become slower; make it fast again or re-measure its budget")


@pytest.fixture
def foreign_segment():
    """Another run's shared-memory segment, mapped by a live process (this one) and in no record of
    ours: what the shm clean-ups must leave alone."""
    from multiprocessing import shared_memory
    from pathlib import Path
    seg = shared_memory.SharedMemory(create=True, size=4096)
    yield Path("/dev/shm") / seg.name
    seg.close()
    seg.unlink()
