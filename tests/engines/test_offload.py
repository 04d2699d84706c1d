"""Offload between MFCs (engines/train/offload.py): the moves themselves, the state machine's order, and the worker's
hooks around every stage, the weight export and checkpoints.

On the CPU the device is the host, so an engine's offloader moves nothing (its log says 0 bytes) while its
state machine runs: the order is checked here. The copies themselves (`move_parameters`,
`move_optimizer_state`) are called directly, CPU to CPU, where they copy as they would to a GPU. FSDP2's
own `CPUOffloadPolicy` runs over gloo on two ranks (slow). Nothing here ran on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.offload import (OFFLOADED, ON_DEVICE, OPTIMIZER, PARAMS, OffloadOptions, Offloader,
                                          move_optimizer_state, move_parameters)
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import nll_loss_fn, random_rows, tiny_qwen2

OPTIM = OptimConfig(lr=1e-2)


def _engine(seed: int = 0) -> TorchTrainEngine:
    return TorchTrainEngine(tiny_qwen2(seed=seed, initializer_range=0.3), pad_token_id=0, optim=OPTIM)


def _step(engine: TorchTrainEngine, seed: int) -> dict:
    prompts, responses = random_rows(4, [3, 2, 4, 1], seed), random_rows(4, [2, 3, 1, 2], seed + 1)
    mb = MicroBatch({"prompts": prompts, "responses": responses}, loss_scale=1.0, last=True)
    return engine.train_step(iter([mb]), nll_loss_fn)


def _storages(module) -> set[int]:
    return {p.data.untyped_storage().data_ptr() for p in module.parameters()}


def test_parameters_move_whole_buffers_and_train_as_before():
    """A flattened engine's parameters move as one buffer (same offsets: weight sync still sends a bucket as
    one broadcast), with their gradients; the Parameter objects stay, so AdamW trains on as if nothing moved."""
    moved, still = _engine(), _engine()
    _step(moved, 0), _step(still, 0)
    params = list(moved.module.parameters())
    offsets = [p.data.storage_offset() for p in params]
    values = [p.detach().clone() for p in params]
    (before,) = _storages(moved.module)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    grads = {p.grad.untyped_storage().data_ptr() for p in params}
    alive = [p.data for p in params] + [p.grad for p in params]   # no new buffer can take their addresses
    nbytes = move_parameters(moved.model, "cpu", host := {})
    (after,) = _storages(moved.module)           # still one buffer, a new one
    assert after != before
    assert nbytes == params[0].data.untyped_storage().nbytes() + sum(p.grad.numel() * 4 for p in params)
    assert list(moved.module.parameters()) == params
    assert [p.data.storage_offset() for p in params] == offsets
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    moved_grads = {p.grad.untyped_storage().data_ptr() for p in params}
    assert len(moved_grads) == len(grads) and not moved_grads & grads
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in params)
    assert len(host) == 1 + len(grads)            # the host buffers kept, one per storage
    move_parameters(moved.model, "cpu", host)     # the next offload reuses them
    assert _storages(moved.module) == {after} and len(host) == 1 + len(grads)
    del alive
    moved.optimizer.zero_grad(set_to_none=True)
    a, b = _step(moved, 5), _step(still, 5)
    assert a == b
    assert all(torch.equal(p, q) for p, q in zip(moved.module.parameters(), still.module.parameters()))


def test_optimizer_state_goes_to_host_buffers_and_comes_back_fresh():
    moved, still = _engine(), _engine()
    _step(moved, 0), _step(still, 0)
    state = moved.optimizer.state
    originals = {(id(p), k): v for p, s in state.items() for k, v in s.items()}
    host: dict = {}
    nbytes = move_optimizer_state(moved.optimizer, "cpu", True, host)
    assert nbytes == sum(v.numel() * v.element_size() for v in originals.values())
    assert all(state[p][k] is host[(id(p), k)] and state[p][k] is not originals[(id(p), k)]
               for p in state for k in state[p])
    assert move_optimizer_state(moved.optimizer, "cpu", False, host) == nbytes
    for p in state:
        for k, v in state[p].items():
            assert v is not host[(id(p), k)] and torch.equal(v, originals[(id(p), k)])
    assert move_optimizer_state(moved.optimizer, "cpu", False, host) == 0   # nothing left on the host to bring
    assert _step(moved, 3) == _step(still, 3)


def test_the_state_machine_moves_what_each_holder_needs():
    """Built: everything on the host. A forward brings the parameters, not the optimizer state; training
    brings both; each part leaves when the last holder needing it is done. On the CPU no byte moves."""
    engine = TorchTrainEngine.build(TrainSpec(model_path=_tiny_path(), optim=OPTIM,
                                              offload={"params": True, "optimizer": True}))
    off = engine.offloader
    assert off is not None and not off.real
    assert off.where == {PARAMS: OFFLOADED, OPTIMIZER: OFFLOADED}
    with engine.holding(False, "actor_log_prob"):
        assert off.where == {PARAMS: ON_DEVICE, OPTIMIZER: OFFLOADED}
    with engine.holding(True, "actor_train"):
        assert off.where == {PARAMS: ON_DEVICE, OPTIMIZER: ON_DEVICE}
        with engine.holding(False, "actor_log_prob"):     # a forward in another thread meanwhile
            pass
        _step(engine, 0)
        assert off.where == {PARAMS: ON_DEVICE, OPTIMIZER: ON_DEVICE}
    with engine.holding(False, "sync"):
        with engine.holding(True, "checkpoint"):
            pass
        assert off.where == {PARAMS: ON_DEVICE, OPTIMIZER: OFFLOADED}
    assert off.moves() == [
        (OPTIMIZER, OFFLOADED, "built"), (PARAMS, OFFLOADED, "built"),
        (PARAMS, ON_DEVICE, "actor_log_prob"), (PARAMS, OFFLOADED, "actor_log_prob"),
        (PARAMS, ON_DEVICE, "actor_train"), (OPTIMIZER, ON_DEVICE, "actor_train"),
        (OPTIMIZER, OFFLOADED, "actor_train"), (PARAMS, OFFLOADED, "actor_train"),
        (PARAMS, ON_DEVICE, "sync"), (OPTIMIZER, ON_DEVICE, "checkpoint"), (OPTIMIZER, OFFLOADED, "checkpoint"),
        (PARAMS, OFFLOADED, "sync")]
    assert [m.seq for m in off.log] == list(range(len(off.log))) and all(m.nbytes == 0 for m in off.log)


def test_a_failed_onload_leaves_no_holder():
    engine = _engine()
    calls = []

    def module():
        calls.append(1)
        raise RuntimeError("out of memory")
    off = Offloader(module, lambda: engine.optimizer, "cuda:0", params=True, optimizer_state=False)
    off.where[PARAMS] = OFFLOADED
    with pytest.raises(RuntimeError, match="out of memory"):
        with off.holding(False, "actor_log_prob"):
            pass
    assert calls and off._holders == 0 and off.where[PARAMS] == OFFLOADED


def test_bad_offload_options_are_refused():
    with pytest.raises(ValueError, match="fsdp backend"):
        OffloadOptions.of({"fsdp_cpu_offload": True}, "torch")
    with pytest.raises(ValueError, match="unknown key"):
        OffloadOptions.of({"param": True}, "torch")
    with pytest.raises(ValueError, match="true or false"):
        OffloadOptions.of({"params": "yes"}, "torch")
    assert not OffloadOptions.of({"params": True, "fsdp_cpu_offload": True}, "fsdp").moves
    assert TorchTrainEngine.build(TrainSpec(model_path=_tiny_path(), optim=OPTIM)).offloader is None


def test_fsdp_cpu_offload_needs_a_mesh():
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    with pytest.raises(ValueError, match="one rank without a process group"):
        FSDPTrainEngine.build(TrainSpec(model_path=_tiny_path(), optim=OPTIM, offload={"fsdp_cpu_offload": True}))
    engine = FSDPTrainEngine.build(TrainSpec(model_path=_tiny_path(), optim=OPTIM, offload={"params": True}))
    assert engine.offloader.moves() == [(PARAMS, OFFLOADED, "built")]


def test_the_worker_holds_each_stage_and_the_sync(tmp_path):
    """The real worker's stages (`run_stage`), sync and checkpoint, in a step's order: the actor's state
    comes to the device for each and leaves after it; the reference's parameters for its pass only."""
    from tests.workers.test_wake_before_sync import local_worker, run_step
    # device auto (an accelerator where there is one): the plan refuses offload on a group pinned to the cpu
    worker, dock, plan = local_worker(tmp_path, actor_config={"offload": {"params": True, "optimizer": True}},
                                      ref_config={"offload": True},
                                      placement={"groups": {"integrated": {"device": "auto"}}})
    actor, ref = worker.engines.train["actor"].offloader, worker.engines.infer["ref"].offloader
    worker.sync_weights("actor", 0)
    reports = run_step(worker, dock, plan, 0)
    assert reports["actor_train"]["metrics"]["updates"] >= 1
    worker.save_checkpoint(str(tmp_path / "ckpt"), "run-a")
    assert actor.moves() == [
        (OPTIMIZER, OFFLOADED, "built"), (PARAMS, OFFLOADED, "built"),
        (PARAMS, ON_DEVICE, "sync"), (PARAMS, OFFLOADED, "sync"),
        (PARAMS, ON_DEVICE, "actor_log_prob"), (PARAMS, OFFLOADED, "actor_log_prob"),
        (PARAMS, ON_DEVICE, "actor_train"), (OPTIMIZER, ON_DEVICE, "actor_train"),
        (OPTIMIZER, OFFLOADED, "actor_train"), (PARAMS, OFFLOADED, "actor_train"),
        (PARAMS, ON_DEVICE, "sync"), (PARAMS, OFFLOADED, "sync"),
        (PARAMS, ON_DEVICE, "checkpoint"), (OPTIMIZER, ON_DEVICE, "checkpoint"),
        (OPTIMIZER, OFFLOADED, "checkpoint"), (PARAMS, OFFLOADED, "checkpoint")]
    assert ref.moves() == [(PARAMS, OFFLOADED, "built"), (PARAMS, ON_DEVICE, "ref_log_prob"),
                           (PARAMS, OFFLOADED, "ref_log_prob")]


