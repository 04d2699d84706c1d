"""Weight sync: bucket layouts, checksums, the colocated copy, and real broadcasts between processes."""
import pytest
import torch

from mindspeed_rl.engines.base import bucketed, flatten_parameters, hf_named_weights
from mindspeed_rl.engines.base import ALIGN
from mindspeed_rl.engines.sync.bucket_layout import BucketSpec
from mindspeed_rl.engines.sync.weight_sync import Checksum, checksum, copy_weights, free_port, tee_buckets
from mindspeed_rl.engines.base import load_named as load_by_name

from . import _sync_ranks as S
from ._common import spy_update_weights, tiny_qwen2


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
        from mindspeed_rl.engines.sync.weight_sync import SyncGroup
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
    from mindspeed_rl.engines.sync.weight_sync import receive_buckets, send_buckets

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_receiver_fails_within_timeout_when_nothing_is_sent(tmp_path):
    """A receiver waiting for a bucket that never comes gives up after the group's timeout."""
    timeout_s = 3.0
    port = free_port()
    r = S.run_procs([(S.sender_gone, (rank, 2, port, timeout_s)) for rank in range(2)], tmp_path, timeout_s=60)[1]
    assert r["raised"] is not None, r
    assert 0.8 * timeout_s <= r["elapsed"] <= 4 * timeout_s + 5, r


# ---------------------------------------------------------------------------- a reader worker's side

def _reader_worker(group, rollout, infer):
    """A rollout worker's weight host (workers/weights.py, its real `sync_weights`) over the worker's engine set,
    holding an HF rollout engine and an inference copy of 'actor', both fed by `group` with verify on."""
    from types import SimpleNamespace

    from mindspeed_rl.workers.engine_set import EngineSet
    from mindspeed_rl.workers.weights import WeightHost

    engines = EngineSet([], seed=0, device="cpu", process_group=None, tokenizer_path="", stop_tokens=[])
    engines.rollout["actor"], engines.infer["actor"] = rollout, infer
    w = WeightHost(engines, rank=0, group="rollout", device="cpu",
                   sync_cfg=SimpleNamespace(verify=True, bucket_mb=1, backend="gloo"), stage_timeout_s=60.0)
    w.sync_groups["actor"] = group
    return w


def _segment_broadcasts(buckets, inplace_min_bytes) -> dict[str, int]:
    """Index on the wire of the first in-place and the first packed segment of the second bucket
    (broadcasts go: per bucket its header, then its segments; then the end header). Not the first
    bucket: its embedding is received again as the tied lm_head, which would repair it."""
    at, first = 0, {}
    for i, bucket in enumerate(buckets):
        at += 1
        for _, _, packed in BucketSpec.describe(bucket, inplace_min_bytes).segments:
            if i == 1:
                first.setdefault("packed" if packed else "in place", at)
            at += 1
    return first


def _sync_to_reader_worker(bucket_bytes, inplace_min_bytes, corrupt=None, flat_sender=False):
    """The trainer's side as `Worker._sync` runs it (tee into a digest, `send_buckets`) over a `_Wire`,
    then a reader worker's `sync_weights("actor", 3)`; `corrupt` flips one byte of that segment on
    the wire; `flat_sender`: the sender's parameters in one buffer, as a train engine holds them.
    Returns what a test looks at (`verified`: the driver's verdict)."""
    from types import SimpleNamespace

    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.engines.sync.weight_sync import send_buckets

    wire = _Wire()
    sender = tiny_qwen2(seed=0, initializer_range=0.3)
    if flat_sender:
        flatten_parameters(sender)
    rollout = HFRolloutEngine(tiny_qwen2(seed=1), pad_token_id=0)
    infer = TorchTrainEngine(tiny_qwen2(seed=2), pad_token_id=0)   # no optimizer: a reader
    calls = spy_update_weights(rollout)
    storage = {n: p.data_ptr() for n, p in rollout.model.named_parameters(remove_duplicate=False)}
    buffers = {n: b.clone() for n, b in rollout.model.named_buffers()}
    digest = Checksum()
    send_buckets(wire.group(0), tee_buckets(bucketed(hf_named_weights(sender), bucket_bytes), digest=digest),
                 inplace_min_bytes=inplace_min_bytes)
    if corrupt is not None:
        i = _segment_broadcasts(bucketed(hf_named_weights(sender), bucket_bytes), inplace_min_bytes)[corrupt]
        wire.sent[i].view(-1)[3] ^= 1
    out = _reader_worker(wire.group(1), rollout, infer).sync_weights("actor", 3)
    sent = digest.hexdigest()
    # the driver's check (trainer/driver.py `_sync_weights`): every reported checksum equals the sent one
    verified = bool(out["received"]) and all(c == sent for c in out["received"])
    return SimpleNamespace(sender=sender, sent=sent, out=out, rollout=rollout, infer=infer, calls=calls,
                           verified=verified, storage=storage, buffers=buffers)


