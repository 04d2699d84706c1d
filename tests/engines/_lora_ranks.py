"""Rank processes of the LoRA data-parallel tests (tests/engines/test_lora_dp.py), run by `_mp_workers.run_procs`:
each joins a gloo group and trains real LoRA engines, DDP (torch backend) and FSDP2 (fsdp backend) in turn, on
its half of the rows, and returns plain tensors for the test to compare with one process on the union."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
from mindspeed_rl.engines.train.lora import BaseReference
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, nll_loss_fn

HOST = "127.0.0.1"
STEPS = 2


def spec(path: str, lora: dict, optim: OptimConfig, group) -> TrainSpec:
    return TrainSpec(model_path=path, pad_token_id=PAD, optim=optim, process_group=group, seed=0, lora=lora)


def steps(engine, prompts, responses, n: int) -> list[float]:
    return [engine.train_step(iter([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, True)]),
                              nll_loss_fn)["grad_norm"] for _ in range(n)]


def exported(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in engine.export_weights(16 << 10) for n, t in b}


def train(rank: int, world: int, port: int, path: str, rows: tuple, lora: dict, optim: OptimConfig,
          ckpt_dir: str) -> dict:
    """Per backend: STEPS updates on this rank's rows, then the merged export, the reference's log-probs and
    base checksum; the ranks' adapters after the run; for fsdp, a fresh engine resumed from a checkpoint
    taken after the first update, stepped once more, exported."""
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    prompts, responses = rows
    out = {}
    for name, cls in (("torch", TorchTrainEngine), ("fsdp", FSDPTrainEngine)):
        engine = cls.build(spec(path, lora, optim, group))
        ref = BaseReference(engine)
        base = ref.state_checksum()
        reduced = None
        if name == "torch":   # DDP reduces what requires grad: the adapters alone
            reduced = sorted(n for n, p in engine.model.module.named_parameters() if p.requires_grad)
        norms = steps(engine, prompts, responses, 1)
        if name == "fsdp":
            engine.save_checkpoint(ckpt_dir)
            from torch.distributed.checkpoint import FileSystemReader
            keys = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
        norms += steps(engine, prompts, responses, STEPS - 1)
        out[name] = {"norms": norms, "weights": exported(engine), "base_before": base,
                     "base_after": ref.state_checksum(), "merged": engine.state_checksum() if name == "torch" else None,
                     "ref_log_probs": ref.log_probs(prompts, responses, 2), "reduced": reduced,
                     "log_probs": engine.log_probs(prompts, responses, 2)}
        if name == "fsdp":
            out[name]["checkpoint_keys"] = sorted(k for k in keys if k.startswith("model."))
        if name == "fsdp":
            resumed = cls.build(spec(path, lora, optim, group))
            resumed.load_checkpoint(ckpt_dir)
            out[name]["resumed_norms"] = steps(resumed, prompts, responses, STEPS - 1)
            out[name]["resumed_weights"] = exported(resumed)
            resumed.close()
        engine.close()
    dist.destroy_process_group()
    return out
