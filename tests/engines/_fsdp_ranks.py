"""Rank processes of the FSDP2 engine tests (tests/engines/test_fsdp_train.py), run by
`_mp_workers.run_procs`: each joins a gloo group over TCP, builds a real `FSDPTrainEngine` and
returns plain tensors for the test to compare with a single-process reference."""
from __future__ import annotations

import contextlib

import datetime
import gc
import time
import weakref

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import masked_mean
from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine

from ._common import PAD

HOST = "127.0.0.1"


def nll_loss(out, mb):
    """Token-mean negative log-prob of a micro-batch (and its mean entropy, as a metric)."""
    loss = masked_mean(-out.log_probs, out.response_mask)
    return loss, {"loss": loss.item(), "entropy": masked_mean(out.entropy, out.response_mask).item()}


def value_loss(out, mb):
    loss = masked_mean((out.values - 1.0) ** 2, out.response_mask)
    return loss, {"vf_loss": loss.item()}


def _join(rank: int, world: int, port: int, subgroup: bool = False):
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # a group made by new_group goes through DeviceMesh.from_group, WORLD through init_device_mesh
    return dist.new_group(list(range(world))) if subgroup else dist.group.WORLD


def _engine(path: str, group, optim: OptimConfig | None, kind: str = "causal_lm") -> FSDPTrainEngine:
    return FSDPTrainEngine.build(TrainSpec(model_path=path, model_kind=kind, pad_token_id=PAD,
                                           optim=optim, process_group=group, seed=0))


def micro_batches(prompts, responses, micro: int, scale: float) -> list[MicroBatch]:
    starts = list(range(0, len(prompts), micro))
    return [MicroBatch({"prompts": prompts[s:s + micro], "responses": responses[s:s + micro]},
                       loss_scale=scale, last=i == len(starts) - 1) for i, s in enumerate(starts)]


def exported(engine, bucket_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in engine.export_weights(bucket_bytes) for n, t in b}


def train(rank: int, world: int, port: int, path: str, rows: tuple, splits: list, optim: OptimConfig,
          subgroup: bool) -> dict:
    """One train_step per entry of `splits` ((micro_batch_size, loss_scale)), each from a fresh
    engine on this rank's rows; the exported weights, metrics and shard shapes of each."""
    group = _join(rank, world, port, subgroup)
    prompts, responses = rows
    runs = []
    with counted_reduce_scatters() as calls:
        for micro, scale in splits:
            engine = _engine(path, group, optim)
            shards = {n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters()}
            calls[0] = 0
            stats = engine.train_step(iter(micro_batches(prompts, responses, micro, scale)), nll_loss)
            runs.append({"stats": stats, "weights": exported(engine), "version": engine.version,
                         "shards": shards, "reduce_scatters": calls[0]})
            engine.close()
    dist.destroy_process_group()
    return runs


