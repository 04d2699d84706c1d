"""The megatron engine on CUDA against the torch backend: log-probs, a train step, export into a reader,
checkpoint save and load, a NaN step skipped, over TP/PP/DP layouts (skipped without a GPU and
megatron-core; test_megatron_convert.py checks the parts that run on the CPU)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from . import _mp_workers as W
from .test_megatron_convert import qwen2

ENGINE_OPTIM = dict(lr=1e-3, eps=1e-6, grad_clip=1.0)   # eps well above float noise: Adam does not blow
                                                        # up the ~0 gradient of k_proj.bias into a step


def _engine_data():
    from ._common import random_rows
    return random_rows(6, [3, 5, 2, 4, 3, 6], seed=1), random_rows(6, [4, 2, 5, 1, 3, 2], seed=2)


def _nll(out, mb):
    from mindspeed_rl.algorithms import masked_mean
    loss = masked_mean(-out.log_probs, out.response_mask)
    return loss, {"nll": float(loss.detach()), "entropy": float(masked_mean(out.entropy, out.response_mask).detach())}


def _micro_batches(prompts, responses):
    from mindspeed_rl.engines.base import MicroBatch
    return [MicroBatch({"prompts": prompts[:4], "responses": responses[:4]}, loss_scale=4 / 6),
            MicroBatch({"prompts": prompts[4:], "responses": responses[4:]}, loss_scale=2 / 6, last=True)]


def _engine_rank(rank: int, world: int, port: int, ckpt: str, options: dict, device_kind: str, out_dir: str) -> dict:
    """One rank of a MegatronTrainEngine (the real one, on `device_kind`): log-probs, a train step,
    export -> a reader engine's update_weights, checkpoint save/step/load, a NaN step skipped."""
    import datetime

    import torch.distributed as dist

    from mindspeed_rl.device import dist_backend
    from mindspeed_rl.engines.base import OptimConfig, TrainSpec
    from mindspeed_rl.engines.train.megatron.engine import MegatronTrainEngine
    device = f"cuda:{rank}" if device_kind == "cuda" else device_kind
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device_kind == "cpu" else dist_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        eng = MegatronTrainEngine.build(TrainSpec(model_path=ckpt, device=device, optim=OptimConfig(**ENGINE_OPTIM),
                                                  options=options))
        prompts, responses = _engine_data()
        mine = (lambda x: x) if eng.is_dock_reader else (lambda x: None)
        mbs = lambda: iter(_micro_batches(prompts, responses)) if eng.is_dock_reader else None  # noqa: E731
        out = {"coord": eng.coord, "last_stage": eng.last_stage}
        out["lp0"] = eng.log_probs(mine(prompts), mine(responses), 4)
        out["metrics"] = eng.train_step(mbs(), _nll)
        out["lp1"] = eng.log_probs(mine(prompts), mine(responses), 4)
        out["exported"] = [(n, t.detach().cpu().clone()) for b in eng.export_weights(1 << 16) for n, t in b]
        reader = MegatronTrainEngine.build(TrainSpec(model_path=ckpt, device=device, options=options))
        reader.update_weights(iter(out["exported"]), 1)
        out["lp_reader"] = reader.log_probs(mine(prompts), mine(responses), 3)
        where = os.path.join(out_dir, "ckpt")
        out["files"] = eng.save_checkpoint(where)
        eng.train_step(mbs(), _nll)
        eng.load_checkpoint(where)
        out["version_loaded"] = eng.version
        out["lp_loaded"] = eng.log_probs(mine(prompts), mine(responses), 4)

        def nan_loss(o, mb):
            loss, m = _nll(o, mb)
            return loss * float("nan"), m
        out["nan_metrics"] = eng.train_step(mbs(), nan_loss)
        out["version_after_nan"] = eng.version
        out["lp_after_nan"] = eng.log_probs(mine(prompts), mine(responses), 4)
        reader.close()
        eng.close()
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _engine_reference(ckpt: str) -> dict:
    from mindspeed_rl.engines.base import OptimConfig
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.models import load_causal_lm
    eng = TorchTrainEngine(load_causal_lm(ckpt), 0, OptimConfig(**ENGINE_OPTIM))
    prompts, responses = _engine_data()
    lp0 = eng.log_probs(prompts, responses, 4)
    metrics = eng.train_step(iter(_micro_batches(prompts, responses)), _nll)
    return {"lp0": lp0, "metrics": metrics, "lp1": eng.log_probs(prompts, responses, 4),
            "weights": {n: p.detach().clone() for n, p in eng.module.named_parameters(remove_duplicate=False)}}


