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


# ---------------------------------------------------------------------------- NPU (Ascend) wiring
import importlib.util
import sys
import types

from mindspeed_rl.device import (VISIBLE_DEVICES_ENV, device_type, ray_actor_options, require_torch_npu,
                                 set_device)

NO_TORCH_NPU = importlib.util.find_spec("torch_npu") is None


def test_backend_choice_per_device_string():
    # "npu:3" parses without torch_npu (torch.device("npu") itself needs it imported)
    assert dist_backend("npu") == dist_backend("npu:3") == "hccl"
    assert dist_backend("cuda:1") == "nccl" and dist_backend("cpu") == "gloo"
    assert device_type("npu:0") == "npu" and device_type(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match=r"'tpu'.*cpu.*cuda.*npu"):
        dist_backend("tpu:0")


def test_ray_resources_for_every_spelling_of_a_device_kind():
    # placement says gpu, torch says cuda: both ask Ray for GPU
    assert ray_resource_key("gpu") == ray_resource_key("cuda") == "GPU"
    assert ray_resource_key("NPU") == "NPU"
    with pytest.raises(ValueError, match="device kind 'tpu'"):
        ray_resource_key("tpu")
    assert ray_actor_options("npu", 1) == {"resources": {"NPU": 1}}
    assert ray_actor_options("cuda", 0.5) == {"num_gpus": 0.5}
    assert ray_actor_options("cpu", 1) == {} and ray_actor_options("npu", 0) == {}
    assert VISIBLE_DEVICES_ENV["npu"] == "ASCEND_RT_VISIBLE_DEVICES"


def test_placement_bundles_use_the_same_ray_resource():
    from mindspeed_rl.parallel.placement import ClusterSpec, plan_placement
    for kind in ("npu", "gpu", "cuda"):
        cluster = ClusterSpec(1, 2, kind)
        assert cluster.resource == ray_resource_key(kind)
        plan = plan_placement({"a": {"mesh": "all", "dp": 1, "tp": 2}}, {"a": "actor"}, cluster)
        assert plan.bundles(cpus_per_device=0) == {0: [{ray_resource_key(kind): 1.0}] * 2}


@pytest.mark.skipif(not NO_TORCH_NPU, reason="checks the errors when torch_npu is absent")
def test_npu_without_torch_npu_is_a_clear_error():
    with pytest.raises(ImportError, match=r"needs torch_npu.*pip install torch-npu"):
        require_torch_npu()
    with pytest.raises(ValueError, match=r"device='npu' but torch_npu is not installed.*use device=cpu"):
        resolve_device("npu")
    with pytest.raises(ImportError, match="needs torch_npu"):
        set_device("npu:0")
    set_device("cpu")  # a no-op
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")  # auto never fails for a missing torch_npu


@pytest.mark.skipif(not NO_TORCH_NPU, reason="would shadow the real torch_npu")
def test_torch_npu_that_sees_no_npu_is_a_clear_error(monkeypatch):
    # a torch_npu that imports but registers no usable device (an Ascend install without a card)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.raises(ValueError, match="torch_npu sees no NPU"):
        resolve_device("npu")


# ---------------------------------------------------------------------------- one table of device kinds
def test_one_table_gives_every_spelling_of_a_device_kind():
    from mindspeed_rl.config import GroupConfig
    from mindspeed_rl.device import (ACCELERATOR_OPTION_KEYS, ACCELERATOR_TYPES, DEVICE_KINDS, DEVICE_TABLE,
                                     RAY_RESOURCES, TORCH_DEVICE_TYPES, WORKER_DEVICES, accelerator_share, device_spec,
                                     group_actor_options, group_field, group_resources, ray_resource,
                                     torch_device_type)
    assert DEVICE_KINDS == ("cpu", "gpu", "npu") and TORCH_DEVICE_TYPES == ("cpu", "cuda", "npu")
    assert WORKER_DEVICES == ("cpu", "cuda", "npu", "auto")
    assert RAY_RESOURCES == {"num_cpus": "CPU", "num_gpus": "GPU", "num_npus": "NPU"}
    assert [torch_device_type(k) for k in ("cpu", "gpu", "cuda", "npu")] == ["cpu", "cuda", "cuda", "npu"]
    assert [ray_resource(k) for k in ("cpu", "GPU", "cuda", "npu")] == ["CPU", "GPU", "GPU", "NPU"]
    assert [group_field(k) for k in DEVICE_KINDS] == ["num_cpus", "num_gpus", "num_npus"]
    for row in DEVICE_TABLE:  # every other spelling agrees with the row
        assert device_spec(row.name) is device_spec(row.torch_type) is row
        assert dist_backend(row.torch_type) == row.dist_backend
        assert ray_resource_key(row.name) == (None if row.name == "cpu" else row.ray_resource)
        assert VISIBLE_DEVICES_ENV.get(row.torch_type) == row.visible_env
    with pytest.raises(ValueError, match=r"device kind 'tpu'; use one of \['cpu', 'cuda', 'gpu', 'npu'\]"):
        torch_device_type("tpu")
    group = GroupConfig(num_cpus=1.0, num_gpus=0.5, num_npus=0.25)
    assert group_resources(group) == {"CPU": 1.0, "GPU": 0.5, "NPU": 0.25}
    assert group_actor_options(group) == {"num_cpus": 1.0, "num_gpus": 0.5, "resources": {"NPU": 0.25}}
    assert group_actor_options(GroupConfig(num_cpus=0.5)) == {"num_cpus": 0.5}
    assert ACCELERATOR_TYPES == ("cuda", "npu") and ACCELERATOR_OPTION_KEYS == ("num_gpus", "resources")
    assert set(group_actor_options(group)) - {"num_cpus"} <= set(ACCELERATOR_OPTION_KEYS)
    assert accelerator_share(group) == 0.5 and accelerator_share(GroupConfig(num_npus=0.25)) == 0.25
    assert accelerator_share(GroupConfig()) == 0.0


@pytest.mark.parametrize("kind", ["cpu", "gpu", "npu"])
def test_the_plan_agrees_with_the_device_table(kind):
    """What the trainer's plan derives by hand (planning/plan.py: resource_totals, a mesh group's device and
    share) is what the table's helpers give, so the plan can call them instead."""
    from mindspeed_rl.config import config_from_dict
    from mindspeed_rl.device import RAY_RESOURCES, group_field, group_resources, torch_device_type
    from mindspeed_rl.planning import make_plan
    mfcs = {"actor_rollout": {"mesh": "all", "dp": 2}, "rule_reward": {"mesh": [0]},
            "actor_log_prob": {"mesh": "all", "dp": 2}, "actor_train": {"mesh": "all", "dp": 2}}
    cfg = config_from_dict({"actor_config": {"use_kl_loss": False},
                            "placement": {"mode": "mesh", "n_nodes": 1, "n_devices_per_node": 2,
                                          "device_kind": kind, "cpus_per_device": 1, "mfcs": mfcs}})
    plan = make_plan(cfg, check_files=False)
    totals = dict.fromkeys(RAY_RESOURCES.values(), 0.0)
    for p in plan.groups.values():
        for res, amount in group_resources(p.resources).items():
            totals[res] += amount * p.resources.dp * p.tp * p.pp
    assert totals == plan.resource_totals()
    for name, p in plan.groups.items():
        if p.devices:  # a mesh group: its device and its share of one, by the table
            assert p.resources.device == torch_device_type(kind), name
            if kind != "cpu":
                assert getattr(p.resources, group_field(kind)) > 0, name
