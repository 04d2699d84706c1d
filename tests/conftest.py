"""Shared fixtures. Ray starts once per test session: a fresh ray.init costs ~7 s."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Logical CPUs for the shared instance: actors in the tests ask for fractions of these.
RAY_TEST_CPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024,
                 # workers import test helpers (custom rewards) by dotted path, as users' own code
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()


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
