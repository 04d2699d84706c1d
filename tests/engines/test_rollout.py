"""HFRolloutEngine: its KV-cache loop against a plain full-forward greedy decode, seeding, stop
tokens and the sampling filters."""
import pytest
import torch

from mindspeed_rl.engines import SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.rollout.hf_rollout import filter_logits
from mindspeed_rl.engines.rollout.sampling import row_uniforms, sample_next

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


def seeds_for(n: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def gen(engine, prompts, params, seed):
    """Responses only, row i seeded with seed * 1000 + i."""
    return engine.generate(prompts, params, seeds_for(len(prompts), seed)).responses


def same_rows(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_greedy_equals_full_forward_argmax(sharp_engine, prompts):
    n = 10
    got = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
    assert len(got) == len(prompts)
    for prompt, resp in zip(prompts, got):
        ref, margin = greedy_reference(sharp_engine.model, prompt, n)
        assert margin > 1e-3  # a meaningful comparison: no near-ties
        assert resp.dtype == torch.long and resp.tolist() == ref.tolist()
    # the batch and its rows alone agree too (padding does not leak into other rows)
    alone = [gen(sharp_engine, [p], SamplingParams(max_new_tokens=n, greedy=True), seed=0)[0] for p in prompts]
    assert same_rows(got, alone)


def test_temperature_zero_top_k_one_and_tiny_top_p_are_greedy(sharp_engine, prompts):
    greedy = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=8, greedy=True), seed=0)
    for params in (SamplingParams(max_new_tokens=8, temperature=0.0),
                   SamplingParams(max_new_tokens=8, top_k=1),
                   SamplingParams(max_new_tokens=8, temperature=1.7, top_k=1),
                   SamplingParams(max_new_tokens=8, top_p=1e-6)):
        for seed in (0, 1):
            assert same_rows(gen(sharp_engine, prompts, params, seed=seed), greedy), params


def test_same_seed_same_samples_different_seed_different(flat_engine, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    a = gen(flat_engine, prompts, params, seed=7)
    b = gen(flat_engine, prompts, params, seed=7)
    c = gen(flat_engine, prompts, params, seed=8)
    assert same_rows(a, b)
    assert not same_rows(a, c)
    assert all(len(r) == 12 for r in a)  # no stop tokens: cut at max_new_tokens
    # sampling is not argmax decoding here (the distributions are near-uniform)
    greedy = gen(flat_engine, prompts, SamplingParams(max_new_tokens=12, greedy=True), seed=7)
    assert not same_rows(a, greedy)
    # generation leaves the global RNG alone: the explicit generator is the only randomness
    torch.manual_seed(0)
    x = torch.rand(3)
    torch.manual_seed(0)
    gen(flat_engine, prompts, params, seed=7)
    assert torch.equal(torch.rand(3), x)


def test_stop_tokens_end_responses(sharp_engine, prompts):
    n = 10
    free = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
    # a stop token that greedy decoding does emit mid-response in some row
    counts = torch.bincount(torch.cat([r[:-1] for r in free]), minlength=16)
    stop = int(counts.argmax())
    other = int(torch.bincount(torch.cat([r[:-1] for r in free]), minlength=16)
                .masked_fill(torch.arange(16) == stop, 0).argmax())
    for stops in ((stop,), (stop, other)):
        got = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=n, greedy=True, stop_token_ids=stops),
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
    got = gen(flat_engine, prompts * 4, SamplingParams(max_new_tokens=15, stop_token_ids=stops), seed=3)
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
        got = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
        assert [len(r) for r in got] == [n] * len(prompts)
        longer = gen(sharp_engine, prompts, SamplingParams(max_new_tokens=n + 4, greedy=True), seed=0)
        assert all(torch.equal(a, b[:n]) for a, b in zip(got, longer))


def test_weight_version_and_update(sharp_engine):
    assert sharp_engine.weight_version == 0
    assert not any(p.requires_grad for p in sharp_engine.model.parameters())
    assert not sharp_engine.model.training
    names = [n for n, _ in sharp_engine.named_weights()]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # tied: both names