@pytest.mark.parametrize("bucket_bytes", [40_000, 1 << 20])   # tied weights in two buckets / in one
def test_reader_worker_receives_big_tensors_into_its_rollout_engine_bit_exact(bucket_bytes):
    """`Worker.sync_weights` on a reader: tensors of 4096 bytes and more (the 16x64 embedding and so
    the tied lm_head too) land straight in the HF rollout engine's parameters, the rest through its
    `update_weights`; the inference copy in the same worker gets everything; both serve version 3
    with the sender's exact bytes, the digest of what arrived and both engines' checksums equal the
    sent digest, and nothing else of the reader changes."""
    r = _sync_to_reader_worker(bucket_bytes, 4096)
    sender, out, rollout, infer, calls = r.sender, r.out, r.rollout, r.infer, r.calls
    rollout_model = rollout.model
    assert r.verified and len(out["received"]) == 3, out   # the stream's digest and both engines'
    n_bytes = sum(t.numel() * t.element_size() for _, t in hf_named_weights(sender))
    assert 0 < out["bytes_into_targets"] < n_bytes
    want = dict(hf_named_weights(sender))
    for engine_params in (dict(rollout_model.named_parameters(remove_duplicate=False)),
                          dict(infer.module.named_parameters(remove_duplicate=False))):
        assert engine_params.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(engine_params[name], t), name
    # the tie survives: one parameter under both names, holding the sender's embedding
    assert rollout_model.lm_head.weight is rollout_model.model.embed_tokens.weight
    assert infer.module.lm_head.weight is infer.module.model.embed_tokens.weight
    # in place, with no copy: update_weights never saw those names; it was told the version at the end
    in_place = {n for n, t in want.items() if t.numel() * t.element_size() >= 4096}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"} <= in_place
    seen = {n for c in calls for n in c}
    assert not seen & in_place and seen == want.keys() - in_place
    assert calls[-1] == []
    assert rollout.weight_version == 3 and infer.version == 3
    assert all(not p.requires_grad for p in rollout_model.parameters())
    assert {n: p.data_ptr() for n, p in rollout_model.named_parameters(remove_duplicate=False)} == r.storage
    assert all(torch.equal(b, r.buffers[n]) for n, b in rollout_model.named_buffers())   # rotary tables etc.
    ids = torch.tensor([[1, 5, 6, 7, 3]])
    with torch.no_grad():
        assert torch.equal(rollout_model(ids).logits, sender(ids).logits)
        assert torch.equal(infer.module(ids).logits, sender(ids).logits)


def test_reader_worker_without_targets_loads_every_bucket():
    """A reader that offers no targets (vLLM) gets the whole stream through `update_weights`: the
    same weights, nothing received in place."""
    from mindspeed_rl.engines.sync import weight_sync as W
    from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine

    wire = _Wire()
    sender = tiny_qwen2(seed=0)
    rollout = HFRolloutEngine(tiny_qwen2(seed=1), pad_token_id=0)
    rollout.receive_targets = lambda: None
    calls = spy_update_weights(rollout)
    W.send_buckets(wire.group(0), bucketed(hf_named_weights(sender), 40_000), inplace_min_bytes=4096)
    info = W.receive_weights(wire.group(1), [rollout], 5)
    assert info["bytes_into_targets"] == 0 and info["names_into_targets"] == []
    assert [n for c in calls for n in c] == [n for n, _ in hf_named_weights(sender)]
    assert rollout.weight_version == 5 and rollout.state_checksum() == checksum(hf_named_weights(sender))


