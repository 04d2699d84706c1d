import pytest

from mindspeed_rl.models import resolve_model_path


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    """A cache directory of this test session: the built-in checkpoint is created there once."""
    return tmp_path_factory.mktemp("mindspeed_rl_cache")


@pytest.fixture
def cache_env(cache_root, monkeypatch):
    monkeypatch.setenv("MINDSPEED_RL_CACHE", str(cache_root))
    return cache_root


@pytest.fixture(scope="session")
def builtin_dir(cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINDSPEED_RL_CACHE", str(cache_root))
        return resolve_model_path("builtin:tiny-qwen2")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread (see tests/engines/conftest.py): tiny models, busy machines."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
