"""FSDP2 train engine: two gloo ranks on the CPU against a single process (real fully_shard, DTensor
parameters, DCP; no mocks). Every multi-process run is bounded by `run_procs`' timeout."""
import pytest
import torch

from mindspeed_rl.algorithms import log_probs_from_logits, masked_mean
from mindspeed_rl.engines.base import OptimConfig
from mindspeed_rl.engines.batching import collate, unpad_rows
from mindspeed_rl.engines.train.torch_train import response_logits, response_values
from mindspeed_rl.engines.sync.weight_sync import free_port
from mindspeed_rl.models import load_causal_lm, load_value_model, resolve_model_path

from . import _fsdp_ranks as F
from . import _mp_workers as W
from ._common import PAD, random_rows, tiny_qwen2

WORLD, PER_RANK = 2, 4
TIMEOUT_S = 90
# eps large next to tiny gradients keeps Adam's first step a smooth function of the gradient
OPTIM = OptimConfig(lr=1e-2, eps=1e-4, grad_clip=1.0)


@pytest.fixture(scope="module")
def path() -> str:
    return str(resolve_model_path("builtin:tiny-qwen2"))


def rows(n: int, seed: int):
    # equal response lengths: the mean of the ranks' token-means is the token-mean of the union
    return random_rows(n, [3, 5, 2, 4, 6, 3, 4, 2][:n], seed=seed), random_rows(n, 5, seed=seed + 1)


def shard(data, r: int, per: int = PER_RANK):
    return tuple(col[r * per:(r + 1) * per] for col in data)


def reference_step(path: str, prompts, responses, optim: OptimConfig):
    """One plain single-process AdamW step on the whole batch: (weights by HF name, loss, grad_norm)."""
    model = load_causal_lm(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    b = collate(prompts, responses, PAD)
    logp = log_probs_from_logits(response_logits(model, b, 1.0), b.responses)
    loss = masked_mean(-logp, b.response_mask)
    loss.backward()
    loss = loss.item()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip))
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}, loss, norm


@pytest.fixture(scope="module")
def trained(path, tmp_path_factory):
    """Each rank its half of the batch: run 0 one micro-batch of 4 rows, run 1 two micro-batches of
    2 rows with loss_scale 0.5; the ranks form a `new_group` (DeviceMesh.from_group)."""
    data = rows(WORLD * PER_RANK, seed=11)
    port = free_port()
    jobs = [(F.train, (r, WORLD, port, path, shard(data, r), [(4, 1.0), (2, 0.5)], OPTIM, True))
            for r in range(WORLD)]
    results = W.run_procs(jobs, tmp_path_factory.mktemp("fsdp_train"), TIMEOUT_S)
    return data, results


def assert_weights_close(got: dict, want: dict, atol: float):
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=atol, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_two_ranks_match_single_process_on_the_union_batch(path, trained):
    data, (r0, r1) = trained
    ref, ref_loss, _ = reference_step(path, *data, OPTIM)
    start = dict(load_causal_lm(path).named_parameters(remove_duplicate=False))
    a, b = r0[0], r1[0]
    # parameters really are sharded: rank 0 holds half the rows of each weight's dim 0
    full = {n: tuple(p.shape) for n, p in start.items()}
    assert a["shards"]["model.embed_tokens.weight"][0] * WORLD == full["model.embed_tokens.weight"][0]
    assert a["version"] == b["version"] == 1
    for n in ref:
        assert torch.equal(a["weights"][n], b["weights"][n])  # one model, gathered alike on both ranks
    assert not torch.allclose(ref["model.norm.weight"], start["model.norm.weight"])  # the step moved it
    assert_weights_close(a["weights"], ref, atol=1e-5)
    assert a["stats"]["micro_batches"] == 1
    # the loss metric is per rank (summed over its micro-batches); the ranks' mean is the union's
    assert abs((a["stats"]["loss"] + b["stats"]["loss"]) / 2 - ref_loss) <= 1e-5


@pytest.mark.slow
def test_gradient_accumulation_two_halves_equal_one_micro_batch(trained):
    _, results = trained
    for runs in results:
        one, two = runs
        assert two["stats"]["micro_batches"] == 2
        # each micro-batch's gradients are reduce-scattered, one per FSDP unit (2 decoder layers + root): a
        # rank accumulates its shard, never the whole model's gradients
        assert one["reduce_scatters"] == 3 and two["reduce_scatters"] == 6
        assert_weights_close(two["weights"], one["weights"], atol=1e-5)
        assert abs(two["stats"]["grad_norm"] - one["stats"]["grad_norm"]) <= 1e-5 * one["stats"]["grad_norm"]
        # summed metrics: the two halves' means add up to twice the whole's mean (equal lengths)
        assert abs(two["stats"]["loss"] - 2 * one["stats"]["loss"]) <= 1e-5


