"""Chunked log-probs (`log_probs.head_log_probs` / `torch_train.response_log_probs`): equal to the full
[rows, tokens, vocab] fp32 computation, gradients included, without keeping vocab-sized tensors
for the backward."""
import pytest
import torch

from mindspeed_rl.algorithms import entropy_from_logits, log_probs_from_logits
from mindspeed_rl.engines.train.log_probs import head_log_probs, logits_log_probs
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine, response_log_probs, response_logits

from ._common import PAD, random_rows, tiny_qwen2


def full(hidden, weight, labels, temperature):
    """The reference: the whole [B, R, V] in fp32, then log_softmax / entropy."""
    logits = (hidden @ weight.T).float() / temperature
    return log_probs_from_logits(logits, labels), entropy_from_logits(logits)


def _inputs(seed=0, B=3, R=5, H=8, V=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, R, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, R), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 4, 15, 100])
def test_chunked_head_equals_the_full_computation_with_gradients(chunk):
    hidden, weight, labels = _inputs()
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g,
                                                                                  dtype=torch.float64)
    want_lp, want_ent = full(hidden, weight, labels, 0.7)
    torch.autograd.backward([want_lp, want_ent], [up_lp, up_ent])
    want_gh, want_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp, ent = head_log_probs(hidden, weight, None, labels, 0.7, with_entropy=True, chunk_tokens=chunk)
    torch.autograd.backward([lp, ent], [up_lp, up_ent])
    # the reference casts to fp32 (`.float()`) as the engine's chunks do
    torch.testing.assert_close(lp.double(), want_lp.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), want_ent.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, want_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, want_gw, rtol=1e-5, atol=1e-6)


def test_mask_skips_padding_and_keeps_real_positions():
    hidden, weight, labels = _inputs(seed=2)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    want_lp, want_ent = full(hidden, weight, labels, 1.0)
    (want_lp * mask).sum().backward()
    want_gw = weight.grad.clone()
    weight.grad = None
    lp, ent = head_log_probs(hidden, weight, None, labels, with_entropy=True, mask=mask, chunk_tokens=2)
    keep = mask.bool()
    torch.testing.assert_close(lp[keep].double(), want_lp[keep].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[keep].double(), want_ent[keep].double(), rtol=1e-6, atol=1e-6)
    assert torch.all(lp[~keep] == 0) and torch.all(ent[~keep] == 0)
    lp.sum().backward()
    torch.testing.assert_close(weight.grad, want_gw, rtol=1e-5, atol=1e-6)


def test_an_all_padding_batch_still_has_a_graph():
    """A micro-batch whose mask is all zero gives zeros that still require grad: `loss.backward()`
    of its (zero) loss must not raise."""
    hidden, weight, labels = _inputs(seed=3)
    lp, _ = head_log_probs(hidden, weight, None, labels, mask=torch.zeros(3, 5), chunk_tokens=2)
    assert lp.requires_grad and torch.all(lp == 0)
    lp.sum().backward()
    assert torch.all(weight.grad == 0)


def test_logits_log_probs_chunks_the_fp32_cast():
    hidden, weight, labels = _inputs(seed=4)
    logits = (hidden @ weight.T).to(torch.bfloat16)
    want_lp, want_ent = log_probs_from_logits(logits.float(), labels), entropy_from_logits(logits.float())
    lp, ent = logits_log_probs(logits, labels, with_entropy=True, chunk_tokens=4)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)


