"""MFCDef: normalization and every validation error."""
import dataclasses

import pytest

from mindspeed_rl.dataflow import InterfaceType, MFCDef


def test_minimal_mfc_and_normalization():
    m = MFCDef("actor_train", "actor", " Train_Step ", ["prompts", "advantages"], [])
    assert m.interface_type is InterfaceType.TRAIN_STEP
    assert m.input_keys == ("prompts", "advantages") and m.output_keys == ()
    assert m.is_trainable
    assert m.worker_group is None and m.worker_group_name == "actor_train"
    assert m.dp_size == 1 and m.get_n_samples is False and m.micro_batch_size is None
    assert hash(m) == hash(MFCDef("actor_train", "actor", "train_step", ("prompts", "advantages"), ()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.name = "x"


@pytest.mark.parametrize("kind", ["generate", "inference", "compute", InterfaceType.GENERATE])
def test_not_trainable(kind):
    m = MFCDef("a", "actor", kind, ("prompts",), ("x",), worker_group="colocated")
    assert not m.is_trainable
    assert m.worker_group_name == "colocated"
    assert str(m.interface_type) == InterfaceType(kind).value


def _err(**overrides):
    kwargs = dict(name="rollout", model_name="actor", interface_type="generate",
                  input_keys=("prompts",), output_keys=("responses",))
    kwargs.update(overrides)
    with pytest.raises(ValueError) as e:
        MFCDef(**kwargs)
    return str(e.value)


def test_unknown_interface_type():
    msg = _err(interface_type="backward")
    assert "rollout" in msg and "'backward'" in msg
    for allowed in ("generate", "inference", "train_step", "compute"):
        assert allowed in msg


def test_empty_name():
    msg = _err(name="  ")
    assert "name=" in msg and "actor" in msg and "unique non-empty name" in msg


def test_empty_model_name():
    msg = _err(model_name="")
    assert "'rollout'" in msg and "model_name" in msg


@pytest.mark.parametrize("dp", [0, -2, 1.5, True])
def test_bad_dp_size(dp):
    msg = _err(dp_size=dp)
    assert "'rollout'" in msg and f"dp_size={dp!r}" in msg and ">= 1" in msg


@pytest.mark.parametrize("mbs", [0, 2.0])
def test_bad_micro_batch_size(mbs):
    msg = _err(micro_batch_size=mbs)
    assert "'rollout'" in msg and "micro_batch_size" in msg


def test_bad_get_n_samples():
    assert "get_n_samples" in _err(get_n_samples=1)


def test_empty_worker_group():
    assert "worker_group" in _err(worker_group="")


def test_duplicate_input_keys():
    msg = _err(input_keys=("prompts", "labels", "prompts"))
    assert "'rollout'" in msg and "input_keys" in msg and "'prompts'" in msg and "once" in msg


def test_duplicate_output_keys():
    msg = _err(output_keys=["responses", "responses"])
    assert "'rollout'" in msg and "output_keys" in msg and "'responses'" in msg


def test_key_in_input_and_output():
    msg = _err(input_keys=("prompts", "responses"), output_keys=("responses",))
    assert "'rollout'" in msg and "'responses'" in msg and "input_keys and output_keys" in msg


def test_single_string_keys_rejected():
    msg = _err(input_keys="prompts")
    assert "input_keys='prompts'" in msg and "('prompts',)" in msg


@pytest.mark.parametrize("bad", [("",), (3,), 5])
def test_bad_keys(bad):
    assert "input_keys" in _err(input_keys=bad)
