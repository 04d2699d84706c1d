"""The static decode (engines/rollout/static_decode.py) samples the eager loop's tokens for the same seeds.

On the CPU the fixed-shape step runs eagerly (`cuda_graphs=True` without CUDA): what a CUDA graph would
replay is exactly this function, so equality here is equality of the captured step's arithmetic up to the
device. Log-probs agree to float32 rounding only: the static step's attention reduces over the whole
cache width (masked columns add exact zeros, but in another order), the eager one over the tokens so far."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_rl.engines.base import RolloutSpec, SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.rollout.static_decode import buckets, widths


def _tiny() -> torch.nn.Module:
    from mindspeed_rl.models import load_causal_lm, resolve_model_path
    return load_causal_lm(str(resolve_model_path("builtin:tiny-qwen2")), "float32")


def _prompts(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g) for k in torch.randint(1, 9, (n,), generator=g)]


def _moves(engine: HFRolloutEngine) -> list[list[int]]:
    return [d.moves for free in engine._decoders._free.values() for d in free]


def _assert_same(eager, static) -> None:
    assert [r.tolist() for r in static.responses] == [r.tolist() for r in eager.responses]
    for a, b in zip(eager.log_probs, static.log_probs):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_buckets_are_the_batch_then_powers_of_two_below_it():
    assert buckets(12) == [12, 8, 4, 2, 1]
    assert buckets(8) == [8, 4, 2, 1]
    assert buckets(1) == [1]


SETTINGS = {
    "stop": SamplingParams(max_new_tokens=24, stop_token_ids=(1,)),
    "no_stop": SamplingParams(max_new_tokens=16),
    "temperature_top_k_top_p": SamplingParams(max_new_tokens=24, stop_token_ids=(1, 5), temperature=0.7, top_k=5,
                                              top_p=0.9),
    "greedy": SamplingParams(max_new_tokens=24, stop_token_ids=(3, 8), greedy=True),   # 4 rows end at once
}


@pytest.fixture(scope="module")
def tiny_engines():
    model = _tiny()
    return HFRolloutEngine(model, 0), HFRolloutEngine(model, 0, cuda_graphs=True)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_static_equals_eager_on_the_tiny_model(tiny_engines, name):
    eager, static = tiny_engines
    params, prompts = SETTINGS[name], _prompts(12, 14)
    assert not eager.static and static.static
    want = eager.generate(prompts, params, list(range(100, 112)))
    static._decoders.clear()
    _assert_same(want, static.generate(prompts, params, list(range(100, 112))))
    lengths = {len(r) for r in want.responses}
    [moves] = _moves(static)
    if name == "no_stop":
        assert lengths == {16} and moves == []
    else:   # rows end at different times, and the batch moved down to smaller buckets as they did
        assert len(lengths) >= 2 and moves and moves == sorted(moves, reverse=True) and moves[0] < 12, (lengths, moves)
        if name != "greedy":
            assert len(lengths) > 3, lengths


def test_one_decoder_serves_calls_of_different_prompt_widths(tiny_engines):
    """Sized by the run's longest prompt + response, one decoder (its buffers, its graphs on CUDA) serves every
    call: what a previous call left in the buffers never reaches the next call's tokens."""
    eager, _ = tiny_engines
    static = HFRolloutEngine(eager.model, 0, cuda_graphs=True, max_seq_len=40)
    params = SETTINGS["temperature_top_k_top_p"]
    for seed in range(3):
        prompts = _prompts(12, 14, seed=seed)
        _assert_same(eager.generate(prompts, params, list(range(12))), static.generate(prompts, params, list(range(12))))
    assert len(static._decoders._free) == 1 and [len(v) for v in static._decoders._free.values()] == [1]


def test_cuda_graphs_reaches_the_engine_from_the_spec():
    from mindspeed_rl.models import resolve_model_path
    path = str(resolve_model_path("builtin:tiny-qwen2"))
    assert HFRolloutEngine.build(RolloutSpec(model_path=path, cuda_graphs=True, max_seq_len=30)).static
    auto = HFRolloutEngine.build(RolloutSpec(model_path=path))
    assert not auto.static   # null: on CUDA only
    assert not HFRolloutEngine.build(RolloutSpec(model_path=path, cuda_graphs=False)).static


@pytest.mark.parametrize("value", [None, True, False])
def test_generate_config_cuda_graphs_reaches_the_rollout_engines_declaration(value):
    from mindspeed_rl.config import config_from_dict
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.trainer.worker_specs import engine_decls
    from mindspeed_rl.workers.engine_set import ROLLOUT_ROLE
    cfg = config_from_dict({"generate_config": {"cuda_graphs": value}})
    plan = make_plan(cfg, check_files=True)
    rollouts = [d for gp in plan.groups.values() for d in engine_decls(cfg, plan, gp) if d.role == ROLLOUT_ROLE]
    assert rollouts and all(d.cuda_graphs is value for d in rollouts)