@pytest.mark.parametrize("corrupt", ["in place", "packed"])
def test_verify_catches_a_corrupted_bucket_received_in_place(corrupt):
    """One byte flipped on the wire, in a tensor received straight into the rollout engine's
    parameters or in a packed run it copies out: the digest of what arrived and both engines'
    checksums differ from the sent digest, so the driver's check fails."""
    r = _sync_to_reader_worker(40_000, 4096, corrupt=corrupt)
    assert not r.verified
    assert len(r.out["received"]) == 3 and all(c != r.sent for c in r.out["received"]), r.out


# ---------------------------------------------------------------------------- flat parameters: one broadcast per bucket

def _flat_specs(bucket_bytes):
    """The layout a flattened train engine's export takes (what `flat_sync`'s sender sends)."""
    from mindspeed_rl.engines import OptimConfig
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

    engine = TorchTrainEngine(tiny_qwen2(seed=0), 0, OptimConfig())
    return [BucketSpec.describe(b, 4096) for b in engine.export_weights(bucket_bytes)]


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 40_000])   # the whole model in one bucket / in 10
def test_flattened_trainer_sends_each_bucket_as_one_broadcast_over_gloo(tmp_path, bucket_bytes):
    """A trained engine (parameters in one buffer) syncs to a rollout engine over a real gloo group,
    twice with an optimizer step between: each bucket is its header and ONE broadcast straight
    from the trainer's parameters into the reader's (the bucket holding the tied lm_head, which
    lies at the embedding, not after the final norm, takes one more), both sides issue the same
    broadcasts, no bucket goes through `update_weights`, and the reader serves the sender's exact
    weights, tie kept, in the storage it had."""
    port = free_port()
    # spans of 4096 bytes and more go straight (the tiny model is 327 KiB, under the default 1 MiB)
    sender, reader = S.run_procs([(S.flat_sync, (r, port, bucket_bytes, 4096)) for r in range(2)], tmp_path)
    specs = _flat_specs(bucket_bytes)
    assert all(not packed for s in specs for _, _, packed in s.segments)
    for s in specs:
        head = any(e.name == "lm_head.weight" for e in s.entries)
        # in one bucket the head is the embedding's own view (one offset); in another it is not adjacent
        assert len(s.segments) == (2 if head and len(specs) > 1 else 1), s.segments
    expected = sum(1 + len(s.segments) for s in specs) + 1   # headers, spans, the end header
    payload = sum(e.nbytes for s in specs for e in {e.offset: e for e in s.entries if e.nbytes}.values())
    assert len(specs) == (1 if bucket_bytes == 1 << 20 else 10)
    for tx, rx in zip(sender["rounds"], reader["rounds"]):
        assert len(tx["broadcasts"]) == expected and rx["broadcasts"] == tx["broadcasts"]
        assert rx["digest"] == rx["served"] == tx["digest"]
        assert torch.equal(rx["logits"], tx["logits"])
        assert rx["tied"] and rx["same_storage"]
        assert rx["calls"] == [[]]          # nothing copied out: only told the version at the end
        assert rx["info"]["bytes_into_targets"] == payload
    assert sender["rounds"][0]["digest"] != sender["rounds"][1]["digest"]   # it did train in between
    assert [rx["version"] for rx in reader["rounds"]] == [1, 2]