def test_update_weights_by_name_reaches_the_model(prompts):
    engine = HFRolloutEngine(tiny_qwen2(seed=3), PAD)
    other = tiny_qwen2(seed=4)
    before = engine.state_checksum()
    engine.update_weights(list(other.named_parameters(remove_duplicate=False))[:3], version=1)
    assert engine.state_checksum() != before and engine.weight_version == 1
    engine.update_weights(other.named_parameters(remove_duplicate=False), version=2)
    ref = HFRolloutEngine(other, PAD)
    assert engine.state_checksum() == ref.state_checksum()
    params = SamplingParams(max_new_tokens=6)
    assert same_rows(gen(engine, prompts, params, 1), gen(ref, prompts, params, 1))
    with pytest.raises(ValueError, match="'nope.weight' is not a weight"):
        engine.update_weights([("nope.weight", torch.zeros(1))], version=3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(2, 2))], version=3)


def test_a_row_samples_the_same_tokens_alone_or_in_any_batch(flat_engine, prompts):
    params = SamplingParams(max_new_tokens=8)
    seeds = seeds_for(len(prompts), 5)
    together = flat_engine.generate(prompts, params, seeds).responses
    alone = [flat_engine.generate([p], params, [s]).responses[0] for p, s in zip(prompts, seeds)]
    reordered = flat_engine.generate(prompts[::-1], params, seeds[::-1]).responses[::-1]
    assert same_rows(together, alone) and same_rows(together, reordered)
    with pytest.raises(ValueError, match="one seed per row"):
        flat_engine.generate(prompts, params, seeds[:2])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_are_the_trainers_log_probs_of_the_sampled_tokens(flat_engine, prompts, temperature):
    """The behaviour log-probs the rollout returns equal a full forward's log_softmax(logits / T) at
    the sampled tokens: the trainer's old_log_prob for on-policy rows."""
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    out = flat_engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature,
                                                       stop_token_ids=(2,)), seeds_for(len(prompts), 9))
    trainer = TorchTrainEngine(flat_engine.model, PAD, temperature=temperature)
    ref = trainer.log_probs(prompts, out.responses, micro_batch_size=2)
    for got, want, resp in zip(out.log_probs, ref, out.responses):
        assert got.dtype == torch.float32 and got.shape == resp.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


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

    def us(seed=0):
        return row_uniforms([seed, seed + 100], 1)[:, 0]
    u = us()

    def tokens(params, uniforms=u):
        return sample_next(logits, params, uniforms)[0].tolist()
    assert tokens(SamplingParams(greedy=True)) == [1, 0]
    assert tokens(SamplingParams(temperature=0.0)) == [1, 0]
    assert tokens(SamplingParams(top_k=1)) == [1, 0]
    # a very low temperature is argmax in practice; top_k=2 never picks the smallest logit
    assert tokens(SamplingParams(temperature=1e-3)) == [1, 0]
    picks = torch.tensor([tokens(SamplingParams(top_k=2), us(s)) for s in range(200)])
    assert set(picks[:, 0].tolist()) == {1, 2} and set(picks[:, 1].tolist()) == {0, 2}
    # the seeds' uniforms decide the draw
    draw = [tokens(SamplingParams(temperature=5.0), us(s)) for s in (1, 1, 2, 3, 4)]
    assert draw[0] == draw[1]
    assert len({tuple(d) for d in draw}) > 1
    # the log-prob is that of the filtered, tempered distribution: top_k=2 renormalizes over 2 tokens
    tok, logp = sample_next(logits, SamplingParams(top_k=2, temperature=2.0), us(7))
    scaled = logits / 2.0
    for row in range(2):
        keep = scaled[row].topk(2).values
        want = scaled[row, tok[row]] - torch.logsumexp(keep, 0)
        assert float(logp[row]) == pytest.approx(float(want), abs=1e-6)
