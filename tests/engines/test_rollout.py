"""HFRolloutEngine: its KV-cache loop against a plain full-forward greedy decode, seeding, stop
tokens and the sampling filters."""
import pytest
import torch

from mindspeed_rl.engines import HFRolloutEngine, SamplingParams
from mindspeed_rl.engines.hf_rollout import filter_logits, sample_next

from ._common import PAD, random_rows, tiny_qwen2

NEG = float("-inf")


@pytest.fixture(scope="module")
def sharp_engine():
    """Large init: logits with clear argmax margins, so greedy comparisons are exact."""
    return HFRolloutEngine(tiny_qwen2(seed=3, initializer_range=0.3), PAD)


@pytest.fixture(scope="module")
def flat_engine():
    """The built-in initialisation: near-uniform next-token distributions, good for sampling."""
    return HFRolloutEngine(tiny_qwen2(seed=3), PAD)


@pytest.fixture(scope="module")
def prompts():
    return random_rows(5, [4, 1, 7, 2, 5], seed=0)  # different lengths: left padding matters


@torch.no_grad()
def greedy_reference(model, prompt, max_new_tokens, stop=()):
    """Argmax decoding, one row at a time, a full forward per token: no cache, no padding, default
    position ids. Returns the tokens and the smallest top-1/top-2 logit margin seen."""
    seq, out, margin = prompt.clone(), [], float("inf")
    for _ in range(max_new_tokens):
        logits = model(input_ids=seq[None], use_cache=False).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tok = int(logits.argmax())
        out.append(tok)
        seq = torch.cat([seq, torch.tensor([tok])])
        if tok in stop:
            break
    return torch.tensor(out, dtype=torch.long), margin


def same_rows(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_greedy_equals_full_forward_argmax(sharp_engine, prompts):
    n = 10
    got = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
    assert len(got) == len(prompts)
    for prompt, resp in zip(prompts, got):
        ref, margin = greedy_reference(sharp_engine.model, prompt, n)
        assert margin > 1e-3  # a meaningful comparison: no near-ties
        assert resp.dtype == torch.long and resp.tolist() == ref.tolist()
    # the batch and its rows alone agree too (padding does not leak into other rows)
    alone = [sharp_engine.generate([p], SamplingParams(max_new_tokens=n, greedy=True), seed=0)[0] for p in prompts]
    assert same_rows(got, alone)


def test_temperature_zero_top_k_one_and_tiny_top_p_are_greedy(sharp_engine, prompts):
    greedy = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True), seed=0)
    for params in (SamplingParams(max_new_tokens=8, temperature=0.0),
                   SamplingParams(max_new_tokens=8, top_k=1),
                   SamplingParams(max_new_tokens=8, temperature=1.7, top_k=1),
                   SamplingParams(max_new_tokens=8, top_p=1e-6)):
        for seed in (0, 1):
            assert same_rows(sharp_engine.generate(prompts, params, seed=seed), greedy), params


def test_same_seed_same_samples_different_seed_different(flat_engine, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    a = flat_engine.generate(prompts, params, seed=7)
    b = flat_engine.generate(prompts, params, seed=7)
    c = flat_engine.generate(prompts, params, seed=8)
    assert same_rows(a, b)
    assert not same_rows(a, c)
    assert all(len(r) == 12 for r in a)  # no stop tokens: cut at max_new_tokens
    # sampling is not argmax decoding here (the distributions are near-uniform)
    greedy = flat_engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True), seed=7)
    assert not same_rows(a, greedy)
    # generation leaves the global RNG alone: the explicit generator is the only randomness
    torch.manual_seed(0)
    x = torch.rand(3)
    torch.manual_seed(0)
    flat_engine.generate(prompts, params, seed=7)
    assert torch.equal(torch.rand(3), x)


def test_stop_tokens_end_responses(sharp_engine, prompts):
    n = 10
    free = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
    # a stop token that greedy decoding does emit mid-response in some row
    counts = torch.bincount(torch.cat([r[:-1] for r in free]), minlength=16)
    stop = int(counts.argmax())
    other = int(torch.bincount(torch.cat([r[:-1] for r in free]), minlength=16)
                .masked_fill(torch.arange(16) == stop, 0).argmax())
    for stops in ((stop,), (stop, other)):
        got = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True, stop_token_ids=stops),
                                    seed=0)
        cut_any = False
        for prompt, full, resp in zip(prompts, free, got):
            hits = [i for i, t in enumerate(full.tolist()) if t in stops]
            want = full[:hits[0] + 1] if hits else full  # through the first stop token, inclusive
            assert resp.tolist() == want.tolist()
            assert len(resp) == (hits[0] + 1 if hits else n)
            ref, _ = greedy_reference(sharp_engine.model, prompt, n, stop=stops)
            assert resp.tolist() == ref.tolist()
            cut_any |= len(resp) < n
        assert cut_any  # the test did exercise a stop


