"""`base.flatten_parameters`: a module's parameters moved into one buffer, which weight sync sends
(and receives) a bucket at a time as one broadcast. Moving them must change nothing else."""
import torch

from mindspeed_rl.engines import OptimConfig
from mindspeed_rl.engines.base import ALIGN, flatten_parameters
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, nll_loss_fn, random_rows, tiny_qwen2


def _layout(module):
    """(storage address, byte offset) of each parameter, in named_parameters() order."""
    return [(p.untyped_storage().data_ptr(), p.storage_offset() * p.element_size()) for p in module.parameters()]


def test_flatten_keeps_values_ties_and_forward_and_lays_params_out_in_order():
    model, ref = tiny_qwen2(seed=0), tiny_qwen2(seed=0)
    params = list(model.parameters())
    (buf,) = flatten_parameters(model).values()
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert model.lm_head.weight is model.model.embed_tokens.weight   # the tie is one Parameter still
    layout = _layout(model)
    assert {s for s, _ in layout} == {buf.untyped_storage().data_ptr()}   # all in the one buffer
    offsets = [o for _, o in layout]
    assert offsets == sorted(offsets) and all(o % ALIGN == 0 for o in offsets)
    for (o, p), o_next in zip(zip(offsets, params), offsets[1:] + [buf.numel()]):
        assert o + p.numel() * p.element_size() <= o_next < o + p.numel() * p.element_size() + ALIGN
    for (n, a), (_, b) in zip(model.named_parameters(remove_duplicate=False),
                              ref.named_parameters(remove_duplicate=False)):
        assert torch.equal(a, b), n
    ids = torch.tensor([[1, 5, 6, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # idempotent: a second call copies nothing
    assert flatten_parameters(model)[(buf.device, torch.float32)].data_ptr() == buf.data_ptr()
    assert _layout(model) == layout


def test_flatten_groups_by_dtype():
    model = tiny_qwen2(seed=0)
    model.model.norm.to(torch.bfloat16)
    bufs = flatten_parameters(model)
    assert set(bufs) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.bfloat16)}
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.untyped_storage().data_ptr() == bufs[torch.device("cpu"), torch.bfloat16].data_ptr()


def test_trained_engine_on_flat_params_steps_exactly_like_plain_params():
    """The trainer flattens its model before its optimizer sees it: gradients, clipping and AdamW
    on views give bit for bit what they give on separate tensors, and the parameters stay views
    of the one buffer (so the next sync still goes as one broadcast per bucket)."""
    prompts, responses = random_rows(4, 3, seed=1), random_rows(4, 5, seed=2)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    engine = TorchTrainEngine(tiny_qwen2(seed=0), PAD, optim)
    layout = _layout(engine.module)
    assert len({s for s, _ in layout}) == 1

    plain = tiny_qwen2(seed=0)
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    plain_engine = TorchTrainEngine.__new__(TorchTrainEngine)   # only for its batch/forward helpers
    plain_engine.__dict__.update(engine.__dict__, model=plain, module=plain)
    from mindspeed_rl.engines import MicroBatch
    for _ in range(2):
        mb = MicroBatch({"prompts": prompts, "responses": responses}, 1.0, last=True)
        engine.train_step([mb], nll_loss_fn)
        loss, _ = nll_loss_fn(plain_engine.model_output(plain_engine.batch(prompts, responses)), mb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len({s for s, _ in _layout(plain)}) > 1   # the reference really is unflattened
    for (n, a), (_, b) in zip(engine.module.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(engine.module.model.embed_tokens.weight, tiny_qwen2(seed=0).model.embed_tokens.weight)
    assert _layout(engine.module) == layout