def _tiny_path() -> str:
    from mindspeed_rl.models.checkpoint import resolve_model_path
    return str(resolve_model_path("builtin:tiny-qwen2"))


# ---------------------------------------------------------------------------------------- FSDP2's own policy
def _fsdp_rank(rank: int, world: int, port: int, path: str, rows: tuple, cpu_offload: bool) -> dict:
    import datetime

    import torch.distributed as dist

    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        engine = FSDPTrainEngine.build(TrainSpec(model_path=path, optim=OPTIM, process_group=dist.group.WORLD,
                                                 offload={"fsdp_cpu_offload": cpu_offload}))
        prompts, responses = rows
        stats = [engine.train_step(iter([MicroBatch({"prompts": prompts[rank::world], "responses":
                                                     responses[rank::world]}, 1.0, last=True)]), nll_loss_fn)
                 for _ in range(2)]
        policy = type(engine.model._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
        weights = {n: t.clone() for b in engine.export_weights(1 << 30) for n, t in b}
        engine.close()
        return {"stats": stats, "policy": policy, "weights": weights}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_cpu_offload_policy_trains_as_without_it(tmp_path):
    """FSDP2's CPUOffloadPolicy (pin_memory off: the CPU has nothing to pin for) runs over gloo and gives the
    losses and weights of the same two ranks without it."""
    from mindspeed_rl.engines.sync.weight_sync import free_port

    from . import _mp_workers as W
    rows = (random_rows(4, [3, 2, 4, 1], 0), random_rows(4, [2, 3, 1, 2], 1))
    runs = {}
    for cpu_offload in (False, True):
        port, where = free_port(), tmp_path / str(cpu_offload)
        where.mkdir()
        runs[cpu_offload] = W.run_procs([(_fsdp_rank, (r, 2, port, _tiny_path(), rows, cpu_offload)) for r in range(2)],
                                        where, 120)
    assert [r["policy"] for r in runs[True]] == ["CPUOffloadPolicy"] * 2
    assert [r["policy"] for r in runs[False]] == ["OffloadPolicy"] * 2
    for a, b in zip(runs[False], runs[True]):
        assert a["stats"] == b["stats"]
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