def test_sleep_frees_the_static_buffers(tiny_engines):
    _, static = tiny_engines
    static.generate(_prompts(4, 14), SETTINGS["stop"], [0, 1, 2, 3])
    assert static._decoders._free
    static.sleep()
    assert not static._decoders._free


CONFIG_05B = Path(__file__).resolve().parents[2] / "mindspeed_rl" / "models" / "configs" / "qwen2_5_0_5b.json"


@pytest.mark.slow
def test_static_equals_eager_on_the_qwen25_05b_architecture_cut_to_two_layers():
    """The real architecture (GQA 14/2 heads, 64-dim heads, the 151,936-token vocabulary, tied head), random
    weights: stop tokens picked from the eager run's own samples so rows end at different times."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = json.loads(CONFIG_05B.read_text())
    cfg.update(num_hidden_layers=2, max_window_layers=2)
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    eager, static = HFRolloutEngine(model, 0), HFRolloutEngine(model, 0, cuda_graphs=True)
    prompts, seeds = _prompts(6, 150000), list(range(6))
    for params in (SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50,
                                                                     top_p=0.9)):
        free = eager.generate(prompts, params, seeds)
        _assert_same(free, static.generate(prompts, params, seeds))
        stops = tuple(int(free.responses[r][k]) for r, k in ((0, 1), (2, 4), (4, 6)))
        stopped = SamplingParams(max_new_tokens=10, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, stop_token_ids=stops)
        want = eager.generate(prompts, stopped, seeds)
        static._decoders.clear()
        _assert_same(want, static.generate(prompts, stopped, seeds))
        assert len({len(r) for r in want.responses}) > 2
        [moves] = _moves(static)
        assert moves and moves[0] < 6, moves


def test_widths_are_multiples_of_the_step_then_the_length():
    assert widths(600, 256) == [256, 512, 600]
    assert widths(100, 256) == [100]
    assert widths(512, 256) == [256, 512]


@pytest.mark.parametrize("name", ["stop", "temperature_top_k_top_p", "greedy"])
def test_static_equals_eager_across_width_and_batch_bucket_moves(tiny_engines, name):
    """Width buckets of 8 columns: each call attends over 8, 16, ... columns as its rows grow, and moves to
    smaller batch buckets as rows end; the tokens are the eager loop's."""
    eager, _ = tiny_engines
    static = HFRolloutEngine(eager.model, 0, cuda_graphs=True, max_seq_len=40)
    static.width_step = 8
    params, prompts = SETTINGS[name], _prompts(12, 14)
    _assert_same(eager.generate(prompts, params, list(range(12))), static.generate(prompts, params, list(range(12))))
    [decoder] = [d for free in static._decoders._free.values() for d in free]
    assert decoder.widened and decoder.widened == sorted(decoder.widened) and decoder.moves, (decoder.widened,
                                                                                               decoder.moves)


def _gqa_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True)).eval()


def test_gqa_decode_attention_equals_repeated_kv():
    from transformers.integrations.sdpa_attention import repeat_kv

    from mindspeed_rl.engines.rollout.gqa_decode import gqa_decode_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 16, generator=g) for h, n in ((6, 1), (2, 9), (2, 9)))
    mask = torch.zeros(3, 1, 1, 9).masked_fill_(torch.rand(3, 1, 1, 9, generator=g) < 0.3, torch.finfo(torch.float32).min)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    got, _ = gqa_decode_attention(module, q, k, v, mask)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["stop", "temperature_top_k_top_p", "greedy"])
def test_static_gqa_decode_equals_eager_on_a_grouped_query_model(name):
    """4 query heads over 2 K/V heads: the static engine switches its model to the grouped decode attention,
    the eager engine's copy keeps transformers' SDPA (K/V repeated per query head); same tokens."""
    import copy
    model = _gqa_model()
    eager, static = HFRolloutEngine(model, 0), HFRolloutEngine(copy.deepcopy(model), 0, cuda_graphs=True,
                                                               max_seq_len=40)
    static.width_step = 8
    assert static.model.config._attn_implementation == "mindspeed_gqa_decode"
    assert eager.model.config._attn_implementation != "mindspeed_gqa_decode"
    params, prompts = SETTINGS[name], _prompts(12, 300, seed=1)
    _assert_same(eager.generate(prompts, params, list(range(12))), static.generate(prompts, params, list(range(12))))