def check_engine_results(results: list[dict], ref: dict, atol: float) -> None:
    """Every rank against the torch backend (shared by the CUDA test and its CPU dry run)."""
    def close(a, b):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=atol)
    for r in results:
        if not r["last_stage"]:
            assert r["lp0"] is None and r["lp1"] is None
        else:
            close(r["lp0"], ref["lp0"])
            close(r["lp1"], ref["lp1"])
            close(r["lp_reader"], r["lp1"])
            close(r["lp_loaded"], r["lp1"])
            close(r["lp_after_nan"], r["lp1"])
        for k in ("nll", "entropy", "grad_norm", "micro_batches"):
            assert r["metrics"][k] == pytest.approx(ref["metrics"][k], abs=atol), k
        exported = dict(r["exported"])
        assert list(exported) == list(ref["weights"])
        for n, w in ref["weights"].items():
            torch.testing.assert_close(exported[n].float(), w, rtol=0, atol=10 * atol, msg=n)
        assert r["version_loaded"] == 1 and r["version_after_nan"] == 2
        assert r["nan_metrics"]["grad_norm"] != r["nan_metrics"]["grad_norm"]  # NaN: the update was skipped


def _save_engine_checkpoint(directory, tied: bool) -> str:
    model = qwen2(seed=3, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=tied)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(str(directory))
    return str(directory)


ENGINE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]   # tp, pp, dp


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None
                    or importlib.util.find_spec("megatron.core") is None,
                    reason="needs a CUDA GPU and megatron-core (docs/engines.md: how to run on a GPU)")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp, pp, dp", ENGINE_LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in ENGINE_LAYOUTS])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["adam", "distopt"])
def test_megatron_engine_on_cuda_matches_torch_backend(tp, pp, dp, tied, dist_opt, tmp_path):
    world = tp * pp * dp
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from mindspeed_rl.engines.sync.weight_sync import free_port
    ckpt = _save_engine_checkpoint(tmp_path / "hf", tied)
    # megatron's local layers here (the default `auto` would build TE's where it is installed: the test below)
    options = {"tp": tp, "pp": pp, "use_distributed_optimizer": dist_opt, "layer_spec": "local"}
    port = free_port()
    results = W.run_procs([(_engine_rank, (r, world, port, ckpt, options, "cuda", str(tmp_path)))
                           for r in range(world)], tmp_path, 600)
    check_engine_results(results, _engine_reference(ckpt), atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("megatron") is None
                    or importlib.util.find_spec("megatron.core") is None
                    or importlib.util.find_spec("transformer_engine") is None,
                    reason="needs a CUDA GPU, megatron-core and transformer-engine")
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_engine_te_layer_spec_on_cuda(tp, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from mindspeed_rl.engines.sync.weight_sync import free_port
    ckpt = _save_engine_checkpoint(tmp_path / "hf", tied=True)
    options = {"tp": tp, "pp": 1, "layer_spec": "te"}
    port = free_port()
    results = W.run_procs([(_engine_rank, (r, tp, port, ckpt, options, "cuda", str(tmp_path))) for r in range(tp)],
                          tmp_path, 600)
    check_engine_results(results, _engine_reference(ckpt), atol=1e-4)
