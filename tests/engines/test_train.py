"""TorchTrainEngine: log-probs against a direct forward, gradient accumulation, the optimizer step
and checkpoint state."""
import copy
import io

import pytest
import torch

from mindspeed_rl.engines import OptimConfig
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, flat_grads, flat_params, random_rows, tiny_qwen2, token_mean_nll

PROMPT_LENS = [3, 1, 6, 2, 4]
RESP_LENS = [5, 2, 1, 7, 3]


@pytest.fixture(scope="module")
def rows():
    return random_rows(5, PROMPT_LENS, seed=1), random_rows(5, RESP_LENS, seed=2)


@torch.no_grad()
def direct_log_probs(model, prompt, response, temperature=1.0):
    """log_softmax of one unpadded full forward over prompt + response, gathered at the response."""
    seq = torch.cat([prompt, response])[None]
    logits = model(input_ids=seq, use_cache=False).logits[0].float() / temperature
    p = prompt.numel()
    pred = torch.log_softmax(logits[p - 1:p - 1 + response.numel()], dim=-1)
    return pred.gather(-1, response[:, None]).squeeze(-1), logits[p - 1:p - 1 + response.numel()]


@pytest.mark.parametrize("micro_batch_size", [1, 2, 5])
def test_log_probs_equal_a_direct_forward(rows, micro_batch_size):
    prompts, responses = rows
    engine = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.1), PAD)  # inference engine
    got = engine.log_probs(prompts, responses, micro_batch_size)
    assert [g.shape[0] for g in got] == RESP_LENS
    for p, r, g in zip(prompts, responses, got):
        want, _ = direct_log_probs(engine.module, p, r)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in engine.module.parameters())


def test_temperature_divides_logits_and_entropy(rows):
    prompts, responses = rows
    t = 0.7
    engine = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.1), PAD, temperature=t)
    got = engine.log_probs(prompts, responses, micro_batch_size=5)
    b = engine.batch(prompts, responses)
    with torch.no_grad():
        logp, ent = engine.forward(b, with_entropy=True)
    for i, (p, r, g) in enumerate(zip(prompts, responses, got)):
        want, logits = direct_log_probs(engine.module, p, r, temperature=t)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logp[i, :r.numel()], want, rtol=1e-5, atol=1e-5)
        prob = torch.softmax(logits, -1)
        torch.testing.assert_close(ent[i, :r.numel()], -(prob * prob.log()).sum(-1), rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_equals_one_batch():
    """Two half-batches with loss / 2 each give the gradient of the whole batch's token mean
    (equal token counts per half), whatever the padding of each micro-batch."""
    prompts = random_rows(4, [2, 6, 3, 1], seed=5)
    responses = random_rows(4, [4, 2, 1, 5], seed=6)  # halves hold 6 tokens each
    whole = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig())
    token_mean_nll(whole, prompts, responses).backward()
    acc = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig())
    for s in (0, 2):
        with acc.no_sync(sync=s == 2):  # a no-op without DDP
            (token_mean_nll(acc, prompts[s:s + 2], responses[s:s + 2]) / 2).backward()
    torch.testing.assert_close(flat_grads(acc.module), flat_grads(whole.module), rtol=1e-4, atol=1e-7)


def test_optimizer_step_clips_reports_pre_clip_norm_and_bumps_version(rows):
    prompts, responses = rows
    clip = 1e-3
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2, grad_clip=clip))
    assert engine.version == 0 and engine.module.training
    before = flat_params(engine.module)
    token_mean_nll(engine, prompts, responses).backward()
    grads = flat_grads(engine.module)
    norm = float(grads.norm())
    assert norm > 10 * clip  # clipping does happen
    stats = engine.optimizer_step()
    assert engine.version == 1
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)  # reported before clipping
    assert all(p.grad is None for p in engine.module.parameters())  # zeroed
    # Adam's first moment after one step is (1 - beta1) * the gradient it was given: the clipped one
    b1 = engine.optimizer.defaults["betas"][0]
    m = torch.cat([engine.optimizer.state[p]["exp_avg"].reshape(-1) for p in engine.module.parameters()])
    torch.testing.assert_close(m / (1 - b1), grads * (clip / norm), rtol=1e-4, atol=1e-9)
    assert not torch.equal(flat_params(engine.module), before)


