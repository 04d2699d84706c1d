"""Shared fixtures. Ray starts once per test session: a fresh ray.init costs ~7 s."""
import pytest

# Logical CPUs for the shared instance: actors in the tests ask for fractions of these.
RAY_TEST_CPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024 * 1024)
    yield ray
    ray.shutdown()
