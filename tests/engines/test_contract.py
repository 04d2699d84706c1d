"""The contract every registered backend keeps, checked cheaply in one process for each of them:
its deployment declares, for any slice it accepts, exactly one dock reader and one writer per replica and
the actor count the driver starts; the roles an engine of it declares at run time agree; weights it exports
load into a reader and come back the same (export/update round trip)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mindspeed_rl.engines import registry as R
from mindspeed_rl.engines.deployment import ENGINE, MESH, DeployError, Slice

SLICES = [Slice(1), Slice(2), Slice(1, 2), Slice(2, 2, 2, tuple(range(8))), Slice(1, 1, 2), Slice(4, 2, 1, tuple(range(8)))]
ALL = [(kind, name) for kind, table in (("rollout", R.ROLLOUT_BACKENDS), ("train", R.TRAIN_BACKENDS)) for name in table]


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
@pytest.mark.parametrize("slice_", SLICES, ids=[f"dp{s.dp}tp{s.tp}pp{s.pp}" for s in SLICES])
def test_every_deployment_has_one_reader_and_one_writer_per_replica(kind, name, slice_):
    backend = (R.ROLLOUT_BACKENDS if kind == "rollout" else R.TRAIN_BACKENDS)[name]
    # what a backend refuses, by its declared shape: a whole-copy backend with no backend to split for it
    # refuses any split; an engine that starts its own ranks splits by tp only
    refused = ((backend.shape == "data_parallel" and slice_.split and not backend.split_backend)
               or (backend.shape == ENGINE and slice_.pp > 1))
    if refused:
        with pytest.raises(DeployError) as e:
            backend.deploy(slice_)
        named = (f"pp={slice_.pp}" if backend.shape == ENGINE else f"tp={slice_.tp}, pp={slice_.pp}")
        assert named in str(e.value) and "use " in str(e.value), e.value   # the values, and what to use instead
        return
    dep = backend.deploy(slice_)
    roles = dep.roles()
    assert len(roles) == dep.actors
    assert dep.actors == (slice_.dp * slice_.tp * slice_.pp if dep.shape == MESH else slice_.dp)
    for replica in range(slice_.dp):
        mine = [r for r in roles if r.replica == replica]
        assert sum(r.reads for r in mine) == 1 and sum(r.writes for r in mine) == 1, (dep, mine)
    if dep.shape == ENGINE:
        assert dep.engine_tp == slice_.tp and dep.actor_tp == 1
    if slice_.devices:  # every device to exactly one actor
        assert sorted(d for k in range(dep.actors) for d in dep.actor_devices(k)) == list(slice_.devices)
    # a split the backend cannot make itself lands on the backend that splits for it
    if slice_.split and backend.shape == "data_parallel":
        assert dep.backend == backend.split_backend
    assert set(backend.engine_options(dep)) <= {"tp", "pp", "dp", "tensor_parallel_size"}


@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_every_backend_loads_its_class_and_checks_its_options(kind, name):
    backend = (R.ROLLOUT_BACKENDS if kind == "rollout" else R.TRAIN_BACKENDS)[name]
    base = R.RolloutEngine if kind == "rollout" else R.TrainEngine
    try:
        cls = backend.load()
    except ImportError as e:   # megatron, vllm where not installed: the install command is named
        assert backend.needs and (backend.install or "docs/engines.md") in str(e)
        return
    assert issubclass(cls, base) and callable(getattr(cls, "build", None))
    for member in ("is_dock_reader", "is_dock_writer", "replica_group", "reader_rank", "writer_rank", "dp_rank",
                   "dp_size", "collective_forward", "shares_batches"):
        assert hasattr(cls, member), (name, member)
    assert backend.parse_options({}) == ({} if backend.options_class() is None else
                                         dataclasses.asdict(backend.options_class()()))
    with pytest.raises(ValueError, match="unknown to the|takes no options"):
        backend.parse_options({"no_such_option": 1})


def _tiny():
    from mindspeed_rl.models import load_causal_lm, resolve_model_path
    return str(resolve_model_path("builtin:tiny-qwen2")), load_causal_lm


# every data-parallel train backend into every reader that runs in one process: the hf rollout engine and the
# train backends' inference copies (a reference or a reader of a model trained in another group); vLLM's round
# trip is tests/engines/test_vllm_rollout.py's, the mesh backend's (several ranks) tests/engines/test_mesh_train.py's
READERS = [("rollout", "hf"), ("train", "torch"), ("train", "fsdp")]


@pytest.mark.parametrize("train", ["torch", "fsdp"])
@pytest.mark.parametrize("reader_kind,reader_name", READERS, ids=[f"{k}-{n}" for k, n in READERS])
def test_weights_exported_by_a_train_backend_load_into_a_reader(train, reader_kind, reader_name):
    """export_weights -> update_weights: the reader then serves exactly the trainer's weights (one rank; the
    one-rank replica is every backend's data-parallel deployment)."""
    from mindspeed_rl.engines import OptimConfig, RolloutSpec, TrainSpec, make_rollout_engine, make_train_engine
    from mindspeed_rl.engines.sync.weight_sync import Checksum, tee_buckets
    path, _ = _tiny()
    torch.manual_seed(0)
    trainer = make_train_engine(train, TrainSpec(model_path=path, optim=OptimConfig(lr=0.1), seed=3))
    reader = (make_rollout_engine(reader_name, RolloutSpec(model_path=path, seed=5)) if reader_kind == "rollout"
              else make_train_engine(reader_name, TrainSpec(model_path=path, seed=5)))
    with torch.no_grad():  # make the trainer's weights differ from the checkpoint both started from
        for p in trainer.model.parameters():
            p.add_(0.01)
    rows = ([torch.tensor([3, 4, 5]), torch.tensor([6, 7])], [torch.tensor([8, 9, 10, 11]), torch.tensor([12])])
    before = reader.state_checksum() if reader_kind == "rollout" else reader.log_probs(*rows, micro_batch_size=2)
    for engine in (trainer, reader):   # the declared roles of a one-rank replica
        assert engine.is_dock_reader and engine.is_dock_writer and engine.replica_group is None
        assert not engine.shares_batches
    sent = Checksum()
    for _ in tee_buckets(trainer.export_weights(1 << 20), [reader], 7, sent):
        pass
    assert (reader.weight_version if reader_kind == "rollout" else reader.version) == 7
    if reader_kind == "rollout":
        got = reader.state_checksum()
        assert got is not None and got == sent.hexdigest() and got != before
    else:   # an inference copy computes what the trainer computes (a sharded one reads no checksum back cheaply)
        got = reader.log_probs(*rows, micro_batch_size=2)
        want = trainer.log_probs(*rows, micro_batch_size=2)
        for g, w, b in zip(got, want, before):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
            assert not torch.allclose(g, b)
    trainer.close()
    reader.close()
