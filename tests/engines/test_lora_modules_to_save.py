"""LoRA's modules trained whole (`actor_config.lora.modules_to_save`, peft's copies) on the torch engine: what
trains and at which learning rate, what readers and the reference get, checkpoints. Built-in tiny Qwen2."""
import pytest
import torch

from mindspeed_rl.engines.base import MicroBatch, OptimConfig, TrainSpec
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine
from mindspeed_rl.engines.sync.weight_sync import copy_weights
from mindspeed_rl.engines.train.lora import BaseReference, trained_groups
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
from mindspeed_rl.models import load_causal_lm, resolve_model_path

from ._common import PAD, nll_loss_fn, random_rows

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": 0.01,
        "modules_to_save": ["norm"], "modules_to_save_lr": 0.05}


@pytest.fixture(scope="module")
def path() -> str:
    return str(resolve_model_path("builtin:tiny-qwen2"))


def engine_of(path: str, lora: dict = LORA) -> TorchTrainEngine:
    return TorchTrainEngine.build(TrainSpec(model_path=path, pad_token_id=PAD, optim=OptimConfig(lr=1e-4),
                                            lora=lora))


def rows(seed: int = 3):
    return random_rows(6, [3, 4, 5, 2, 6, 3], seed), random_rows(6, [4, 2, 5, 3, 4, 1], seed + 1)


def step(engine, prompts, responses) -> dict:
    return engine.train_step(iter([MicroBatch({"prompts": prompts, "responses": responses}, 1.0, True)]),
                             nll_loss_fn)


def norm_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("norm.weight")}


def test_norm_copies_train_at_their_own_lr_and_readers_get_them(path):
    """Every RMSNorm gets a trained copy in the optimizer's second group at modules_to_save_lr; the base's
    norms (the reference's) stay the checkpoint's; an hf reader synced from the export gets the trained
    norms under their HF names and computes the trainer's log-probs."""
    engine = engine_of(path)
    plain = TorchTrainEngine(load_causal_lm(path), PAD)
    adapters, whole = engine.optimizer.param_groups
    assert adapters["lr"] == LORA["lr"] and whole["lr"] == LORA["modules_to_save_lr"]
    copies = [n for n, p in engine.module.named_parameters() if p.requires_grad and ".modules_to_save." in n]
    assert len(copies) == len(norm_weights(plain.model)) == len(whole["params"]) == 5   # 2 layers x 2 + final
    base = plain.state_checksum()
    prompts, responses = rows()
    for _ in range(3):
        step(engine, prompts, responses)
    ref = BaseReference(engine)
    assert ref.state_checksum() == base != engine.state_checksum()
    assert max(float((a - b).abs().max()) for a, b in
               zip(ref.log_probs(prompts, responses, 4), plain.log_probs(prompts, responses, 4))) == 0.0
    names = [n for b in engine.export_weights(1 << 20) for n, _ in b]
    assert names == [n for n, _ in load_causal_lm(path).named_parameters(remove_duplicate=False)]
    reader = HFRolloutEngine(load_causal_lm(path), PAD)
    copy_weights(iter(engine.export_weights(8 << 10)), [reader], version=3)
    trained = norm_weights(reader.model)
    assert any(not torch.equal(trained[n], w) for n, w in norm_weights(plain.model).items())
    synced = TorchTrainEngine(reader.model, PAD)
    assert max(float((a - b).abs().max()) for a, b in
               zip(synced.log_probs(prompts, responses, 4), engine.log_probs(prompts, responses, 4))) < 1e-5


def test_checkpoint_holds_the_norm_copies_with_the_adapters(path, tmp_path):
    engine = engine_of(path)
    prompts, responses = rows()
    step(engine, prompts, responses)
    engine.save_checkpoint(str(tmp_path))
    other = engine_of(path)
    other.load_checkpoint(str(tmp_path))
    assert other.state_checksum() == engine.state_checksum()
    assert step(other, prompts, responses)["nll"] == step(engine, prompts, responses)["nll"]


def test_groups_without_lora_or_copies():
    """No LoRA: one group at the actor's lr; LoRA without copies: the adapters alone at lora.lr (or the
    actor's); copies without their own lr take the adapters'."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert [g["lr"] for g in trained_groups(model, None, 0.1)] == [0.1]
    assert [g["lr"] for g in trained_groups(model, {"lr": None}, 0.1)] == [0.1]
    assert [g["lr"] for g in trained_groups(model, {"lr": 0.3}, 0.1)] == [0.3]


def test_a_name_takes_every_module_ending_with_it_whatever_peft_matches(path):
    """`norm` takes the layers' `input_layernorm` too, as the configs' comments say, with a peft that matches
    only whole dotted parts (0.22) as with one that matches plain suffixes; a name taking nothing is refused."""
    from mindspeed_rl.engines.train.lora import modules_to_save_names
    model = load_causal_lm(path)
    assert modules_to_save_names(model, ["norm"]) == [n for n, _ in model.named_modules() if n.endswith("norm")]
    assert len(modules_to_save_names(model, ["norm"])) == 5
    with pytest.raises(ValueError, match=r"modules_to_save=\['normal'\]: \['normal'\] match no module"):
        modules_to_save_names(model, ["normal"])
