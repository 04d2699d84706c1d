"""The counter-based sampler (mindspeed_rl/engines/rollout/sampling.py) and the device-side response
bookkeeping with batch compaction (hf_rollout.ResponseBuilder): a row's draws depend on its seed and
logits alone, the returned log-prob is the filtered distribution's, filtered-out tokens are never
drawn, the draws follow the distribution, and dropping finished rows changes no token."""
import pytest
import torch

from mindspeed_rl.engines import SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine, ResponseBuilder
from mindspeed_rl.engines.rollout.sampling import (filter_logits, inverse_cdf_draw, row_uniforms, sample_next,
                                           splitmix64)

from ._common import PAD, random_rows, tiny_qwen2

U64 = 2**64


def splitmix64_reference(seed: int, n: int) -> list[int]:
    """SplitMix64 in Python integers, straight from its definition."""
    out, s = [], seed
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) % U64
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) % U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % U64
        out.append(z ^ (z >> 31))
    return out


def logits_batch(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


PARAMS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=50),
          SamplingParams(top_p=0.8, temperature=1.3), SamplingParams(top_k=200, top_p=0.9)]


# ------------------------------------------------------------------------------- the uniforms

def test_splitmix64_matches_its_definition():
    assert splitmix64_reference(0, 1)[0] == 0xE220A8397B1DCDAF  # the published first output for seed 0
    for seed in (0, 1, 12345, 2**62 + 7, 2**63 - 1):
        want = splitmix64_reference(seed, 20)
        states = [(seed + (t + 1) * 0x9E3779B97F4A7C15) % U64 for t in range(20)]
        got = splitmix64(torch.tensor([s - U64 if s >= 2**63 else s for s in states]))  # uint64 bits as int64
        assert [v % U64 for v in got.tolist()] == want


def test_row_uniforms_are_a_function_of_seed_and_token_index():
    seeds = [7, 2**63 + 7, 123456789012345, 8]
    u = row_uniforms(seeds, 12)
    assert u.shape == (4, 12) and u.dtype == torch.float32
    assert bool((u >= 0).all()) and bool((u < 1).all())
    assert torch.equal(u[0], u[1])  # seeds are taken mod 2**63, as the generators were seeded
    assert not torch.equal(u[0], u[3])
    want = [[(z >> 40) / 2**24 for z in splitmix64_reference(s % 2**63, 12)] for s in seeds]
    assert u.double().tolist() == want
    # a row's uniforms do not depend on the other rows, their order or the response length
    assert torch.equal(row_uniforms(seeds[::-1], 12), u.flip(0))
    assert torch.equal(row_uniforms([seeds[2]], 5), u[2:3, :5])


# ------------------------------------------------------------------------------- the draw

@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_a_rows_draw_depends_only_on_its_logits_and_seed(params):
    logits, u = logits_batch(9, 3000, seed=1), row_uniforms(range(100, 109), 4)[:, 2]
    tok, logp = sample_next(logits, params, u)
    order = torch.tensor([4, 0, 8, 2])
    sub_tok, sub_logp = sample_next(logits[order], params, u[order])  # fewer rows, another order
    assert torch.equal(sub_tok, tok[order]) and torch.equal(sub_logp, logp[order])
    for i in range(9):  # each row alone
        one_tok, one_logp = sample_next(logits[i:i + 1], params, u[i:i + 1])
        assert int(one_tok) == int(tok[i]) and float(one_logp) == float(logp[i])
    # other rows' logits do not matter either
    noisy = logits.clone()
    noisy[1:] += 5 * torch.randn(8, 3000, generator=torch.Generator().manual_seed(3))
    assert int(sample_next(noisy, params, u)[0][0]) == int(tok[0])


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_log_prob_is_log_softmax_of_the_filtered_logits_and_filtered_tokens_are_never_drawn(params):
    logits = logits_batch(64, 5000, seed=2)
    allowed = filter_logits(logits / params.temperature, params.top_p, params.top_k)
    want_logp = torch.log_softmax(allowed.double(), -1)  # float64: float32's log_softmax is off by ~1e-5
    u = row_uniforms(range(64), 20)
    for t in range(20):
        tok, logp = sample_next(logits, params, u[:, t])
        assert bool((allowed.gather(-1, tok[:, None]) > float("-inf")).all())
        want = want_logp.gather(-1, tok[:, None]).squeeze(-1).float()
        torch.testing.assert_close(logp, want, rtol=0, atol=2e-6)


def test_extreme_uniforms_and_overshoot_stay_on_allowed_tokens():
    """u = 0 takes the first allowed token, the largest u the last; u = 1 (a target at the very end
    of the CDF, which rounding could produce) falls on a filtered token and is redirected to the
    most likely token instead."""
    ninf = float("-inf")
    x = torch.tensor([[ninf, 1.0, ninf, 3.0, 2.0, ninf]] * 3)
    tok, logp = inverse_cdf_draw(x, torch.tensor([0.0, 1 - 2.0**-24, 1.0]))
    assert tok.tolist() == [1, 4, 3]
    torch.testing.assert_close(logp, torch.log_softmax(x, -1)[torch.arange(3), tok], rtol=0, atol=1e-6)


