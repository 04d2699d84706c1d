"""benchmarks/single_device.py's FLOPs count and plain baselines, without timing anything: MFU divides the FLOPs
the step needs (the head on response positions only), and the plain loop computes the same log-probs as the
full-logits formula while running the head on the response positions alone."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("single_device_bench_baselines",
                                                  REPO / "benchmarks" / "single_device.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_backbone_params_leave_out_the_embedding_and_head(bench):
    # 1,000 parameters, hidden 4, vocabulary 10: a 40-entry table, once when tied, twice when not
    assert bench.backbone_params(1000, 4, 10, tied=True) == 960
    assert bench.backbone_params(1000, 4, 10, tied=False) == 920


def test_needed_flops_by_hand(bench):
    # backbone 100 params, hidden 4, vocabulary 10; 2 rows of 3 prompt + 5 response tokens: 16 tokens, 10 responses
    # forward: 2 x (100 x 16 + 4 x 10 x 10) = 2 x (1600 + 400) = 4000; with the backward x3 = 12000
    assert bench.needed_flops(100, 4, 10, tokens=16, response_tokens=10, backward=False) == 4000
    assert bench.needed_flops(100, 4, 10, tokens=16, response_tokens=10, backward=True) == 12000
    # the head on prompt positions is not counted: more prompt tokens add only the backbone's 2 x 100 each
    assert bench.needed_flops(100, 4, 10, tokens=17, response_tokens=10, backward=False) == 4200
    # Qwen2.5-0.5B (494,032,768 params, hidden 896, vocab 151,936, tied), 64 x (128 + 256): below 6 x N x tokens,
    # by the head's 2 x 136M x 128 prompt positions x 3 and the embedding's lookups
    n, h, v = 494_032_768, 896, 151_936
    b = bench.backbone_params(n, h, v, tied=True)
    got = bench.needed_flops(b, h, v, tokens=64 * 384, response_tokens=64 * 256, backward=True)
    assert got == 6 * (b * 64 * 384 + h * v * 64 * 256)
    assert got / (6 * n * 64 * 384) == pytest.approx(0.908, abs=1e-3)


def test_head_dims_of_the_tiny_model(bench):
    from mindspeed_rl.models import load_causal_lm
    model = load_causal_lm("builtin:tiny-qwen2", "float32")
    d = bench.head_dims(model)
    assert (d["vocab"], d["hidden"]) == tuple(model.get_output_embeddings().weight.shape)
    assert d["tied"] == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    assert d["backbone_params"] == d["params"] - d["hidden"] * d["vocab"] * (1 if d["tied"] else 2)


def test_plain_baseline_log_probs_equal_the_full_logits_formula(bench):
    plain = bench.PlainTrainer("builtin:tiny-qwen2", torch.device("cpu"), pad=0)
    assert plain.optimizer.defaults["foreach"] is True and not plain.optimizer.defaults["fused"]
    g = torch.Generator().manual_seed(0)
    vocab = plain.model.get_output_embeddings().weight.shape[0]
    prompts = [torch.randint(1, vocab, (5,), generator=g) for _ in range(3)]
    responses = [torch.randint(1, vocab, (4,), generator=g) for _ in range(3)]
    got = torch.stack(plain.log_probs(prompts, responses, size=2))
    ids = torch.cat([torch.stack(prompts), torch.stack(responses)], 1)
    with torch.no_grad():
        logits = plain.model(input_ids=ids, use_cache=False).logits[:, 4:8]
    want = torch.log_softmax(logits.float(), -1).gather(-1, torch.stack(responses)[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the head saw the response positions (and the one after): R + 1 rows of logits, not the prompt's
    seen = []
    hook = plain.model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    with torch.no_grad():
        plain.log_probs(prompts, responses, size=3)
    hook.remove()
    assert seen == [4 + 1]


def test_static_generate_runs_on_cuda_only_unless_forced(bench):
    assert bench.parse(["--device", "cpu"]).static_generate is False
    assert bench.parse(["--device", "cpu", "--static-generate"]).static_generate is True
    assert bench.parse(["--device", "cuda:0", "--no-static-generate"]).static_generate is False


def test_rollout_ratios_pair_each_engine_path_with_each_baseline(bench):
    rollout = {"engine": {"tokens_per_s": 300.0}, "engine_static": {"tokens_per_s": 600.0},
               "hf_generate": {"tokens_per_s": 200.0}, "sampling_loop": {"tokens_per_s": 400.0}}
    r = bench.rollout_ratios(rollout)
    assert r["rollout_over_hf_generate"] == 1.5 and r["static_rollout_over_hf_generate"] == 3.0
    assert r["rollout_over_sampling_loop"] == 0.75 and r["static_rollout_over_sampling_loop"] == 1.5
    assert r["rollout_over_hf_static_generate"] is None and r["static_rollout_over_hf_static_generate"] is None
    r = bench.rollout_ratios({**rollout, "hf_generate_static": {"tokens_per_s": 1200.0}})
    assert r["static_rollout_over_hf_static_generate"] == 0.5
