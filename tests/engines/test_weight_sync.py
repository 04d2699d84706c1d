"""Weight sync: bucket layouts, checksums, the colocated copy, and real broadcasts between processes."""
import pytest
import torch

from mindspeed_rl.engines.base import bucketed, hf_named_weights
from mindspeed_rl.engines.weight_sync import (ALIGN, BucketSpec, Checksum, checksum, copy_weights, free_port,
                                              tee_buckets)
from mindspeed_rl.engines.base import load_named as load_by_name

from . import _sync_ranks as S
from ._common import tiny_qwen2


def _mixed_bucket():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 33, generator=g)
    return [("a.weight", w), ("a.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("b.weight", torch.randn(1000, generator=g)), ("steps", torch.tensor(7, dtype=torch.int64)),
            ("empty", torch.zeros(0, 4)), ("tied.weight", w),  # the same tensor under a second name
            ("c.weight", torch.randn(5, 7, generator=g).to(torch.bfloat16))]


def test_bucket_layout_round_trip():
    """describe -> JSON -> spec is lossless; pack + views give back every tensor, dtype and shape
    included, at aligned offsets; a tensor under two names travels once."""
    bucket = _mixed_bucket()
    spec = BucketSpec.describe(bucket, inplace_min_bytes=4000)
    assert BucketSpec.from_json(spec.to_json()) == spec
    assert [e.name for e in spec.entries] == [n for n, _ in bucket]
    offsets = {e.name: e.offset for e in spec.entries}
    assert all(o % ALIGN == 0 for o in offsets.values())
    assert offsets["tied.weight"] == offsets["a.weight"]
    # b.weight (4000 bytes) goes in place; the runs around it are packed
    assert (offsets["b.weight"], offsets["b.weight"] + 4000, False) in spec.segments
    assert sum(e - s for s, e, _ in spec.segments) <= spec.nbytes
    payload = sum(t.numel() * t.element_size() for n, t in bucket if n != "tied.weight")
    assert payload <= spec.nbytes < payload + ALIGN * len(bucket)

    buf = torch.full((spec.nbytes,), 255, dtype=torch.uint8)
    for start, end, packed in spec.segments:  # what the wire carries, segment by segment
        if packed:
            staging = torch.empty(end - start, dtype=torch.uint8)
            spec.pack(bucket, staging, start, end)
            buf[start:end] = staging
        else:
            buf[start:end] = next(t for n, t in bucket if n == "b.weight").view(torch.uint8)
    got = spec.views(buf)
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert checksum(got) == checksum(bucket)


def test_layout_is_the_same_for_the_same_bucket_and_differs_when_it_changes():
    model = tiny_qwen2(seed=0)
    specs = lambda m, size: [BucketSpec.describe(b) for b in bucketed(hf_named_weights(m), size)]  # noqa: E731
    a = specs(model, 40_000)
    assert len(a) > 3  # the tiny model spans several buckets
    assert a == specs(tiny_qwen2(seed=3), 40_000)             # other values, same layout
    assert a != specs(model, 100_000)                          # another bucket size
    assert a != specs(model.to(torch.bfloat16), 40_000)        # another dtype


def test_bf16_stays_bf16_in_the_buffer():
    bucket = [(n, t) for n, t in hf_named_weights(tiny_qwen2(seed=0).to(torch.bfloat16))]
    spec = BucketSpec.describe(bucket)
    assert {e.dtype for e in spec.entries} == {"bfloat16"}
    assert spec.nbytes < sum(t.numel() * 4 for n, t in bucket if n != "lm_head.weight")  # no float32 upcast
    buf = torch.empty(spec.nbytes, dtype=torch.uint8)
    spec.pack(bucket, buf)
    assert all(torch.equal(a, b) and b.dtype == torch.bfloat16 for (_, a), (_, b) in zip(bucket, spec.views(buf)))


class _Wire:
    """Two members of a broadcast group in one process, each collective completing as late as
    possible: the sender's bytes are read when it waits (as a real backend may send them any time
    until then), so a buffer reused while its broadcast is in flight shows up as wrong weights."""

    def __init__(self):
        self.sent, self.kv = [], {}

    def group(self, rank):
        from mindspeed_rl.engines.weight_sync import SyncGroup
        return SyncGroup(pg=_WirePG(self, rank), store=self, rank=rank, world_size=2)

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.kv[key]


class _WirePG:
    def __init__(self, wire, rank):
        self.wire, self.rank, self.received = wire, rank, 0

    def broadcast(self, tensors, opts):
        (t,) = tensors
        if self.rank == opts.rootRank:
            self.wire.sent.append(None)
            return _Work(lambda i=len(self.wire.sent) - 1: self.wire.sent.__setitem__(i, t.clone()))
        i, self.received = self.received, self.received + 1
        return _Work(lambda: t.copy_(self.wire.sent[i]))


class _Work:
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        self.fn()
        return True


@pytest.mark.parametrize("receive", [{}, {"prefetch": False}, {"prefetch": False, "reuse_buffers": False},
                                     {"targets": True}])
@pytest.mark.parametrize("inplace_min_bytes,overlap", [(1, True), (8_000, True), (1 << 40, True), (8_000, False)])
def test_send_and_receive_with_late_completing_broadcasts(inplace_min_bytes, overlap, receive):
    """The whole protocol in one process (headers, layout in the store, in-place and packed
    segments, two staging slots, prefetching receivers) against a group whose broadcasts complete
    only when waited for; then a second sync with another layout."""
    from mindspeed_rl.engines.weight_sync import receive_buckets, send_buckets

    wire = _Wire()
    tx, rx = wire.group(0), wire.group(1)
    sender, reader = tiny_qwen2(seed=0), tiny_qwen2(seed=1)
    if receive.get("targets"):  # big tensors straight into the reader's own (but a transposed one)
        targets = dict(reader.named_parameters(remove_duplicate=False))
        targets["model.layers.0.mlp.up_proj.weight"] = targets["model.layers.0.mlp.up_proj.weight"].t()
        receive = {"targets": targets}
    for bucket_bytes, version in ((40_000, 1), (40_000, 1), (100_000, 2)):
        info = send_buckets(tx, bucketed(hf_named_weights(sender), bucket_bytes),
                            inplace_min_bytes=inplace_min_bytes, overlap=overlap)
        assert None not in wire.sent  # the sender waited for every broadcast it started
        got = []
        for bucket in receive_buckets(rx, **receive):
            got += [n for n, _ in bucket]
            load_by_name(reader, bucket)
        assert rx.last_sync["buckets"] == info["buckets"] > 2 and rx.layout_version == version
        direct = rx.last_sync["bytes_into_targets"]
        if "targets" in receive and inplace_min_bytes < 1 << 40:
            assert 0 < direct < info["bytes"]
            assert set(got) < {n for n, _ in hf_named_weights(sender)}
        else:
            assert direct == 0 and got == [n for n, _ in hf_named_weights(sender)]
        assert checksum(hf_named_weights(reader)) == checksum(hf_named_weights(sender))
        with torch.no_grad():
            for p in sender.parameters():
                p.add_(1.0)  # new weights for the next sync


def test_checksum_equal_iff_weights_equal():
    a, b = tiny_qwen2(seed=0), tiny_qwen2(seed=0)
    ca = checksum(hf_named_weights(a))
    assert ca == checksum(hf_named_weights(b)) == checksum(reversed(list(hf_named_weights(b))))  # any order
    assert checksum(hf_named_weights(tiny_qwen2(seed=1))) != ca
    p = dict(b.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        p.view(-1)[7] += 1e-6
    assert checksum(hf_named_weights(b)) != ca
    named = list(hf_named_weights(a))
    assert checksum([(n + "x", t) for n, t in named]) != ca                 # names count
    assert checksum([(n, t.double()) for n, t in named]) != ca              # dtypes count
    assert "lm_head.weight" in dict(named)                                  # tied names are hashed too
    assert checksum([t for _, t in named]) == checksum([t for _, t in named])  # bare tensors work
    streamed = Checksum()
    for bucket in bucketed(reversed(named), 30_000):  # fed a bucket at a time, in any order
        streamed.update(bucket)
    assert streamed.hexdigest() == ca


def test_load_by_name_rejects_foreign_names_and_shapes():
    model = tiny_qwen2(seed=0)
    with pytest.raises(ValueError, match="'model.nope' is not a weight of the reading model"):
        load_by_name(model, [("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        load_by_name(model, [("model.norm.weight", torch.zeros(3))])


class _Reader:
    """A rollout engine's `update_weights`, on a plain HF model."""

    def __init__(self, model):
        self.model, self.weight_version, self.calls = model, 0, 0

    def update_weights(self, named, version):
        load_by_name(self.model, named)
        self.weight_version, self.calls = version, self.calls + 1


def test_colocated_sync_is_a_copy_per_bucket():
    train = tiny_qwen2(seed=0, initializer_range=0.3)
    readers = [_Reader(tiny_qwen2(seed=s, initializer_range=0.3)) for s in (5, 6)]
    info = copy_weights(bucketed(hf_named_weights(train), 40_000), readers, version=3)
    assert info["buckets"] > 3 and all(r.calls == info["buckets"] and r.weight_version == 3 for r in readers)
    want = checksum(hf_named_weights(train))
    assert all(checksum(hf_named_weights(r.model)) == want for r in readers)
    # a sending rank's one pass: local readers loaded and the stream hashed on the way out
    local, digest = _Reader(tiny_qwen2(seed=7)), Checksum()
    passed = list(tee_buckets(bucketed(hf_named_weights(train), 40_000), [local], 4, digest))
    assert len(passed) == info["buckets"] and local.weight_version == 4
    assert checksum(hf_named_weights(local.model)) == digest.hexdigest() == want
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(readers[0].model(ids).logits, train(ids).logits)


ROUNDS = [
    {"dtype": "float32", "bucket_bytes": 40_000, "inplace_min_bytes": 8_000},   # v1: first layout
    {"dtype": "float32", "bucket_bytes": 40_000, "inplace_min_bytes": 8_000},   # same: cached
    {"dtype": "float32", "bucket_bytes": 100_000, "inplace_min_bytes": 1 << 20},  # v2: bucket size
    {"dtype": "bfloat16", "bucket_bytes": 100_000, "inplace_min_bytes": 1 << 20},  # v3: dtype
    {"dtype": "bfloat16", "bucket_bytes": 100_000, "inplace_min_bytes": 1 << 20, "keep": 1},  # v4: fewer
    {"dtype": "bfloat16", "bucket_bytes": 100_000, "inplace_min_bytes": 1 << 20, "keep": 1},  # same: cached
]


def test_sender_to_two_receivers_over_gloo(tmp_path):
    """Rank 0 sends a tied tiny Qwen2 in several buckets to two readers (one prefetching into reused
    buffers, one into a fresh buffer per bucket): they end with the sender's weights, lm_head.weight
    included; bf16 travels as bf16; a changed layout is detected on every side."""
    port = free_port()
    opts = [{}, {}, {"prefetch": False, "reuse_buffers": False}]
    res = S.run_procs([(S.sync_rounds, (r, 3, port, ROUNDS, opts[r])) for r in range(3)], tmp_path)
    sender, readers = res[0], res[1:]
    changed = [True, False, True, True, True, False]
    versions = [1, 1, 2, 3, 4, 4]
    for i, rd in enumerate(sender):
        assert rd["info"]["layout_changed"] == changed[i] and rd["layout_version"] == versions[i], (i, rd)
        for reader in readers:
            got = reader[i]
            assert got["info"]["layout_changed"] == changed[i], (i, got["info"])
            assert got["layout_version"] == versions[i]
            assert got["info"]["buckets"] == rd["info"]["buckets"] and got["info"]["bytes"] == rd["info"]["bytes"]
    assert sender[0]["info"]["buckets"] > 3
    assert sender[4]["info"]["buckets"] == 1 < sender[3]["info"]["buckets"]
    for reader in readers:
        assert reader[-1]["layout_changes"] == 4
        for i in (0, 1, 2):  # whole fp32 model: identical weights, under every name
            assert reader[i]["after"] == sender[i]["after"] == sender[i]["sent"]
            assert reader[i]["dtypes"] == {torch.float32}
            assert "lm_head.weight" in reader[i]["names"]
        assert reader[0]["before"] != sender[0]["sent"]  # they did start from other weights
        assert reader[3]["after"] == sender[3]["after"] == sender[3]["sent"]  # whole bf16 model
        assert reader[3]["dtypes"] == {torch.bfloat16}
        assert reader[3]["before"] != sender[3]["after"]
    # bf16 on the wire: half the bytes of the same buckets in float32 (give or take alignment)
    assert 0.45 < sender[3]["info"]["bytes"] / sender[2]["info"]["bytes"] < 0.55


def test_missing_member_fails_within_timeout_instead_of_hanging(tmp_path):
    """Ranks 0 and 1 of a 3-member group whose rank 2 never comes, and a rank 1 whose store host
    (rank 0) never comes: all fail, after about their 3 s timeout."""
    timeout_s = 3.0
    port, unused_port = free_port(), free_port()
    jobs = [(S.join_group, (0, 3, port, timeout_s)), (S.join_group, (1, 3, port, timeout_s)),
            (S.join_group, (1, 2, unused_port, timeout_s))]
    results = S.run_procs(jobs, tmp_path, timeout_s=60)
    for r in results:
        assert r["raised"] is not None, r
        assert r["is_runtime_error"], r  # torch's DistError family
        # it waited for the member (no immediate failure), then gave up without hanging
        assert 0.8 * timeout_s <= r["elapsed"] <= 4 * timeout_s + 5, r
    assert "time" in results[0]["message"].lower()  # "Timed out ... waiting for clients"


def test_receiver_fails_within_timeout_when_nothing_is_sent(tmp_path):
    """A receiver waiting for a bucket that never comes gives up after the group's timeout."""
    timeout_s = 3.0
    port = free_port()
    r = S.run_procs([(S.sender_gone, (rank, 2, port, timeout_s)) for rank in range(2)], tmp_path, timeout_s=60)[1]
    assert r["raised"] is not None, r
    assert 0.8 * timeout_s <= r["elapsed"] <= 4 * timeout_s + 5, r
