"""Rank processes of the Hugging Face export tests (tests/trainer/test_hf_export.py), run by
`tests.engines._mp_workers.run_procs`: each joins a gloo group, builds a real sharded engine (FSDP2 over dp,
the mesh backend at tp or pp 2), takes one optimizer step, saves its checkpoint, and exports its weights as
the trainer's worker does (`Worker.save_hf`: every rank draws the buckets, rank 0 writes); then the
engine's own log-probs of fixed rows, for the test to compare with the exported model's."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from mindspeed_rl.algorithms import masked_mean
from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.models.hf_export import write_hf_checkpoint

HOST = "127.0.0.1"
PAD = 0
OPTIM = OptimConfig(lr=1e-2)


def nll_loss(out, mb):
    loss = masked_mean(-out.log_probs, out.response_mask)
    return loss, {"loss": loss.item()}


def build(backend: str, path: str, options: dict, kind: str = "causal_lm"):
    """`options`: the backend's, and "lora" (LoraConfig's fields) for a LoRA policy."""
    options = dict(options)
    lora = options.pop("lora", None)
    spec = TrainSpec(model_path=path, model_kind=kind, pad_token_id=PAD, optim=OPTIM, seed=0, options=options,
                     process_group=dist.group.WORLD if backend == "fsdp" else None, lora=lora)
    if backend == "fsdp":
        from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
        return FSDPTrainEngine.build(spec)
    from mindspeed_rl.engines.train.mesh_train import MeshTrainEngine
    return MeshTrainEngine.build(spec)


def train_save_export(rank: int, world: int, port: int, backend: str, path: str, options: dict, rows: tuple,
                      ckpt: str, hf_dir: str, bucket_bytes: int) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    prompts, responses = rows
    engine = build(backend, path, options)
    reader = engine.is_dock_reader
    # FSDP: each rank trains on its half of the rows; the mesh: the replica's reader hands it all of them
    mine = (prompts[rank::world], responses[rank::world]) if backend == "fsdp" else (prompts, responses)
    mb = MicroBatch({"prompts": mine[0], "responses": mine[1]}, loss_scale=1.0, last=True)
    engine.train_step(iter([mb]) if reader else None, nll_loss)
    engine.save_checkpoint(ckpt)
    buckets = engine.export_weights(bucket_bytes)
    if rank == 0:
        write_hf_checkpoint(buckets, hf_dir, path, dtype="float32", source=f"{backend} engine")
    else:
        for _ in buckets:
            pass
    lp = engine.log_probs(prompts if reader else None, responses if reader else None, micro_batch_size=4)
    engine.close()
    dist.destroy_process_group()
    return {"log_probs": lp}
