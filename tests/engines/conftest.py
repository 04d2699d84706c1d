import pytest
import torch

from ._mp_workers import start_forkserver


@pytest.fixture(scope="session", autouse=True)
def _early_forkserver():
    """Worker processes fork from a server that imports torch/transformers once; start it with the
    first engine test so those imports overlap with the single-process tests."""
    start_forkserver()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread, as the workers run (`trainer.torch_threads`): on a busy machine two
    OpenMP threads spin-waiting for each other make these tiny-model ops ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
