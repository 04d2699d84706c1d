"""Mixed precision by the book on the torch backend (CPU autocast bf16): `dtype` is the compute
dtype; a trained engine keeps fp32 master weights and fp32 AdamW state and computes under autocast;
an inference-only engine holds `dtype`; exports are in `dtype`."""
import pytest
import torch

from mindspeed_rl.engines import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.base import cast_bucket
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.engines.sync.bucket_layout import BucketSpec

from ._common import PAD, flat_params, nll_loss_fn, random_rows, tiny_qwen2

PROMPTS, RESPONSES = random_rows(4, [3, 1, 5, 2], seed=1), random_rows(4, [4, 2, 6, 3], seed=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_qwen2(seed=0, initializer_range=0.1).save_pretrained(path)
    return str(path)


def build(path, dtype, optim=None, **options):
    return TorchTrainEngine.build(TrainSpec(model_path=path, dtype=dtype, pad_token_id=PAD, optim=optim,
                                            options=options))


def step(engine):
    return engine.train_step([MicroBatch({"prompts": PROMPTS, "responses": RESPONSES}, 1.0, last=True)], nll_loss_fn)


def test_trained_engine_keeps_fp32_masters_and_optimizer_state(checkpoint):
    engine = build(checkpoint, "bfloat16", OptimConfig(lr=1e-3))
    assert engine.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    step(engine)
    state = [s for s in engine.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state)


def test_forward_runs_in_the_compute_dtype(checkpoint):
    """The bf16 engine's log-probs are the autocast ones: near the fp32 engine's, not equal to them."""
    bf16, fp32 = build(checkpoint, "bfloat16", OptimConfig()), build(checkpoint, "float32", OptimConfig())
    a = torch.cat(bf16.log_probs(PROMPTS, RESPONSES, 4))
    b = torch.cat(fp32.log_probs(PROMPTS, RESPONSES, 4))
    assert a.dtype == torch.float32
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=0, atol=0.1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = fp32.forward(fp32.batch(PROMPTS, RESPONSES))   # fp32's own model under autocast
    want = torch.cat([logp[i, :r.numel()] for i, r in enumerate(RESPONSES)])
    torch.testing.assert_close(a, want, rtol=0, atol=0)


def test_an_update_below_bf16_resolution_is_not_lost(checkpoint):
    """Adam moves each weight by about lr = 1e-5: far below bf16's spacing at these magnitudes
    (2**-8 relative), so bf16 weights would not move at all; the fp32 masters do."""
    engine = build(checkpoint, "bfloat16", OptimConfig(lr=1e-5))
    before = flat_params(engine.module)
    step(engine)
    after = flat_params(engine.module)
    moved = (after - before).abs()
    big = before.abs() > 0.05
    same_in_bf16 = (after[big].bfloat16() == before[big].bfloat16()).float().mean()
    assert same_in_bf16 > 0.95                                            # invisible in bf16 ...
    assert (moved[big] > 5e-6).float().mean() > 0.9                      # ... kept by the masters
    assert moved.max() < 2e-5


def test_export_is_in_the_compute_dtype_and_a_bf16_reader_matches_it(checkpoint):
    trainer = build(checkpoint, "bfloat16", OptimConfig(lr=1e-3))
    step(trainer)
    reader = build(checkpoint, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in reader.module.parameters())   # inference holds bf16
    assert reader.module.model.rotary_emb.inv_freq.dtype == torch.float32      # buffers as loaded
    buckets = list(trainer.export_weights(20_000))
    assert len(buckets) > 2 and all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)
    for bucket in buckets:
        reader.update_weights(bucket, version=1)
    assert reader.state_checksum() == trainer.state_checksum()
    for (n, a), (_, b) in zip(reader.module.named_parameters(), trainer.module.named_parameters()):
        assert torch.equal(a, b.bfloat16()), n


def test_a_cast_bucket_lies_as_on_the_wire():
    """Cast copies go into one buffer at the wire's offsets: the bucket is still one broadcast; a
    tied weight named twice takes one place."""
    model = tiny_qwen2(seed=0)
    bucket = list((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
    cast = cast_bucket(bucket, torch.bfloat16)
    spec = BucketSpec.describe(cast, inplace_min_bytes=1)
    assert [s[2] for s in spec.segments] == [False]             # one span, nothing packed
    names = dict(cast)
    assert names["lm_head.weight"].data_ptr() == names["model.embed_tokens.weight"].data_ptr()
    for (n, t), (_, c) in zip(bucket, cast):
        assert c.dtype == torch.bfloat16 and torch.equal(c, t.bfloat16()), n
    assert cast_bucket(cast, torch.bfloat16) is cast             # already in the dtype: no copy


def test_cpu_default_stays_fp32(checkpoint):
    engine = build(checkpoint, "float32", OptimConfig())
    assert engine.compute_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    assert all(t.dtype == torch.float32 for b in engine.export_weights(1 << 30) for _, t in b)


def test_fsdp_one_rank_keeps_fp32_masters_and_optimizer_state_and_exports_dtype(checkpoint):
    """fsdp on one rank (no MixedPrecisionPolicy there): fp32 master weights and AdamW state, exports
    in the compute dtype; on the CPU it computes in fp32, as over a mesh (autocast is for devices)."""
    from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
    engine = FSDPTrainEngine.build(TrainSpec(model_path=checkpoint, dtype="bfloat16", pad_token_id=PAD,
                                             optim=OptimConfig(lr=1e-3)))
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    engine.train_step([MicroBatch({"prompts": PROMPTS, "responses": RESPONSES}, 1.0, last=True)], nll_loss_fn)
    state = list(engine.optimizer.state.values())
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state)
    exported = [t for bucket in engine.export_weights(1 << 20) for _, t in bucket]
    assert exported and all(t.dtype == torch.bfloat16 for t in exported)
