"""Device and backend selection (this machine has no CUDA/NPU unless torch says so)."""
import pytest
import torch

from mindspeed_rl.device import dist_backend, ray_resource_key, resolve_device


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device("auto")
    if torch.cuda.is_available():
        assert auto.type == "cuda"
    else:
        assert auto.type in ("cpu", "npu")


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match=r"device='tpu'.*cpu"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_missing_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


def test_backends_and_ray_resources():
    assert dist_backend("cpu") == "gloo"
    assert dist_backend(torch.device("cuda", 0)) == "nccl"
    assert ray_resource_key("cuda") == "GPU" and ray_resource_key("npu") == "NPU"
    assert ray_resource_key("cpu") is None