@pytest.mark.slow
def test_grad_norm_is_global_across_shards(path, trained):
    data, (r0, r1) = trained
    _, _, ref_norm = reference_step(path, *data, OPTIM)
    assert ref_norm > OPTIM.grad_clip  # clipping was active
    assert r0[0]["stats"]["grad_norm"] == r1[0]["stats"]["grad_norm"]
    assert abs(r0[0]["stats"]["grad_norm"] - ref_norm) <= 1e-5 * ref_norm


@pytest.mark.slow
@pytest.mark.parametrize("world", [WORLD, 3])   # 3 ranks: uneven shards (16 rows: 6, 6, 4)
def test_export_weights_gathers_bucket_by_bucket(path, tmp_path, world):
    bucket_bytes = 40_000
    port = free_port()
    results = W.run_procs([(F.export, (r, world, port, path, bucket_bytes, ("float32", "bfloat16")))
                           for r in range(world)], tmp_path, TIMEOUT_S)
    ref = load_causal_lm(path)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    largest = max(t.numel() * t.element_size() for t in want.values())
    for res in results:
        for dtype, buckets in res["buckets"].items():
            dtype = getattr(torch, dtype)
            names = [n for b in buckets for n, *_ in b]
            assert names == list(want)  # every HF name, in order, tied lm_head.weight included
            assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
            assert len(buckets) > 1
            for b in buckets:
                size = sum(nbytes for *_, nbytes in b)
                assert size <= bucket_bytes or len(b) == 1   # bytes of the export dtype
                for n, t, got_dtype, _ in b:
                    assert got_dtype == dtype and torch.equal(t, want[n].to(dtype)), n
        assert len(res["buckets"]["bfloat16"]) < len(res["buckets"]["float32"])   # planned in bf16 bytes
        # gathered tensors alive at once: at most a bucket plus the parameter that overflowed it
        assert 0 < res["peak_gathered"] <= bucket_bytes + largest
        assert res["alive_after"] == 0
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert results[0]["peak_gathered"] < total / 2  # never the whole model


@pytest.mark.slow
def test_checkpoint_round_trip_resumes_exactly(path, tmp_path):
    data = rows(6, seed=21)
    port = free_port()
    ckpt = str(tmp_path / "ckpt")
    r0, r1 = W.run_procs([(F.checkpoint, (r, WORLD, port, path, shard(data, r, 3), OPTIM, ckpt))
                          for r in range(WORLD)], tmp_path, TIMEOUT_S)
    for res in (r0, r1):
        assert res["versions"] == (3, 3) and res["version_loaded"] == 2
        for n in res["saved"]:
            assert torch.equal(res["loaded"][n], res["saved"][n]), n
            assert torch.equal(res["b"][n], res["a"][n]), n  # bit for bit, optimizer state included
        assert res["stats_a"] == res["stats_b"]
        assert not torch.equal(res["a"]["model.norm.weight"], res["saved"]["model.norm.weight"])
    assert any(f.endswith(".metadata") for f in r0["files"])
    assert r0["files"] and r1["files"] and not set(r0["files"]) & set(r1["files"])  # each rank its shards


