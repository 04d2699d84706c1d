"""The torch and FSDP train engines holding a reward model (model_kind "reward"): scores at the last
response token whatever the padding, equal to HF's own pooled output where it finds the same token, and
training on preference pairs with the Bradley-Terry loss."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.algorithms import bradley_terry_loss, preference_accuracy
from mindspeed_rl.engines import MicroBatch, OptimConfig
from mindspeed_rl.engines.base import TrainSpec
from mindspeed_rl.engines.train.fsdp_train import FSDPTrainEngine
from mindspeed_rl.engines.train.torch_train import TorchTrainEngine

from ._common import PAD, random_rows, tiny_qwen2


def tiny_rm(seed: int = 0):
    """The tiny Qwen2 backbone with a seeded one-label head (not a zero one: scores must differ)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    lm = tiny_qwen2(seed=seed, initializer_range=0.1)
    base = {k: v for k, v in lm.config.to_dict().items() if k not in ("id2label", "label2id")}
    cfg = Qwen2Config(**{**base, "num_labels": 1, "pad_token_id": PAD})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        rm = Qwen2ForSequenceClassification(cfg)
        torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.model.load_state_dict(lm.model.state_dict())
    return rm.float().eval()


@pytest.fixture(scope="module")
def rows():
    prompts = random_rows(5, [3, 1, 4, 2, 3], seed=1, low=3)      # no pad, bos or eos inside
    responses = random_rows(5, [2, 4, 1, 3, 2], seed=2, low=3)
    return prompts, responses


def test_score_is_the_head_at_the_last_response_token_with_any_padding(rows):
    prompts, responses = rows
    engine = TorchTrainEngine(tiny_rm(), PAD, model_kind="reward")
    batched = engine.scores(prompts, responses, micro_batch_size=5)   # prompts left-, responses right-padded
    alone = [engine.scores([p], [r], micro_batch_size=1)[0] for p, r in zip(prompts, responses)]  # no padding
    assert all(s.shape == (1,) and s.dtype == torch.float32 for s in batched)
    assert torch.allclose(torch.cat(batched), torch.cat(alone), atol=1e-5)
    assert torch.cat(batched).std() > 1e-3   # the rows score differently: the test can tell them apart
    model = tiny_rm()
    for p, r, s in zip(prompts, responses, batched):
        # HF's own pooling over the unpadded sequence: the head at its last token
        full = torch.cat([p, r]).unsqueeze(0)
        with torch.no_grad():
            assert model(full).logits.reshape(1) == pytest.approx(s, abs=1e-5)
    # all-right-padded rows (a prompt's padding after it as well) score the same: the mask decides
    right = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    empty = [torch.zeros(0, dtype=torch.long)] * len(right)
    assert torch.allclose(torch.cat(engine.scores(right, empty, 5)), torch.cat(batched), atol=1e-5)


def test_a_pad_token_inside_a_response_does_not_move_the_score(rows):
    """HF pools at the last token that is not the pad id; the engine at the last real one."""
    prompts, responses = rows
    engine = TorchTrainEngine(tiny_rm(), PAD, model_kind="reward")
    r = torch.cat([responses[0], torch.tensor([PAD])])   # the policy may sample the pad token
    mine = engine.scores([prompts[0], prompts[1]], [r, responses[1]], 2)[0]
    alone = engine.scores([prompts[0]], [r], 1)[0]
    assert torch.allclose(mine, alone, atol=1e-5)


def pairs_micro_batch(prompts, chosen, rejected, scale=1.0, last=True):
    return MicroBatch({"prompts": prompts, "chosen": chosen, "rejected": rejected}, scale, last=last)


def bt_loss(out, mb):
    n = len(mb.data["prompts"])
    c, r = out.scores[:n], out.scores[n:]
    loss = bradley_terry_loss(c, r)
    return loss, {"loss": float(loss.detach()), "accuracy": preference_accuracy(c, r)}


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_training_on_pairs_separates_chosen_from_rejected(backend):
    prompts = random_rows(8, 3, seed=3, low=3)
    chosen = [p.clone() for p in prompts]                       # the right copy
    rejected = [(p + 1 - 3) % 13 + 3 for p in prompts]          # every digit wrong
    if backend == "torch":
        engine = TorchTrainEngine(tiny_rm(), PAD, OptimConfig(lr=3e-3), model_kind="reward")
    else:
        engine = FSDPTrainEngine(tiny_rm(), TrainSpec(model_path="", model_kind="reward", optim=OptimConfig(lr=3e-3)))
    first = None
    for _ in range(30):
        m = engine.train_step([pairs_micro_batch(prompts[:4], chosen[:4], rejected[:4], 0.5, last=False),
                               pairs_micro_batch(prompts[4:], chosen[4:], rejected[4:], 0.5)], bt_loss)
        first = m if first is None else first
    assert m["micro_batches"] == 2 and engine.version == 30
    assert m["loss"] < first["loss"] / 4
    sc = engine.scores(prompts + prompts, chosen + rejected, 16)
    assert preference_accuracy(torch.cat(sc[:8]), torch.cat(sc[8:])) == 1.0


def test_engine_refuses_the_wrong_call():
    engine = TorchTrainEngine(tiny_qwen2(), PAD)
    with pytest.raises(NotImplementedError, match="no reward model"):
        engine.scores([torch.tensor([3])], [torch.tensor([4])], 1)
