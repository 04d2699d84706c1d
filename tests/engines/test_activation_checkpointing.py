"""Activation checkpointing (`TrainSpec.gradient_checkpointing`) on the torch backend, one process: a
policy, a critic and a reward model each take one train step with it on and off; losses and
gradients agree in fp32 and each decoder layer really ran twice per training forward (the recompute).
The multi-rank backends (DDP, FSDP2 dp 2, the mesh at tp 2) are in test_token_budget_backends.py;
megatron's mapping onto its TransformerConfig is checked here (megatron-core does not run on a CPU)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.engines import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, flat_grads, nll_loss_fn, random_rows, tiny_qwen2

PROMPTS = random_rows(4, [3, 1, 5, 2], seed=31)
RESPONSES = random_rows(4, [4, 6, 1, 3], seed=32)
REJECTED = random_rows(4, [2, 5, 3, 1], seed=33)


def value_loss(out, mb):
    from mindspeed_rl.algorithms import masked_mean
    loss = masked_mean((out.values - 1.0) ** 2, out.response_mask)
    return loss, {"loss": float(loss.detach())}


def pair_loss(out, mb):
    b = len(mb.data["prompts"])
    loss = -torch.nn.functional.logsigmoid(out.scores[:b] - out.scores[b:]).mean()
    return loss, {"loss": float(loss.detach())}


def layer_calls(engine) -> list[int]:
    """A counter of forward calls of the model's first decoder layer (recomputes included)."""
    from mindspeed_rl.engines.train.fsdp_train import decoder_layers
    calls = [0]
    decoder_layers(engine.module)[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def one_step(path: str, kind: str, checkpointing: bool, loss_fn, data: dict) -> dict:
    engine = TorchTrainEngine.build(TrainSpec(model_path=path, model_kind=kind, pad_token_id=PAD, seed=5,
                                              optim=OptimConfig(lr=1e-2, eps=1e-4),
                                              gradient_checkpointing=checkpointing))
    grads = {}
    engine.optimizer.register_step_pre_hook(lambda *_: grads.update(g=flat_grads(engine.module)))
    calls = layer_calls(engine)
    mbs = [MicroBatch({k: v[:2] for k, v in data.items()}, 0.5),
           MicroBatch({k: v[2:] for k, v in data.items()}, 0.5, last=True)]
    stats = engine.train_step(mbs, loss_fn)
    log_calls = calls[0]
    if kind == "causal_lm":   # an inference pass after training: no recompute under no_grad
        engine.log_probs(PROMPTS, RESPONSES, micro_batch_size=4)
    return {"stats": stats, "grads": grads["g"], "train_calls": log_calls, "infer_calls": calls[0] - log_calls}


@pytest.mark.parametrize("kind", ["causal_lm", "value", "reward"])
def test_checkpointing_gives_the_same_loss_and_gradients(tmp_path, kind):
    tiny_qwen2(seed=0).save_pretrained(tmp_path)
    loss_fn, data = {"causal_lm": (nll_loss_fn, {"prompts": PROMPTS, "responses": RESPONSES}),
                     "value": (value_loss, {"prompts": PROMPTS, "responses": RESPONSES}),
                     "reward": (pair_loss, {"prompts": PROMPTS, "chosen": RESPONSES, "rejected": REJECTED})}[kind]
    off, on = (one_step(str(tmp_path), kind, c, loss_fn, data) for c in (False, True))
    assert off["train_calls"] == 2 and on["train_calls"] == 4      # two forwards; with it on, each recomputed
    key = "nll" if kind == "causal_lm" else "loss"
    assert on["stats"][key] == pytest.approx(off["stats"][key], rel=0, abs=1e-6)
    torch.testing.assert_close(on["grads"], off["grads"], rtol=0, atol=1e-6)
    assert on["stats"]["grad_norm"] == pytest.approx(off["stats"]["grad_norm"], rel=1e-6)
    if kind == "causal_lm":
        assert on["infer_calls"] == 1    # inference: one forward, nothing recomputed


def test_an_inference_engine_ignores_it(tmp_path):
    tiny_qwen2(seed=0).save_pretrained(tmp_path)
    engine = TorchTrainEngine.build(TrainSpec(model_path=str(tmp_path), pad_token_id=PAD, gradient_checkpointing=True))
    assert not engine.module.is_gradient_checkpointing


def test_megatron_recompute_options():
    from mindspeed_rl.engines.train.megatron.setup import recompute_kwargs
    assert recompute_kwargs(False) == {}
    assert recompute_kwargs(True) == {"recompute_granularity": "full", "recompute_method": "uniform",
                                      "recompute_num_layers": 1}