def test_non_finite_gradient_skips_the_update_but_counts_the_step(rows):
    prompts, responses = rows
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig())
    before = flat_params(engine.module)
    token_mean_nll(engine, prompts, responses).backward()
    next(engine.module.parameters()).grad.view(-1)[0] = float("nan")
    stats = engine.optimizer_step()
    assert not torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert torch.equal(flat_params(engine.module), before)
    assert engine.version == 1
    assert all(p.grad is None for p in engine.module.parameters())


def _train_step(engine, prompts, responses):
    token_mean_nll(engine, prompts, responses).backward()
    return engine.optimizer_step()


def _round_trip_then_train_both(rows, transfer):
    prompts, responses = rows
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    a = TorchTrainEngine(tiny_qwen2(seed=0), PAD, optim)
    for _ in range(2):
        _train_step(a, prompts, responses)
    b = TorchTrainEngine(tiny_qwen2(seed=9), PAD, optim)  # another init, fresh optimizer
    b.load_state_dict(transfer(a.state_dict()))
    assert b.version == a.version == 2
    assert torch.equal(flat_params(b.module), flat_params(a.module))
    for _ in range(2):  # both continue identically: moments and step counts were restored too
        sa, sb = _train_step(a, prompts, responses), _train_step(b, prompts, responses)
        assert sa == sb
        assert torch.equal(flat_params(b.module), flat_params(a.module))
    assert a.version == b.version == 4


def _through_torch_save(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("transfer", [_through_torch_save, copy.deepcopy], ids=["torch_save", "deepcopy"])
def test_state_dict_round_trip_restores_exactly(rows, transfer):
    _round_trip_then_train_both(rows, transfer)


def test_state_dict_round_trip_in_memory_without_copy(rows):
    _round_trip_then_train_both(rows, lambda state: state)


def test_inference_engine_has_no_optimizer(rows):
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD)
    assert engine.optimizer is None and not engine.module.training
    assert engine.state_dict()["optimizer"] is None
    assert len(engine.parameters()) == len(list(engine.module.parameters()))


# ------------------------------------------------------------------ the TrainEngine interface

from ._common import nll_loss_fn as nll_loss  # noqa: E402  (a loss function as workers pass them)


def test_train_step_accumulates_micro_batches_like_one_batch_then_steps():
    from mindspeed_rl.engines import MicroBatch
    prompts = random_rows(4, [2, 6, 3, 1], seed=5)
    responses = random_rows(4, [4, 2, 1, 5], seed=6)  # halves hold 6 tokens each
    whole = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2))
    m1 = whole.train_step([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, last=True)], nll_loss)
    acc = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2))
    m2 = acc.train_step((MicroBatch({"prompts": prompts[s:s + 2], "responses": responses[s:s + 2]}, 0.5,
                                    last=s == 2) for s in (0, 2)), nll_loss)
    # Adam's first step moves each weight by ~lr * sign(grad): near-zero gradients' float noise shows
    # at 1e-4; the gradient's scale (which Adam hides) is checked by grad_norm below
    torch.testing.assert_close(flat_params(acc.module), flat_params(whole.module), rtol=1e-3, atol=2e-4)
    assert whole.version == acc.version == 1
    assert m1["micro_batches"] == 1 and m2["micro_batches"] == 2
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    assert m2["nll"] / 2 == pytest.approx(m1["nll"], rel=1e-4)  # equal-token halves: mean of halves = whole


def test_train_step_consumes_the_iterable_before_stepping():
    """A worker may wait (for readers of the old weights) after its last micro-batch: the weights
    must not have changed while it waits."""
    from mindspeed_rl.engines import MicroBatch
    prompts, responses = random_rows(2, 3, seed=1), random_rows(2, 2, seed=2)
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2))
    before = flat_params(engine.module)
    seen = []

    def micro_batches():
        yield MicroBatch({"prompts": prompts, "responses": responses}, 1.0, last=True)
        seen.append(torch.equal(flat_params(engine.module), before))  # after the last backward
    engine.train_step(micro_batches(), nll_loss)
    assert seen == [True] and not torch.equal(flat_params(engine.module), before)
    with pytest.raises(RuntimeError, match="inference-only"):
        TorchTrainEngine(tiny_qwen2(seed=0), PAD).train_step([], nll_loss)


def test_export_buckets_and_update_weights_round_trip():
    a = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig())
    b = TorchTrainEngine(tiny_qwen2(seed=1), PAD)
    limit = 20_000
    buckets = list(a.export_weights(limit))
    assert len(buckets) > 2
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    names = [n for bucket in buckets for n, _ in bucket]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # tied, under both names
    for bucket in buckets:
        b.update_weights(bucket, version=3)
    assert torch.equal(flat_params(b.module), flat_params(a.module)) and b.version == 3


