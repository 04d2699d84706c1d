"""benchmarks/single_device.py's model-feature flags and its memory estimates, without running a model: the
flags reach the train engines' TrainSpec and the end-to-end overrides, and each estimate is the memory plan's
own term (planning/memory.py) for the benchmark's sizes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("single_device_bench", REPO / "benchmarks" / "single_device.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_feature_flags_reach_the_engines_and_the_trainer(bench):
    a = bench.parse(["--device", "cpu", "--gradient-checkpointing", "--lora", "8"])
    spec = bench.train_spec(a, "builtin:tiny-qwen2", 0, torch.device("cpu"))
    assert spec.gradient_checkpointing is True
    assert spec.lora == {"rank": 8, "alpha": 16.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": None}
    o = bench.e2e_overrides(a, "ckpt", "/tmp/out", torch.device("cpu"))
    assert "actor_config.gradient_checkpointing=true" in o and "actor_config.lora.rank=8" in o
    plain = bench.parse(["--device", "cpu"])
    assert bench.train_spec(plain, "x", 0, torch.device("cpu")).lora is None
    assert "actor_config.lora.rank=0" in bench.e2e_overrides(plain, "ckpt", "/tmp/out", torch.device("cpu"))


def test_memory_estimates_are_the_plans_terms(bench):
    from mindspeed_rl.planning import memory_terms as M
    a = bench.parse(["--device", "cpu", "--model", "tiny", "--micro-batch", "2", "--train-prompt-len", "8",
                     "--train-response-len", "4", "--gradient-checkpointing"])
    est = bench.memory_estimates(a, "builtin:tiny-qwen2", torch.device("cpu"))
    d, _ = M.load_dims("builtin:tiny-qwen2")
    assert est["train weights"] == pytest.approx(d.params() * 4 / 1e9)
    assert est["optimizer state"] == pytest.approx(d.params() * 8 / 1e9)
    assert est["activations"] == pytest.approx(M.train_activation_bytes(d, 2 * 12, 4, False, True) / 1e9)
    assert est["rollout generate peak"] == pytest.approx(
        (M.kv_cache_bytes(d, a.rows, a.prompt_len + a.new_tokens, 4)
         + M.inference_activation_bytes(d, a.rows * a.prompt_len, 4) + M.decode_logits_bytes(d, a.rows)) / 1e9)