@contextlib.contextmanager
def counted_reduce_scatters():
    """FSDP2's gradient reduce-scatters counted (it calls dist.reduce_scatter_single; passed through): yields a
    one-item list holding the count."""
    calls, original = [0], dist.reduce_scatter_single

    def counted(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    dist.reduce_scatter_single = counted
    try:
        yield calls
    finally:
        dist.reduce_scatter_single = original


def _shards(model) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter's gradient (FSDP2 keeps them as DTensors)."""
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def grads_two_ways(rank: int, world: int, port: int, path: str, rows: tuple, micro: int) -> dict:
    """The gradient shards of one step of two micro-batches on this rank, from the same weights two ways, and the
    gradient reduce-scatters each made:

    * `per_micro_batch`: the engine's `train_step` (each micro-batch's backward reduce-scatters its gradients
      into the rank's accumulated shard), read in the optimizer's pre-step hook (clipping at 1e9 scales by 1.0);
    * `no_sync`: the same forward and loss, with `set_requires_gradient_sync(False)` until the last micro-batch
      (unsharded gradients accumulated, reduce-scattered once by the last backward)."""
    group = _join(rank, world, port)
    prompts, responses = rows
    out = {}
    with counted_reduce_scatters() as calls:
        engine = _engine(path, group, OptimConfig(lr=0.0, grad_clip=1e9))
        engine.optimizer.register_step_pre_hook(
            lambda opt, a, k: out.update(per_micro_batch=_shards(engine.model)))
        calls[0] = 0
        engine.train_step(iter(micro_batches(prompts, responses, micro, 0.5)), nll_loss)
        out["reduce_scatters_per_micro_batch"] = calls[0]
        engine.close()

        engine = _engine(path, group, OptimConfig(lr=0.0, grad_clip=1e9))
        calls[0] = 0
        for mb in micro_batches(prompts, responses, micro, 0.5):
            engine.model.set_requires_gradient_sync(mb.last)
            with engine.adapters_in_use():
                o, zero = engine._train_output(mb.data)
                loss, _ = nll_loss(o, mb)
                (loss * mb.loss_scale if zero is None else loss * mb.loss_scale + zero).backward()
        out["no_sync"] = _shards(engine.model)
        out["reduce_scatters_no_sync"] = calls[0]
        engine.close()
    dist.destroy_process_group()
    return out


def export(rank: int, world: int, port: int, path: str, bucket_bytes: int,
           dtypes: tuple[str, ...] = ("float32",)) -> dict:
    """Export in buckets, once per export dtype, counting the bytes of gathered tensors alive at each
    moment (each tensor a bucket holds is tracked from when it is yielded until freed, whichever
    way the engine gathered it), while the consumer drops each bucket."""
    group = _join(rank, world, port)
    engine = _engine(path, group, OptimConfig())
    alive, peak = [0], [0]
    tracked: set[int] = set()

    def track(t):
        if id(t) in tracked:       # a tied tensor under its second name
            return
        n = t.numel() * t.element_size()
        tracked.add(id(t))
        alive[0] += n
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(t, lambda i=id(t): (alive.__setitem__(0, alive[0] - n), tracked.discard(i)))

    out = {}
    for dtype in dtypes:
        engine.export_dtype = getattr(torch, dtype)
        buckets = []
        for bucket in engine.export_weights(bucket_bytes):
            for _, t in bucket:
                track(t)
            buckets.append([(n, t.clone(), t.dtype, t.numel() * t.element_size()) for n, t in bucket])
            del bucket, t
        out[dtype] = buckets
    # gloo's worker thread lets go of a finished broadcast's tensor a moment after `wait()` returns
    deadline = time.monotonic() + 5
    while alive[0] and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    dist.destroy_process_group()
    return {"buckets": out, "peak_gathered": peak[0], "alive_after": alive[0]}


def checkpoint(rank: int, world: int, port: int, path: str, rows: tuple, optim: OptimConfig, ckpt: str) -> dict:
    """Train 2 steps, save, train a 3rd; then a fresh engine loads and trains the same 3rd step."""
    group = _join(rank, world, port)
    prompts, responses = rows
    steps = [micro_batches(prompts[i::3], responses[i::3], 1, 1.0 / len(prompts[i::3])) for i in range(3)]
    a = _engine(path, group, optim)
    a.train_step(iter(steps[0]), nll_loss)
    a.train_step(iter(steps[1]), nll_loss)
    files = a.save_checkpoint(ckpt)
    saved = exported(a)
    third_a = a.train_step(iter(steps[2]), nll_loss)
    wa = exported(a)
    b = _engine(path, group, optim)
    b.load_checkpoint(ckpt)
    loaded = exported(b)
    version_b = b.version
    third_b = b.train_step(iter(steps[2]), nll_loss)
    wb = exported(b)
    dist.destroy_process_group()
    return {"files": files, "saved": saved, "loaded": loaded, "version_loaded": version_b,
            "a": wa, "b": wb, "stats_a": third_a, "stats_b": third_b, "versions": (a.version, b.version)}


def update_and_infer(rank: int, world: int, port: int, path: str, new_weights: dict, rows: tuple,
                     value_rows: tuple) -> dict:
    """update_weights with full tensors (an inference-only reader), export, and log-probs of an
    uneven share of rows (rank 0 more micro-batches than rank 1); a value model's values."""
    group = _join(rank, world, port)
    engine = _engine(path, group, None)
    from torch.distributed.tensor import DTensor

    engine.log_probs(*rows, micro_batch_size=2)
    # FSDP2 keeps the root gathered after a forward without backward; the engine reshards it, so
    # no full embedding/lm_head stays alive and update_weights writes the shards it will gather
    sharded = all(isinstance(p, DTensor) for p in engine.model.parameters())
    engine.update_weights(iter(sorted(new_weights.items())), version=7)
    weights = exported(engine, bucket_bytes=4096)
    logp = engine.log_probs(*rows, micro_batch_size=1)
    critic = _engine(path, group, OptimConfig(lr=1e-2), kind="value")
    values = critic.values(*value_rows, micro_batch_size=2)
    vstats = critic.train_step(iter(micro_batches(*value_rows, 2, 0.5)), value_loss)
    # process_group None with a default group up: a one-rank mesh of its own, no other rank involved
    alone = _engine(path, None, None)
    alone_logp = alone.log_probs(*rows, micro_batch_size=2)
    alone.close()
    dist.barrier()  # rank 0 hosts the store that new_group above uses: it must not leave before the others
    dist.destroy_process_group()
    return {"weights": weights, "version": engine.version, "log_probs": logp, "sharded": sharded,
            "alone_log_probs": alone_logp, "alone_mesh_size": alone.mesh.size(), "values": values,
            "value_stats": vstats}


def threaded_forwards(rank: int, world: int, port: int, path: str, rows: tuple, rounds: int) -> dict:
    """Two threads calling `log_probs` of one engine at once, `rounds` times each (a frozen reference
    serving two steps at once with max_weight_staleness > 0): the errors they met, and whether every
    result equals the one computed alone. The engine is on a one-rank mesh of its own (process_group
    None with a default group up), so no other rank is involved: only the threads can collide."""
    import threading

    _join(rank, world, port)
    engine = _engine(path, None, None)
    alone = engine.log_probs(*rows, micro_batch_size=2)
    errors, same = [], []

    def run():
        try:
            for _ in range(rounds):
                out = engine.log_probs(*rows, micro_batch_size=2)
                same.append(all(torch.equal(a, b) for a, b in zip(out, alone)))
        except Exception as e:  # what the test reports: the first line of each thread's failure
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    dist.destroy_process_group()
    return {"errors": errors, "same": same}
