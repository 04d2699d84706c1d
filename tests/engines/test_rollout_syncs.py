"""The hf engine's decode loop never waits on the device but once per `check_every` tokens.

On a GPU every host sync (a tensor read in Python: `.item()`, `bool(t)`, `nonzero`, a boolean mask's
indexing) stalls the CPU until the device has caught up, so the next kernels are not queued ahead. The CPU
cannot show the stall, but it shows the operations that would cause it: a `TorchDispatchMode` counts them
in one `generate`, transformers' forward included (its 2D-mask path evaluates `fast_all(padding_mask)` on
every forward; the engine hands it a 4D mask instead)."""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_rl.engines.base import SamplingParams
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine, prompt_mask

SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero", "aten::equal",
           "aten::item"}


class SyncCount(TorchDispatchMode):
    """Counts the aten operations that read a device tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNCING:
            self.ops[name] += 1
        elif name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in (args[1] or []) if i is not None):
            self.ops["aten::index (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


def _engine(check_every: int, cuda_graphs: bool = False) -> HFRolloutEngine:
    from mindspeed_rl.models import load_causal_lm, resolve_model_path
    return HFRolloutEngine(load_causal_lm(str(resolve_model_path("builtin:tiny-qwen2")), "float32"), 0,
                           check_every=check_every, cuda_graphs=cuda_graphs)


def _prompts(n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 14, (int(k),), generator=g) for k in torch.randint(1, 9, (n,), generator=g)]


def test_at_most_one_sync_per_check_every_tokens():
    engine = _engine(check_every=8)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=(1,))
    prompts = _prompts()
    with SyncCount() as count:
        engine.generate(prompts, params, list(range(8)))
    assert sum(count.ops.values()) <= 32 // 8, dict(count.ops)
    assert not {k: v for k, v in count.ops.items() if k != "aten::nonzero"}, dict(count.ops)


def test_the_static_decode_reads_one_count_per_check_every_tokens():
    """The static loop (engines/rollout/static_decode.py) run eagerly, bucket moves included: its only host read is the
    running count every `check_every` tokens (on CUDA a pinned copy read one check later), and a move to a
    smaller bucket selects the running rows by a sort, not a `nonzero`."""
    engine = _engine(check_every=8, cuda_graphs=True)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=(1,))
    prompts = _prompts()
    with SyncCount() as count:
        out = engine.generate(prompts, params, list(range(8)))
    [decoder] = [d for free in engine._decoders._free.values() for d in free]
    assert decoder.moves, [len(r) for r in out.responses]   # the bucket moves ran inside the count
    assert sum(count.ops.values()) <= 32 // 8, dict(count.ops)
    assert set(count.ops) <= {"aten::_local_scalar_dense"}, dict(count.ops)


def test_without_stop_tokens_the_loop_never_syncs():
    engine = _engine(check_every=8)
    prompts = _prompts()
    with SyncCount() as count:
        out = engine.generate(prompts, SamplingParams(max_new_tokens=16), list(range(8)))
    assert sum(count.ops.values()) == 0, dict(count.ops)
    assert [len(r) for r in out.responses] == [16] * 8


def test_the_4d_masks_give_the_2d_masks_log_probs():
    """The engine's log-probs of what it sampled equal a teacher-forced forward over prompt + response with
    transformers' own 2D mask (the greedy tokens too): the 4D masks see exactly the real tokens."""
    from mindspeed_rl.engines.batching import collate
    engine = _engine(check_every=1)
    prompts = _prompts()
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(1,)), list(range(8)))
    b = collate(prompts, out.responses, 0)
    with torch.no_grad():
        logits = engine.model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                              position_ids=b.position_ids).logits
    P = b.prompt_width
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, b.responses[..., None])[..., 0]
    for i, lp in enumerate(out.log_probs):
        torch.testing.assert_close(lp, logp[i, :len(lp)], rtol=0, atol=1e-5)


def test_a_padding_position_sees_itself_and_no_real_token_sees_padding():
    attn = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    m = prompt_mask(attn, torch.float32)[:, 0] == 0
    assert m[0].tolist() == [[True, False, False, False], [False, True, False, False],
                             [False, False, True, False], [False, False, True, True]]
    assert m[1].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