@pytest.mark.slow
def test_update_weights_then_export_and_infer(path, tmp_path):
    new = tiny_qwen2(seed=5)
    new_weights = {n: p.detach().clone() for n, p in new.named_parameters()}  # tied: embed only ...
    new_weights["lm_head.weight"] = new_weights["model.embed_tokens.weight"]  # ... and under both names
    prompts, responses = rows(4, seed=31)
    uneven = [(prompts[:3], responses[:3]), (prompts[3:], responses[3:])]  # 3 forwards vs 1
    vdata = rows(4, seed=41)
    port = free_port()
    r0, r1 = W.run_procs([(F.update_and_infer, (r, WORLD, port, path, new_weights, uneven[r], shard(vdata, r, 2)))
                          for r in range(WORLD)], tmp_path, TIMEOUT_S)
    b = collate(prompts, responses, PAD)
    with torch.no_grad():
        want_logp = unpad_rows(log_probs_from_logits(response_logits(new, b, 1.0), b.responses), b.response_mask)
    torch.manual_seed(0)
    critic = load_value_model(path)
    vb = collate(*vdata, PAD)
    with torch.no_grad():
        want_values = unpad_rows(response_values(critic, vb), vb.response_mask)
    for res in (r0, r1):
        assert res["sharded"]
        assert res["version"] == 7
        assert set(res["weights"]) == set(new_weights)
        for n, t in new_weights.items():
            assert torch.equal(res["weights"][n], t), n
    got_logp = r0["log_probs"] + r1["log_probs"]
    got_values = r0["values"] + r1["values"]
    for got, want in zip(got_logp + got_values, want_logp + want_values):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert r0["value_stats"]["micro_batches"] == 1 and r0["value_stats"]["grad_norm"] > 0
    # the one-rank engines (process_group None) each hold the checkpoint's model
    with torch.no_grad():
        start = load_causal_lm(path)
        want_start = unpad_rows(log_probs_from_logits(response_logits(start, b, 1.0), b.responses), b.response_mask)
    assert r0["alone_mesh_size"] == r1["alone_mesh_size"] == 1
    for got, want in zip(r0["alone_log_probs"] + r1["alone_log_probs"], want_start):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_single_rank_without_process_group(path, tmp_path):
    """process_group None and no default group: the plain module behind the same members, one
    step equal to the plain reference, a DCP checkpoint written without a group."""
    from mindspeed_rl.engines.base import TrainSpec
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    from mindspeed_rl.engines.registry import make_train_engine

    data = rows(4, seed=51)
    engine = make_train_engine("fsdp", TrainSpec(model_path=path, pad_token_id=PAD, optim=OPTIM))
    assert type(engine) is FSDPTrainEngine and engine.mesh is None
    with pytest.raises(ValueError, match="reshard_after_foward"):
        FSDPTrainEngine.build(TrainSpec(model_path=path, options={"reshard_after_foward": False}))
    stats = engine.train_step(iter(F.micro_batches(*data, 2, 0.5)), F.nll_loss)
    ref, ref_loss, ref_norm = reference_step(path, *data, OPTIM)
    assert_weights_close(F.exported(engine), ref, atol=1e-5)
    assert abs(stats["loss"] / 2 - ref_loss) <= 1e-5 and abs(stats["grad_norm"] - ref_norm) <= 1e-5 * ref_norm
    files = engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert files and all(f.startswith(str(tmp_path)) for f in files)
    after_save = F.exported(engine)
    engine.train_step(iter(F.micro_batches(*data, 4, 1.0)), F.nll_loss)
    other = FSDPTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OPTIM))
    other.load_checkpoint(str(tmp_path / "ckpt"))
    assert other.version == 1
    assert all(torch.equal(t, after_save[n]) for n, t in F.exported(other).items())
    other.train_step(iter(F.micro_batches(*data, 4, 1.0)), F.nll_loss)
    assert all(torch.equal(t, F.exported(engine)[n]) for n, t in F.exported(other).items())
    lp = other.log_probs(*data, micro_batch_size=3)
    assert [t.shape[0] for t in lp] == [5] * 4 and all(t.dtype == torch.float32 for t in lp)


@pytest.mark.slow
def test_one_engine_serves_two_threads_one_call_at_a_time(path, tmp_path):
    """Issue 24: FSDP2 keeps one gathered-or-sharded state per module, so two threads' forwards on one
    engine resharded each other's parameters mid-forward ("data is not allocated yet", `mixed
    torch.Tensor and DTensor`), even on one rank. The engine now runs one call at a time; every
    concurrent result equals the one computed alone."""
    data = rows(8, seed=5)
    [r] = W.run_procs([(F.threaded_forwards, (0, 1, free_port(), path, data, 20))], tmp_path, TIMEOUT_S)
    assert r["errors"] == [], r["errors"]
    assert r["same"] == [True] * 40


@pytest.mark.slow
def test_per_micro_batch_reduce_scatter_gives_the_no_sync_gradients(path, tmp_path):
    """dp 2: the gradient shards after two micro-batches, each reduce-scattered by its backward (the engine's
    train_step), equal those of accumulating unsharded gradients with set_requires_gradient_sync(False) until
    the last micro-batch, in fp32 within 1e-6; and the two paths really differ in how often they reduce."""
    data = rows(WORLD * PER_RANK, seed=61)
    port = free_port()
    jobs = [(F.grads_two_ways, (r, WORLD, port, path, shard(data, r), PER_RANK // 2)) for r in range(WORLD)]
    for r in W.run_procs(jobs, tmp_path, TIMEOUT_S):
        # one reduce-scatter per FSDP unit (2 decoder layers + root) per backward that syncs
        assert r["reduce_scatters_per_micro_batch"] == 6 and r["reduce_scatters_no_sync"] == 3
        got, want = r["per_micro_batch"], r["no_sync"]
        assert list(got) == list(want) and all(g.dtype == torch.float32 for g in got.values())
        assert any(w.abs().max() > 0 for w in want.values())
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")