def test_checkpoint_round_trip_through_files(tmp_path, rows):
    prompts, responses = rows
    a = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2))
    _train_step(a, prompts, responses)
    assert a.save_checkpoint(str(tmp_path / "actor")) == [str(tmp_path / "actor" / "engine.pt")]
    b = TorchTrainEngine(tiny_qwen2(seed=9), PAD, OptimConfig(lr=1e-2))
    b.load_checkpoint(str(tmp_path / "actor"))
    assert b.version == 1
    _train_step(a, prompts, responses), _train_step(b, prompts, responses)
    assert torch.equal(flat_params(b.module), flat_params(a.module))


# ------------------------------------------------------------------ token budget (no compute on padding)

BUDGET_PROMPTS = random_rows(6, [2, 7, 3, 1, 6, 2], seed=21)
BUDGET_RESPONSES = random_rows(6, [9, 1, 2, 8, 3, 1], seed=22)


def test_token_budget_log_probs_equal_the_padded_path_in_row_order():
    padded = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.1), PAD)
    budget = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.1), PAD, max_tokens_per_micro_batch=24)
    groups = budget.groups(BUDGET_PROMPTS, BUDGET_RESPONSES, 6)
    assert len(groups) > 2 and sorted(i for g in groups for i in g) == list(range(6))
    want = padded.log_probs(BUDGET_PROMPTS, BUDGET_RESPONSES, micro_batch_size=6)
    got = budget.log_probs(BUDGET_PROMPTS, BUDGET_RESPONSES, micro_batch_size=6)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_token_budget_values_equal_the_padded_path(tmp_path):
    from mindspeed_rl.engines import TrainSpec
    tiny_qwen2(seed=0).save_pretrained(tmp_path)
    specs = [TrainSpec(model_path=str(tmp_path), model_kind="value", pad_token_id=PAD, seed=3,
                       max_tokens_per_micro_batch=budget) for budget in (None, 24)]
    padded, budget = (TorchTrainEngine.build(s) for s in specs)
    for g, w in zip(budget.values(BUDGET_PROMPTS, BUDGET_RESPONSES, 6),
                    padded.values(BUDGET_PROMPTS, BUDGET_RESPONSES, 6)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def seq_mean_nll(out, mb):
    """A loss that is not a token mean: the mean over rows of each row's mean NLL."""
    from mindspeed_rl.algorithms import masked_mean
    per_row = masked_mean(-out.log_probs, out.response_mask, dim=-1)
    return per_row.mean(), {"nll": float(per_row.mean().detach())}


@pytest.mark.parametrize("loss_fn", [nll_loss, seq_mean_nll], ids=["token_mean", "seq_mean"])
def test_token_budget_train_step_gives_the_padded_gradient(loss_fn):
    """The micro-batch runs as several less-padded forwards, the loss sees the whole micro-batch:
    the same gradient, metrics and update as one padded forward, whatever the loss aggregates."""
    from mindspeed_rl.engines import MicroBatch
    grads = {}
    engines = {}
    for name, budget in (("padded", None), ("budget", 24)):
        e = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2, eps=1e-4), max_tokens_per_micro_batch=budget)
        e.optimizer.register_step_pre_hook(lambda opt, a, k, name=name, e=e: grads.update({name: flat_grads(e.module)}))
        mbs = [MicroBatch({"prompts": BUDGET_PROMPTS[s:s + 3], "responses": BUDGET_RESPONSES[s:s + 3]}, 0.5,
                          last=s == 3) for s in (0, 3)]
        engines[name] = (e, e.train_step(mbs, loss_fn))
    assert len(engines["budget"][0].groups(BUDGET_PROMPTS[:3], BUDGET_RESPONSES[:3], 3)) > 1   # it did split
    torch.testing.assert_close(grads["budget"], grads["padded"], rtol=1e-4, atol=1e-6)
    (a, ma), (b, mb) = engines["budget"], engines["padded"]
    assert ma["nll"] == pytest.approx(mb["nll"], rel=1e-5)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    torch.testing.assert_close(flat_params(a.module), flat_params(b.module), rtol=0, atol=1e-5)