@pytest.mark.parametrize("reader_layout", ["plain", "swapped"])
def test_contiguous_bucket_into_targets_that_lie_otherwise_is_copied_out_right(reader_layout):
    """A flattened sender's spans meet a reader whose targets do not lie as the span: separate
    tensors (plain), or one buffer but two same-shaped targets swapped in the dict. Those spans
    go into the receive buffer and are copied out by name (a wrong direct receive would swap
    q and k): the reader ends bit-exact; spans whose targets do lie right still go straight in."""
    from mindspeed_rl.engines.sync.weight_sync import receive_buckets, send_buckets

    wire = _Wire()
    sender, reader = tiny_qwen2(seed=0), tiny_qwen2(seed=1)
    flatten_parameters(sender)
    targets = dict(reader.named_parameters(remove_duplicate=False))
    if reader_layout == "swapped":
        flatten_parameters(reader)
        targets = dict(reader.named_parameters(remove_duplicate=False))
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        targets[q], targets[k] = targets[k], targets[q]
    info = send_buckets(wire.group(0), bucketed(hf_named_weights(sender), 40_000), inplace_min_bytes=4096)
    rx = wire.group(1)
    got = []
    for bucket in receive_buckets(rx, targets=targets):
        got += [n for n, _ in bucket]
        load_by_name(reader, bucket)
    assert checksum(hf_named_weights(reader)) == checksum(hf_named_weights(sender))
    direct = rx.last_sync["bytes_into_targets"]
    if reader_layout == "plain":   # only spans of one tensor (the lm_head, lone MLP weights) lie right
        lone = 0
        for b in bucketed(hf_named_weights(sender), 40_000):
            spec = BucketSpec.describe(b, 4096)
            for start, end, packed in spec.segments:
                inside = {e.offset for e in spec.entries if e.nbytes and start <= e.offset < end}
                lone += end - start if not packed and len(inside) == 1 else 0
        assert 0 < direct == lone < info["bytes"] / 2 and "lm_head.weight" not in got
    else:                          # only the bucket holding q and k was copied out, the others went straight in
        first = next(iter(bucketed(hf_named_weights(sender), 40_000)))
        assert q in got and k in got and got == [n for n, _ in first]
        assert 0 < direct < info["bytes"]


def test_verify_catches_a_corrupted_byte_of_a_contiguous_bucket():
    """A flattened sender: the rollout engine gets every bucket in one broadcast straight into its
    parameters (verified); one byte flipped in such a broadcast makes every reported checksum
    differ from the sent digest, so the driver's check fails."""
    r = _sync_to_reader_worker(40_000, 4096, flat_sender=True)
    assert r.verified and r.calls == [[]], r.calls   # all straight in, and still proven
    bad = _sync_to_reader_worker(40_000, 4096, corrupt="in place", flat_sender=True)
    assert not bad.verified
    assert len(bad.out["received"]) == 3 and all(c != bad.sent for c in bad.out["received"]), bad.out


@pytest.mark.parametrize("intruder", [False, True])
def test_span_with_another_target_in_its_padding_is_not_received_in_place(intruder):
    """Two 40-byte tensors side by side at offsets 0 and 64 go as one span of 104 bytes, padding
    included. A reader laid out the same way takes it in place, unless another of its targets
    lives in the padding: then the span is received into the buffer and copied out, and that
    target keeps its value."""
    from mindspeed_rl.engines.sync.weight_sync import receive_buckets, send_buckets

    def laid_out(fill):
        buf = torch.full((128,), fill, dtype=torch.uint8)
        return buf, buf[0:40].view(torch.float32), buf[64:104].view(torch.float32)

    _, a, b = laid_out(0)
    a.copy_(torch.arange(10.0))
    b.copy_(-torch.arange(10.0))
    spec = BucketSpec.describe([("a", a), ("b", b)], inplace_min_bytes=1)
    assert spec.segments == ((0, 104, False),)
    rbuf, ra, rb = laid_out(1)
    targets = {"a": ra, "b": rb}
    if intruder:
        targets["other"] = rbuf[40:64].view(torch.float32)   # 6 floats in the padding after `a`
    before = rbuf[40:64].clone()
    wire = _Wire()
    send_buckets(wire.group(0), [[("a", a), ("b", b)]], inplace_min_bytes=1)
    rx = wire.group(1)
    got = [(n, t.clone()) for bucket in receive_buckets(rx, targets=targets) for n, t in bucket]
    if intruder:
        assert [n for n, _ in got] == ["a", "b"] and rx.last_sync["bytes_into_targets"] == 0
        assert torch.equal(rbuf[40:64], before)
        assert torch.equal(got[0][1], a) and torch.equal(got[1][1], b)
    else:
        assert got == [] and rx.last_sync["bytes_into_targets"] == 80
        assert torch.equal(ra, a) and torch.equal(rb, b)
