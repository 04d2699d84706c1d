"""Rank processes of test_token_budget_backends.py, run by `_mp_workers.run_procs`: each joins a gloo group
over TCP and builds real engines (FSDP2 at dp 2, the mesh at tp 2) with activation checkpointing and a
token budget off and on, so one spawn checks every combination against the plain path on the same rank."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec

from ._common import PAD
from ._fsdp_ranks import nll_loss, value_loss

HOST = "127.0.0.1"
OPTIM = OptimConfig(lr=1e-2, eps=1e-4)
# (gradient_checkpointing, max_tokens_per_micro_batch): the plain path first
COMBOS = [(False, None), (True, None), (False, 24), (True, 24)]


def _join(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _local_grads(params) -> torch.Tensor:
    return torch.cat([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().reshape(-1).clone()
                      for p in params if p.grad is not None])


def _counter(layer: torch.nn.Module) -> list[int]:
    calls = [0]
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _step(engine, params, layer, mbs, loss_fn, reader: bool = True) -> dict:
    grads = {}
    engine.optimizer.register_step_pre_hook(lambda *_: grads.update(g=_local_grads(params())))
    calls = _counter(layer)
    stats = engine.train_step(iter(mbs) if reader else None, loss_fn)
    return {"stats": stats, "grads": grads["g"], "layer_calls": calls[0]}


def fsdp(rank: int, world: int, port: int, path: str, rows: tuple, sizes: list[int]) -> dict:
    """Per combination: log-probs of this rank's rows, one train step (micro-batches of `sizes` rows) of
    a policy, then a critic's values and step; the local gradient shards, the metrics, how many forwards
    each micro-batch split into here and how often the first decoder layer ran."""
    from mindspeed_rl.engines.batching import forward_groups
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine, decoder_layers

    _join(rank, world, port)
    prompts, responses = rows
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    mbs = [MicroBatch({"prompts": prompts[s:s + n], "responses": responses[s:s + n]}, n / len(prompts),
                      last=i == len(sizes) - 1) for i, (s, n) in enumerate(zip(starts, sizes))]
    out = {}
    for gc, budget in COMBOS:
        res = {}
        for kind, loss_fn in (("causal_lm", nll_loss), ("value", value_loss)):
            spec = TrainSpec(model_path=path, model_kind=kind, pad_token_id=PAD, optim=OPTIM, seed=0,
                             process_group=dist.group.WORLD, gradient_checkpointing=gc,
                             max_tokens_per_micro_batch=budget)
            engine = FSDPTrainEngine.build(spec)
            infer = engine.log_probs if kind == "causal_lm" else engine.values
            before = infer(prompts, responses, micro_batch_size=2)
            step = _step(engine, lambda: engine.model.parameters(), decoder_layers(engine.model)[0], mbs, loss_fn)
            res[kind] = {"before": before, **step, "after": infer(prompts, responses, micro_batch_size=2)}
            engine.close()
        res["splits"] = [len(forward_groups(mb.data["prompts"], mb.data["responses"], len(mb.data["prompts"]),
                                            budget)) for mb in mbs]
        res["infer_groups"] = len(forward_groups(prompts, responses, 2, budget))
        out[(gc, budget)] = res
    dist.destroy_process_group()
    return out


def mesh(rank: int, world: int, port: int, path: str, options: dict, rows: tuple, sizes: list[int]) -> dict:
    """As `fsdp` on a mesh (the reader is given the rows, the others None): log-probs, a train step,
    log-probs after, per combination."""
    from mindspeed_rl.engines.train.mesh_train import MeshTrainEngine

    _join(rank, world, port)
    prompts, responses = rows
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out = {}
    for gc, budget in COMBOS:
        engine = MeshTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OPTIM, seed=0,
                                                 options=options, gradient_checkpointing=gc,
                                                 max_tokens_per_micro_batch=budget))
        reader = engine.is_dock_reader
        mbs = [MicroBatch({"prompts": prompts[s:s + n], "responses": responses[s:s + n]}, n / len(prompts),
                          last=i == len(sizes) - 1) for i, (s, n) in enumerate(zip(starts, sizes))]
        layers = list(engine.stage.model.layers.values())
        before = engine.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=2)
        step = _step(engine, lambda: engine.stage.parameters(), layers[0], mbs, nll_loss, reader)
        after = engine.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=3)
        out[(gc, budget)] = {"before": before, **step, "after": after}
        engine.close()
    dist.destroy_process_group()
    return out
