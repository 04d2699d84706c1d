"""LoRA through peft on the torch train engine (one process): what trains, what readers get, the reference
with the adapters off, checkpoints, and refused target modules. The built-in tiny Qwen2, real peft."""
import threading

import pytest
import torch

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.train.lora import BaseReference, check_target_modules, check_target_modules_of_config
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.engines.sync.weight_sync import copy_weights
from mindspeed_rl.models import load_causal_lm, resolve_model_path

from ._common import PAD, TINY_CONFIG, nll_loss_fn, random_rows, tiny_qwen2

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": 0.05}
OPTIM = OptimConfig(lr=1e-4)


@pytest.fixture(scope="module")
def path() -> str:
    return str(resolve_model_path("builtin:tiny-qwen2"))


def lora_engine(path: str, lora: dict = LORA, **kw) -> TorchTrainEngine:
    return TorchTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OPTIM, lora=lora, **kw))


def rows(seed: int = 3):
    return random_rows(6, [3, 4, 5, 2, 6, 3], seed), random_rows(6, [4, 2, 5, 3, 4, 1], seed + 1)


def step(engine, prompts, responses) -> dict:
    return engine.train_step(iter([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, True)]),
                             nll_loss_fn)


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_only_adapters_train_and_readers_get_the_merged_weights(path):
    """The optimizer holds the adapters alone at lora.lr; after training, the base (the reference's weights)
    has the checksum of the untouched checkpoint while the export changed; an hf reader synced from the
    export computes the trainer's log-probs (float level), and its checksum is the trainer's."""
    engine = lora_engine(path)
    ref = BaseReference(engine)
    plain = TorchTrainEngine(load_causal_lm(path), PAD)          # the checkpoint, no adapters
    adapters = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert all(p.dtype == torch.float32 for n, p in engine.module.named_parameters() if n in adapters)
    group = engine.optimizer.param_groups[0]
    assert group["lr"] == LORA["lr"] and len(group["params"]) == len(adapters)
    base = plain.state_checksum()
    assert ref.state_checksum() == base == engine.state_checksum()   # B = 0: merged = base at the start
    prompts, responses = rows()
    losses = [step(engine, prompts, responses)["nll"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert ref.state_checksum() == base != engine.state_checksum()
    assert len(engine.optimizer.state) == len(adapters)
    # the reference (adapters off) is the base checkpoint, forward for forward
    assert max_diff(ref.log_probs(prompts, responses, 4), plain.log_probs(prompts, responses, 4)) == 0.0
    # an hf reader gets the merged weights, in small buckets (never the whole model at once)
    reader = HFRolloutEngine(load_causal_lm(path), PAD)
    buckets = list(engine.export_weights(8 << 10))
    assert len(buckets) > 3 and all(sum(t.numel() * t.element_size() for _, t in b) <= 8 << 10 or len(b) == 1
                                    for b in buckets)
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in load_causal_lm(path).named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and not any("lora" in n or "base_layer" in n for n in names)
    copy_weights(iter(buckets), [reader], version=4)
    assert reader.state_checksum() == engine.state_checksum()
    synced = TorchTrainEngine(reader.model, PAD)
    assert max_diff(synced.log_probs(prompts, responses, 4), engine.log_probs(prompts, responses, 4)) < 1e-5


def test_reference_pass_and_policy_forwards_never_overlap(path):
    """The adapters are off model-wide during a reference pass: the policy's log-probs asked for meanwhile in
    another thread wait for its end, and then see the adapters."""
    engine = lora_engine(path)
    prompts, responses = rows(5)
    for _ in range(2):
        step(engine, prompts, responses)
    want = engine.log_probs(prompts, responses, 3)
    got: list = []
    with engine.lora.disabled():
        worker = threading.Thread(target=lambda: got.append(engine.log_probs(prompts, responses, 3)))
        worker.start()
        worker.join(0.3)
        assert worker.is_alive() and not got     # held off while the adapters are off
    worker.join(10)
    assert max_diff(got[0], want) == 0.0


def test_reference_refuses_what_is_not_inference(path):
    ref = BaseReference(lora_engine(path))
    with pytest.raises(RuntimeError, match="never trained, loaded or saved"):
        ref.save_checkpoint("/nonexistent")
    with pytest.raises(ValueError, match="needs a policy engine with adapters"):
        BaseReference(TorchTrainEngine(tiny_qwen2(), PAD, optim=OPTIM))


def test_checkpoint_holds_the_adapters_and_resumes_bit_exactly(path, tmp_path):
    prompts, responses = rows(7)
    a = lora_engine(path)
    for _ in range(2):
        step(a, prompts, responses)
    a.save_checkpoint(str(tmp_path / "ck"))
    saved = torch.load(tmp_path / "ck" / "engine.pt", weights_only=False)
    assert set(saved["model"]) == {n for n, p in a.module.named_parameters() if p.requires_grad}
    b = lora_engine(path)
    b.load_checkpoint(str(tmp_path / "ck"))
    assert b.version == a.version == 2
    ma, mb = step(a, prompts, responses), step(b, prompts, responses)
    assert ma == mb
    ea, eb = ([t for bk in e.export_weights(1 << 20) for _, t in bk] for e in (a, b))
    assert len(ea) == len(eb) and all(torch.equal(x, y) for x, y in zip(ea, eb))
    assert a.state_checksum() == b.state_checksum()
    # a checkpoint of another layout is named, not half-loaded
    other = lora_engine(path, {**LORA, "rank": 2})
    with pytest.raises(RuntimeError, match="does not fit this model.*rank"):
        other.load_checkpoint(str(tmp_path / "ck"))
    full = TorchTrainEngine(load_causal_lm(path), PAD, optim=OPTIM)
    full.save_checkpoint(str(tmp_path / "full"))
    with pytest.raises(RuntimeError, match="does not fit this model.*LoRA layout"):
        lora_engine(path).load_checkpoint(str(tmp_path / "full"))


def test_named_target_modules_take_adapters_only_there(path):
    engine = lora_engine(path, {**LORA, "target_modules": ["q_proj", "v_proj"]})
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in engine.module.named_parameters()
               if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}
    prompts, responses = rows(9)
    step(engine, prompts, responses)
    step(engine, prompts, responses)
    merged = {n: t for bk in engine.export_weights(1 << 20) for n, t in bk}
    base = dict(load_causal_lm(path).named_parameters(remove_duplicate=False))
    changed = {n for n in base if not torch.equal(merged[n], base[n].detach())}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)


@pytest.mark.parametrize("targets, message", [
    (["qproj"], r"\['qproj'\] match no linear layer.*'q_proj'.*'v_proj'"),
    (["q_proj", "attn_out"], r"\['attn_out'\] match no linear layer"),
    (["lm_head"], r"\['lm_head'\] match no linear layer of the model \(the LM head takes none\)"),
    (["all-linear", "q_proj"], "list it alone"),
])
def test_target_modules_that_take_no_adapter_are_refused(targets, message):
    with pytest.raises(ValueError, match=message):
        check_target_modules(tiny_qwen2(), targets)
    # the plan's check reads only the config (the model on the meta device)
    with pytest.raises(ValueError, match=message):
        check_target_modules_of_config(TINY_CONFIG, targets)
