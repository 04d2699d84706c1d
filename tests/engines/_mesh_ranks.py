"""Rank processes of the mesh (TP/PP/DP) engine tests (tests/engines/test_mesh_train.py), run by
`_mp_workers.run_procs`: each joins a gloo group over TCP, builds a real `MeshTrainEngine` and returns
plain tensors for the test to compare with a single-process `TorchTrainEngine`."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import masked_mean
from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec

from ._common import PAD

HOST = "127.0.0.1"


def nll_loss(out, mb):
    """Token-mean negative log-prob of a micro-batch, and its mean entropy as a metric."""
    loss = masked_mean(-out.log_probs, out.response_mask)
    return loss, {"loss": loss.item(), "entropy": masked_mean(out.entropy, out.response_mask).item()}


def micro_batches(prompts, responses, sizes: list[int], total: int | None = None) -> list[MicroBatch]:
    """Consecutive micro-batches of `sizes` rows, loss_scale = rows / `total` (default: all the rows
    given), last on the final one."""
    out, start, total = [], 0, total or sum(sizes)
    for i, n in enumerate(sizes):
        out.append(MicroBatch({"prompts": prompts[start:start + n], "responses": responses[start:start + n]},
                              loss_scale=n / total, last=i == len(sizes) - 1))
        start += n
    return out


def exported(engine, bucket_bytes: int = 1 << 30) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for b in engine.export_weights(bucket_bytes) for n, t in b]


def _engine(path: str, options: dict, optim: OptimConfig | None, kind: str = "causal_lm", dtype: str = "float32"):
    from mindspeed_rl.engines.train.mesh_train import MeshTrainEngine
    return MeshTrainEngine.build(TrainSpec(model_path=path, model_kind=kind, pad_token_id=PAD, optim=optim, seed=0,
                                           options=options, dtype=dtype))


def value_loss(out, mb):
    loss = masked_mean((out.values - 1.0) ** 2, out.response_mask)
    return loss, {"vf_loss": loss.item()}


def run(rank: int, world: int, port: int, path: str, options: dict, replicas: list, optim: OptimConfig,
        ckpt: str, critic: bool = False) -> dict:
    """On one engine: log-probs, one train_step (data only on the reader), export, log-probs after;
    then a checkpoint round trip: save, a second step on this engine, load into a fresh engine and
    take the same second step there. `replicas[d]` = (prompts, responses, micro-batch sizes) of the
    data-parallel replica d; only its reader is given them."""
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    a = _engine(path, options, optim)
    prompts, responses, sizes = replicas[a.dp_rank]
    reader = a.is_dock_reader
    coord = (a.pp_rank, a.dp_rank, a.tp_rank)
    shards = {n: (tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape))
              for n, p in a.stage.named_parameters()}
    lp_before = a.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=2)
    stats = a.train_step(iter(micro_batches(prompts, responses, sizes)) if reader else None, nll_loss)
    weights = exported(a)
    buckets = [[(n, tuple(t.shape)) for n, t in bk] for bk in a.export_weights(4096)]
    lp_after = a.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=3)
    # replicas with different row counts (replica d drops d rows): the short one pads with dummy forwards
    n = len(prompts) - a.dp_rank
    lp_uneven = a.log_probs(prompts[:n] if reader else None, responses[:n] if reader else None, micro_batch_size=1)

    files = a.save_checkpoint(ckpt)
    second = list(reversed(sizes))
    mbs = micro_batches(list(reversed(prompts)), list(reversed(responses)), second)
    stats_a = a.train_step(iter(mbs) if reader else None, nll_loss)
    wa = exported(a)
    b = _engine(path, options, optim)
    b.load_checkpoint(ckpt)
    loaded = exported(b)
    stats_b = b.train_step(iter(mbs) if reader else None, nll_loss)
    wb = exported(b)
    versions = (a.version, b.version)
    a.close()
    b.close()
    values = None
    if critic:  # a value model (fresh head from the seed): values, one step, values after
        c = _engine(path, options, optim, kind="value")
        values = [c.values(prompts if reader else None, responses if reader else None, micro_batch_size=2)]
        vstats = c.train_step(iter(micro_batches(prompts, responses, sizes)) if reader else None, value_loss)
        values += [c.values(prompts if reader else None, responses if reader else None, micro_batch_size=4), vstats]
        c.close()
    dist.destroy_process_group()
    return {"coord": coord, "reader": reader, "shards": shards, "lp_before": lp_before, "stats": stats,
            "weights": weights, "buckets": buckets,
            "lp_after": lp_after, "lp_uneven": lp_uneven, "files": files, "loaded": loaded, "a": wa, "b": wb,
            "stats_a": stats_a, "stats_b": stats_b, "versions": versions,
            "values": values}


def run_bf16(rank: int, world: int, port: int, path: str, options: dict, rows: tuple, optim: OptimConfig) -> dict:
    """Mixed precision on the mesh (CPU autocast bf16): a trained engine's parameter, gradient and
    AdamW-state dtypes, its export dtype and log-probs before and after one step; an inference
    engine's parameter dtype and log-probs (bf16 activations through the pipeline)."""
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    prompts, responses = rows
    a = _engine(path, options, optim, dtype="bfloat16")
    reader = a.is_dock_reader
    lp_before = a.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=2)
    grad_dtypes = set()
    a.optimizer.register_step_pre_hook(lambda opt, args, kw: grad_dtypes.update(
        str(p.grad.dtype) for p in a.stage.parameters() if p.grad is not None))
    stats = a.train_step(iter(micro_batches(prompts, responses, [2, 2])) if reader else None, nll_loss)
    lp_after = a.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=2)
    out = {"params": sorted({str(p.dtype) for p in a.stage.parameters()}), "grads": sorted(grad_dtypes),
           "optim": sorted({str(t.dtype) for st in a.optimizer.state.values() for k, t in st.items() if k != "step"}),
           "export": sorted({str(t.dtype) for b in a.export_weights(1 << 30) for _, t in b}),
           "lp_before": lp_before, "lp_after": lp_after, "stats": stats}
    a.close()
    b = _engine(path, options, None, dtype="bfloat16")
    out["infer_params"] = sorted({str(p.dtype) for p in b.stage.parameters()})
    out["infer_lp"] = b.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=2)
    b.close()
    dist.destroy_process_group()
    return out
