"""Weight sync: the flat buffer, checksums, and a real broadcast between processes."""
import pytest
import torch

from mindspeed_rl.engines import HFRolloutEngine, OptimConfig, TorchTrainEngine
from mindspeed_rl.engines.weight_sync import checksum, flatten, free_port, unflatten_into

from . import _mp_workers as W
from ._common import PAD, tiny_qwen2


def _params(model):
    return [p.data for _, p in model.named_parameters()]


def test_flatten_unflatten_round_trip():
    src, dst = _params(tiny_qwen2(seed=0)), _params(tiny_qwen2(seed=1))
    flat = flatten(src)
    assert flat.dtype == torch.float32 and flat.dim() == 1
    assert flat.numel() == sum(t.numel() for t in src)
    assert torch.equal(flat[:src[0].numel()], src[0].reshape(-1))
    assert not all(torch.equal(a, b) for a, b in zip(src, dst))
    unflatten_into(flat, dst)
    for a, b in zip(src, dst):
        assert torch.equal(a, b)
    assert checksum(src) == checksum(dst)


def test_flatten_reuses_out_buffer_of_the_right_size():
    src = _params(tiny_qwen2(seed=0))
    buf = torch.zeros(sum(t.numel() for t in src))
    assert flatten(src, out=buf) is buf
    assert torch.equal(buf, flatten(src))
    other = flatten(src, out=torch.zeros(3))  # wrong size: a new buffer
    assert other.numel() == buf.numel() and torch.equal(other, buf)


def test_flatten_casts_low_precision_and_unflatten_casts_back():
    src = [torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)]
    flat = flatten(src)
    assert flat.dtype == torch.float32
    dst = [torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]
    unflatten_into(flat, dst)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))


def test_unflatten_into_rejects_a_buffer_of_another_architecture():
    dst = _params(tiny_qwen2(seed=0))
    n = sum(t.numel() for t in dst)
    with pytest.raises(ValueError, match="architecture differs"):
        unflatten_into(torch.zeros(n + 1), dst)


def test_checksum_equal_iff_weights_equal():
    a, b = _params(tiny_qwen2(seed=0)), _params(tiny_qwen2(seed=0))
    assert checksum(a) == checksum(b)
    assert checksum(a) == checksum(a)  # deterministic
    assert checksum(_params(tiny_qwen2(seed=1))) != checksum(a)
    b[3].view(-1)[7] += 1e-6  # one value, by a tiny amount
    assert checksum(a) != checksum(b)
    b[3].view(-1)[7] = a[3].view(-1)[7]
    assert checksum(a) == checksum(b)
    # the same values under another dtype of equal float32 value check out the same
    assert checksum([t.double() for t in a]) == checksum(a)


def test_colocated_sync_train_to_rollout_engine():
    """In one process weight sync is flatten + unflatten_into: the rollout engine then generates
    what the trained model generates."""
    from mindspeed_rl.engines import SamplingParams

    train = TorchTrainEngine(tiny_qwen2(seed=0, initializer_range=0.3), PAD, OptimConfig())
    rollout = HFRolloutEngine(tiny_qwen2(seed=5, initializer_range=0.3), PAD)
    readers = [t for _, t in rollout.named_parameters_for_sync()]
    assert len(readers) == len(train.parameters())
    unflatten_into(flatten(train.parameters()), readers)
    assert checksum(readers) == checksum(train.parameters())
    ref = HFRolloutEngine(train.module, PAD)
    prompts = [torch.tensor([1, 5, 6]), torch.tensor([1, 7])]
    p = SamplingParams(max_new_tokens=6, greedy=True)
    assert all(torch.equal(a, b) for a, b in zip(rollout.generate(prompts, p, 0), ref.generate(prompts, p, 0)))


def test_broadcast_between_three_processes(tmp_path):
    port = free_port()
    world = 3
    results = W.run_procs([(W.broadcast_weights, (r, world, port)) for r in range(world)], tmp_path)
    sent = checksum(_params(tiny_qwen2(seed=0)))
    assert results[0]["before"] == results[0]["after"] == sent
    for r in results[1:]:
        assert r["before"] != sent  # differently initialised before the sync
        assert r["after"] == sent


def test_missing_member_fails_within_timeout_instead_of_hanging(tmp_path):
    """Ranks 0 and 1 of a 3-member group whose rank 2 never comes, and a rank 1 whose store host
    (rank 0) never comes: all fail, after about their 3 s timeout."""
    timeout_s = 3.0
    port, unused_port = free_port(), free_port()
    jobs = [(W.join_group, (0, 3, port, timeout_s)), (W.join_group, (1, 3, port, timeout_s)),
            (W.join_group, (1, 2, unused_port, timeout_s))]
    results = W.run_procs(jobs, tmp_path, timeout_s=60)
    for r in results:
        assert r["raised"] is not None, r
        assert r["is_runtime_error"], r  # torch's DistError family
        # it waited for the member (no immediate failure), then gave up without hanging
        assert 0.8 * timeout_s <= r["elapsed"] <= 4 * timeout_s + 5, r
    assert "time" in results[0]["message"].lower()  # "Timed out ... waiting for clients"