def test_greedy_is_argmax_with_the_untempered_log_prob():
    logits = logits_batch(6, 100, seed=4)
    for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.0)):
        tok, logp = sample_next(logits, params, torch.zeros(6))
        assert torch.equal(tok, logits.argmax(-1))
        torch.testing.assert_close(logp, torch.log_softmax(logits, -1).max(-1).values, rtol=0, atol=1e-6)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_distribution():
    """20,000 rows (seeds 0..19999) draw from one 8-token distribution, at two token indices, with
    and without a top-k filter: Pearson's chi-square stays under 40 (7 degrees of freedom: a correct
    sampler exceeds 24 with probability 0.001; a wrong one, e.g. every draw shifted by one token or
    the filter ignored, lands in the thousands), and the pair of draws at t and t+1 is independent."""
    n = 20_000
    x = torch.tensor([2.0, 0.5, 1.0, -1.0, 0.0, 1.5, -0.5, 0.3])
    probs = torch.softmax(x, -1)
    u = row_uniforms(range(n), 2)
    logits = x.expand(n, -1)
    draws = [sample_next(logits, SamplingParams(), u[:, t])[0] for t in range(2)]
    for d in draws:
        assert chi_square(torch.bincount(d, minlength=8).double(), probs.double()) < 40
    top4 = sample_next(logits, SamplingParams(top_k=4), u[:, 0])[0]
    assert set(top4.tolist()) == {0, 1, 2, 5}
    kept = torch.tensor([0, 1, 2, 5])
    counts = torch.bincount(top4, minlength=8)[kept].double()
    assert chi_square(counts, torch.softmax(x[kept], -1).double()) < 30  # 3 degrees of freedom
    joint = torch.bincount(draws[0] * 8 + draws[1], minlength=64).double()
    cells = (probs[:, None] * probs[None, :]).reshape(-1).double()
    common = cells * n >= 20  # cells with enough mass for the approximation
    assert chi_square(joint[common], cells[common] / cells[common].sum()) < 120  # ~40 dof


# ------------------------------------------------------------------------------- ResponseBuilder

def test_response_builder_drops_ended_rows_and_keeps_the_original_order():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(2,))
    b = ResponseBuilder(3, params, PAD, torch.device("cpu"), check_every=1)
    fed = b.add(torch.tensor([5, 2, 7]), torch.tensor([-0.1, -0.2, -0.3]))
    assert fed.tolist() == [5, 2, 7]
    assert b.compaction().tolist() == [0, 2] and b.rows.tolist() == [0, 2]  # row 1 ended
    b.add(torch.tensor([2, 9]), torch.tensor([-0.4, -0.5]))
    assert b.compaction().tolist() == [1] and b.rows.tolist() == [2]        # then row 0
    b.add(torch.tensor([4]), torch.tensor([-0.6]))
    assert b.complete and b.compaction() is None
    out = b.rollout()
    assert [r.tolist() for r in out.responses] == [[5, 2], [2], [7, 9, 4]]
    assert [len(r) for r in out.log_probs] == [2, 1, 3]
    assert torch.cat(out.log_probs).tolist() == pytest.approx([-0.1, -0.4, -0.2, -0.3, -0.5, -0.6])


def test_response_builder_checks_every_n_tokens_and_pads_ended_rows_between():
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(2, 3))
    b = ResponseBuilder(2, params, PAD, torch.device("cpu"), check_every=2)
    b.add(torch.tensor([2, 5]), torch.zeros(2))
    assert b.compaction() is None  # t=1: no check
    assert b.add(torch.tensor([9, 3]), torch.zeros(2)).tolist() == [PAD, 3]  # row 0 ended: padding
    assert b.compaction().numel() == 0 and b.complete  # t=2: both ended: no row runs
    assert b.rows.numel() == 0
    assert [r.tolist() for r in b.rollout().responses] == [[2], [5, 3]]


# ------------------------------------------------------------------------------- the engine

def test_dropping_finished_rows_changes_no_token(monkeypatch):
    """The HF engine with a check every token, every 3 tokens and never: same tokens, same
    log-probs; and rows were dropped (the KV cache shrank) in the first two."""
    from transformers import DynamicCache
    engine = HFRolloutEngine(tiny_qwen2(seed=3, initializer_range=0.2), PAD)
    prompts = random_rows(12, [1 + i % 5 for i in range(12)], seed=1)
    params = SamplingParams(max_new_tokens=14, temperature=1.0, stop_token_ids=(2, 5))
    seeds = list(range(500, 512))
    selects = []
    original = DynamicCache.batch_select_indices

    def spy(cache, indices):
        selects.append(int(indices.numel()))
        return original(cache, indices)
    monkeypatch.setattr(DynamicCache, "batch_select_indices", spy)

    def run(check_every):
        monkeypatch.setattr("mindspeed_rl.engines.rollout.hf_rollout.default_check_every", lambda device: check_every)
        selects.clear()
        return engine.generate(prompts, params, seeds), list(selects)
    never, none_dropped = run(10**6)
    lengths = [len(r) for r in never.responses]
    assert not none_dropped and min(lengths) < 10 and max(lengths) == 14  # rows end at different steps
    for every in (1, 3):
        got, dropped = run(every)
        assert dropped and dropped == sorted(dropped, reverse=True) and dropped[-1] < 12
        assert [r.tolist() for r in got.responses] == [r.tolist() for r in never.responses]
        for a, b in zip(got.log_probs, never.log_probs):  # fp32 GEMMs of another batch size round otherwise:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # 1.2e-6 seen on a CPU with AMX