def _saved_bytes(fn):
    """Sizes of the tensors autograd keeps for the backward while `fn()` builds its graph."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


def test_the_backward_keeps_no_vocab_sized_tensor():
    """With several chunks the graph holds the inputs of each chunk, not its [n, V] logits,
    log-softmax or softmax: what it keeps does not grow with vocab x tokens."""
    B, R, H, V, chunk = 4, 16, 8, 512, 8
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, R, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, R), generator=g)
    _, full_sizes = _saved_bytes(lambda: full(hidden, weight, labels, 1.0))
    assert max(full_sizes) >= B * R * V              # the reference does keep [B, R, V]
    (lp, ent), sizes = _saved_bytes(lambda: head_log_probs(hidden, weight, None, labels, with_entropy=True,
                                                           chunk_tokens=chunk))
    assert max(sizes) <= max(V * H, B * R * H)       # the weight and the hidden states, no logits
    assert sum(s for s in sizes if s >= chunk * V) <= V * H * (B * R // chunk)   # only the weight, per chunk
    (lp.sum() + ent.sum()).backward()                # the recompute works


@pytest.fixture(scope="module")
def rows():
    return random_rows(4, [3, 1, 5, 2], seed=1), random_rows(4, [4, 2, 6, 1], seed=2)


def test_response_log_probs_of_a_model_equal_full_logits_with_parameter_gradients(rows):
    """The engine's path (backbone hidden states, head by hand on the real response tokens, chunks
    of 3 tokens) against `response_logits` (the head inside the model's forward, full fp32)."""
    prompts, responses = rows
    model = tiny_qwen2(seed=0, initializer_range=0.1)
    engine = TorchTrainEngine(model, PAD)
    b = engine.batch(prompts, responses)
    for p in model.parameters():
        p.requires_grad_(True)
    mask = b.response_mask
    logits = response_logits(model, b, 0.8)
    want_lp, want_ent = log_probs_from_logits(logits, b.responses), entropy_from_logits(logits)
    ((want_lp * mask).sum() + (want_ent * mask).sum() * 0.3).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp, ent = response_log_probs(model, b, 0.8, with_entropy=True, chunk_tokens=3)
    ((lp * mask).sum() + (ent * mask).sum() * 0.3).backward()
    keep = mask.bool()
    torch.testing.assert_close(lp[keep], want_lp[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[keep], want_ent[keep], rtol=1e-5, atol=1e-5)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=2e-5)   # fp32 sums in another order


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts `aten._to_copy` of a tensor of `shape` (the head's weight) into `dtype`."""

    def __init__(self, shape, dtype):
        super().__init__()
        self.shape, self.dtype, self.n = tuple(shape), dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape \
                and kwargs.get("dtype") == self.dtype:
            self.n += 1
        return func(*args, **kwargs)


def test_under_autocast_the_heads_weight_is_cast_once_per_micro_batch_with_the_same_gradients():
    """bf16 autocast on the CPU, fp32 masters, 6 checkpointed chunks: the head's weight is cast once for the forward
    and every recompute, where autocast casts it again in each chunk's recompute. Log-probs, entropies and the
    hidden states' gradients equal autocast's per-chunk path bit for bit; the masters' gradients too with one
    chunk, and with several they add up in fp32 (autocast's cached cast sums the chunks in bf16): no further
    from the fp32 computation's than autocast's."""
    from torch.nn import functional as F
    from mindspeed_rl.engines.train.log_probs import _chunked, _head_chunk
    B, R, H, V, chunk = 4, 6, 32, 128, 4
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, R, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, R), generator=g)
    mask = torch.ones(B, R)

    def run(fn, autocast=True):
        hidden.grad = weight.grad = bias.grad = None
        with _Casts(weight.shape, torch.bfloat16) as casts:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):   # the engine's forward
                lp, ent = fn()
            (lp.sum() + 0.3 * ent.sum()).backward()                           # and its backward, outside autocast
        return casts.n, lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()

    def per_chunk(n):
        return run(lambda: _chunked(_head_chunk, hidden, labels, (weight, bias, 1.0, True), n, mask, True))

    def once(n, autocast=True):
        return run(lambda: head_log_probs(hidden, weight, bias, labels, with_entropy=True, mask=mask, chunk_tokens=n),
                   autocast)

    old, new = per_chunk(chunk), once(chunk)
    assert old[0] == 1 + B * R // chunk, old[0]   # autocast caches a leaf's cast in the forward, not in recomputes
    assert new[0] == 1
    assert weight.grad.dtype == bias.grad.dtype == torch.float32
    for a, b in zip(new[1:4], old[1:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(once(B * R)[1:], per_chunk(B * R)[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fp32 = once(B * R, autocast=False)
    assert fp32[0] == 0
    for i in (4, 5):
        assert (new[i] - fp32[i]).norm() <= (old[i] - fp32[i]).norm()
        torch.testing.assert_close(new[i], old[i], rtol=0, atol=0.05)
    want = torch.log_softmax(F.linear(hidden, weight, bias), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(fp32[1], want.detach(), rtol=1e-6, atol=1e-6)


def test_the_heads_chunk_is_sized_by_the_device():
    from mindspeed_rl.engines.train.log_probs import LOGITS_CHUNK_BYTES, chunk_tokens_for, logits_chunk_bytes
    from mindspeed_rl.engines.train.torch_train import adamw_kernel
    assert logits_chunk_bytes("cpu") == LOGITS_CHUNK_BYTES == 128 << 20
    assert logits_chunk_bytes("cuda:0") == 1 << 30
    assert chunk_tokens_for(151936, logits_chunk_bytes("cpu")) == 220
    assert chunk_tokens_for(151936, logits_chunk_bytes("cuda")) == 1766
    assert adamw_kernel("cuda:0") == {"fused": True} and adamw_kernel("cpu") == {"foreach": True}