def test_stop_tokens_with_sampling(flat_engine, prompts):
    stops = (2, 5)
    got = flat_engine.generate(prompts * 4, SamplingParams(max_new_tokens=15, stop_token_ids=stops), seed=3)
    lengths = set()
    for r in got:
        ids = r.tolist()
        assert 1 <= len(ids) <= 15
        assert not any(t in stops for t in ids[:-1])  # nothing follows a stop token
        assert ids[-1] in stops or len(ids) == 15
        lengths.add(len(ids))
    assert len(lengths) > 1  # rows did finish at different steps


def test_max_new_tokens_cuts(sharp_engine, prompts):
    for n in (1, 3):
        got = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
        assert [len(r) for r in got] == [n] * len(prompts)
        longer = sharp_engine.generate(prompts, SamplingParams(max_new_tokens=n + 4, greedy=True), seed=0)
        assert all(torch.equal(a, b[:n]) for a, b in zip(got, longer))


def test_weight_version_and_sync_view(sharp_engine):
    assert sharp_engine.weight_version == 0
    names = [n for n, _ in sharp_engine.named_parameters_for_sync()]
    assert names == [n for n, _ in sharp_engine.model.named_parameters()]
    assert not any(p.requires_grad for p in sharp_engine.model.parameters())
    assert not sharp_engine.model.training


# ------------------------------------------------------------------------------- filters

def test_filter_logits_top_k():
    x = torch.tensor([[2.0, 4.0, 1.0, 3.0]])
    assert filter_logits(x, 1.0, 2).tolist() == [[NEG, 4.0, NEG, 3.0]]
    assert filter_logits(x, 1.0, 1).tolist() == [[NEG, 4.0, NEG, NEG]]
    assert torch.equal(filter_logits(x, 1.0, 0), x)  # 0 = off
    assert torch.equal(filter_logits(x, 1.0, 4), x)  # k >= vocab = off


def test_filter_logits_top_p_by_hand():
    # sorted: 4, 3, 2, 1 with softmax probs .6439, .2369, .0871, .0321 (mass before: 0, .644, .881, .968)
    x = torch.tensor([[2.0, 4.0, 1.0, 3.0]])
    assert filter_logits(x, 0.6, 0).tolist() == [[NEG, 4.0, NEG, NEG]]
    assert filter_logits(x, 0.7, 0).tolist() == [[NEG, 4.0, NEG, 3.0]]
    assert filter_logits(x, 0.9, 0).tolist() == [[2.0, 4.0, NEG, 3.0]]
    assert filter_logits(x, 0.99, 0).tolist() == x.tolist()
    assert filter_logits(x, 1e-9, 0).tolist() == [[NEG, 4.0, NEG, NEG]]  # the top token always stays


def test_filter_logits_top_k_then_top_p_rows_independent():
    # after top-3 the renormalised probs of 4, 3, 2 are .665, .245, .090 (mass before 2: .910)
    x = torch.tensor([[2.0, 4.0, 1.0, 3.0], [0.0, 0.0, 0.0, 10.0]])
    out = filter_logits(x, 0.9, 3)
    assert out[0].tolist() == [NEG, 4.0, NEG, 3.0]  # without top-k, 0.9 keeps the 2 (see above)
    assert out[1].tolist() == [NEG, NEG, NEG, 10.0]


def test_sample_next():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, SamplingParams(greedy=True), g).tolist() == [1, 0]
    assert sample_next(logits, SamplingParams(temperature=0.0), g).tolist() == [1, 0]
    assert sample_next(logits, SamplingParams(top_k=1), g).tolist() == [1, 0]
    # a very low temperature is argmax in practice; top_k=2 never picks the smallest logit
    assert sample_next(logits, SamplingParams(temperature=1e-3), g).tolist() == [1, 0]
    picks = torch.stack([sample_next(logits, SamplingParams(top_k=2), g) for _ in range(200)])
    assert set(picks[:, 0].tolist()) == {1, 2} and set(picks[:, 1].tolist()) == {0, 2}
    # the explicit generator decides the draw
    draw = [sample_next(logits, SamplingParams(temperature=5.0), torch.Generator().manual_seed(s)).tolist()
            for s in (1, 1, 2, 3, 4)]
    assert draw[0] == draw[1]