def test_backend_options_or_a_bad_budget_are_refused(tmp_path):
    from mindspeed_rl.engines import TrainSpec
    with pytest.raises(ValueError, match="takes none"):
        TorchTrainEngine.build(TrainSpec(model_path=str(tmp_path), options={"max_tokens_per_micro_batch": 5}))
    for bad in (-3, 2.5, True):
        with pytest.raises(ValueError, match=">= 1"):
            TorchTrainEngine(tiny_qwen2(seed=0), PAD, max_tokens_per_micro_batch=bad)


def ddp_budget_rank(rank: int, world: int, port: int, rows: tuple, budget: int) -> dict:
    """One DDP `train_step` (a worker process): each micro-batch runs as several token-budget
    forwards before its one backward, which DDP's reducer must take as one iteration; then the same
    step again with activation checkpointing (DDP's hooks must fire once per parameter through the
    recompute)."""
    from mindspeed_rl.engines import MicroBatch
    from mindspeed_rl.engines.sync.weight_sync import stateless_group

    from ._common import nll_loss_fn
    from ._mp_workers import HOST, as_process_group
    prompts, responses = rows
    group = stateless_group(HOST, port, rank, world, timeout_s=60)
    out = {}
    for checkpointing in (False, True):
        engine = TorchTrainEngine(tiny_qwen2(seed=rank), PAD, OptimConfig(lr=1e-2, eps=1e-4),
                                  process_group=as_process_group(group), max_tokens_per_micro_batch=budget,
                                  gradient_checkpointing=checkpointing)
        out["split"] = len(engine.groups(prompts[:2], responses[:2], 2))
        engine.train_step((MicroBatch({"prompts": prompts[s:s + 2], "responses": responses[s:s + 2]}, 0.5,
                                      last=s == 2) for s in (0, 2)), nll_loss_fn)
        out["checkpointed" if checkpointing else "params"] = flat_params(engine.module)
    return out


@pytest.mark.slow
def test_token_budget_under_ddp_equals_one_process_on_the_union(tmp_path):
    from mindspeed_rl.engines import MicroBatch
    from mindspeed_rl.engines.sync.weight_sync import free_port

    from . import _mp_workers as W
    prompts = random_rows(8, [3, 5, 2, 4, 6, 3, 4, 2], seed=11)
    responses = random_rows(8, [7, 1, 2, 6, 3, 5, 5, 3], seed=12)   # every micro-batch holds 8 tokens
    port = free_port()
    results = W.run_procs([(ddp_budget_rank, (r, 2, port, (prompts[4 * r:4 * r + 4], responses[4 * r:4 * r + 4]), 14))
                           for r in range(2)], tmp_path)
    assert all(r["split"] == 2 for r in results)
    ref = TorchTrainEngine(tiny_qwen2(seed=0), PAD, OptimConfig(lr=1e-2, eps=1e-4))
    ref.train_step([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, last=True)], nll_loss)
    assert torch.equal(results[0]["params"], results[1]["params"])
    torch.testing.assert_close(results[0]["params"], flat_params(ref.module), rtol=0, atol=1e-6)
    for r in results:
        torch.testing.assert_close(r["checkpointed"], r["params"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_train_step_combines_metrics_by_their_names(backend):
    """Over micro-batches an engine sums a metric, but takes the max of a `_max` and the min of a `_min`
    (algorithms/metrics.py): `is_weight_max` of two micro-batches is the larger one, not their sum."""
    from mindspeed_rl.engines import MicroBatch
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    from mindspeed_rl.engines.base import TrainSpec
    seen = iter([{"is_weight_max": 1.5, "weight_version_min": 3.0, "n": 1.0},
                 {"is_weight_max": 1.25, "weight_version_min": 2.0, "n": 1.0}])

    def loss_fn(out, mb):
        loss, _ = nll_loss(out, mb)
        return loss, next(seen)
    model, optim = tiny_qwen2(seed=0), OptimConfig(lr=1e-2)
    engine = (TorchTrainEngine(model, PAD, optim) if backend == "torch" else
              FSDPTrainEngine(model, TrainSpec(model_path="", pad_token_id=PAD, optim=optim)))
    prompts, responses = random_rows(4, 3, seed=1), random_rows(4, 2, seed=2)
    m = engine.train_step((MicroBatch({"prompts": prompts[s:s + 2], "responses": responses[s:s + 2]}, 0.5,
                                      last=s == 2) for s in (0, 2)), loss_fn)
    assert (m["is_weight_max"], m["weight_version_min"], m["n"], m["micro_batches"]) == (1.5, 2.0, 2.0, 2.0)
