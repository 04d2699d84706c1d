"""The reward model's compute functions: scores through re-tokenization for a reward model with a tokenizer of its
own, the combined reward and its per-source metrics, hand-computed."""
from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models import build_char_tokenizer, resolve_model_path
from mindspeed_rl.workers.steps.combine_reward import combine_reward
from mindspeed_rl.workers.steps.reward_model_score import reward_model_score, retokenizer


def _other_tokenizer():
    """The built-in characters in another id order (specials last): the same text, other ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(tuple("=+9876543210") + ("<eos>", "<pad>", "<unk>"))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_combine_reward_sums_by_weight_and_reports_each_source():
    batch = {"model_scores": [torch.tensor([2.0]), torch.tensor([-1.0])],
             "rule_scores": [torch.tensor([1.0]), torch.tensor([0.0])]}
    out = combine_reward(batch, [0, 1], weights={"model": 0.5, "rule": 2.0})
    # row 0: 0.5 x 2 + 2 x 1 = 3; row 1: 0.5 x -1 + 0 = -0.5
    assert [float(x) for x in out.columns["rm_scores"]] == [3.0, -0.5]
    assert out.metrics == {"reward_sum": 2.5, "reward_rows": 2.0, "reward_max_count": 1.0,
                           "model_reward_sum": 1.0, "rule_reward_sum": 1.0}
    alone = combine_reward({"model_scores": batch["model_scores"]}, [0, 1], weights={"model": 1.0, "rule": 0.0})
    assert [float(x) for x in alone.columns["rm_scores"]] == [2.0, -1.0] and "rule_reward_sum" not in alone.metrics


def test_scores_through_the_reward_models_own_tokenizer(tmp_path):
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.models.reward import init_reward_model, save_reward_model
    builtin = str(resolve_model_path("builtin:tiny-qwen2"))
    assert retokenizer(builtin, builtin) is None   # the policy's own tokenizer: its ids are read directly
    other = _other_tokenizer()
    torch.manual_seed(0)
    rm = init_reward_model(builtin, pad_token_id=other.pad_token_id)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    save_reward_model(rm, other, tmp_path / "rm")
    retok = retokenizer(builtin, str(tmp_path / "rm"))
    assert retok is not None
    policy = build_char_tokenizer()
    texts = [("123=", "12<eos>"), ("90=", "905")]
    prompts = [torch.tensor(policy(p, add_special_tokens=False)["input_ids"]) for p, _ in texts]
    responses = [torch.tensor(policy(r, add_special_tokens=False)["input_ids"]) for _, r in texts]
    engine = TorchTrainEngine(rm.eval(), other.pad_token_id, model_kind="reward")
    out = reward_model_score({"prompts": prompts, "responses": responses}, [0, 1], engine=engine, micro_batch_size=2,
                             retokenize=retok)
    # what the reward model reads: the decoded texts (special tokens skipped) in its own ids
    want = engine.scores([torch.tensor(other(p, add_special_tokens=False)["input_ids"]) for p, _ in texts],
                         [torch.tensor(other(r.replace("<eos>", ""), add_special_tokens=False)["input_ids"])
                          for _, r in texts], 2)
    assert [float(x) for x in out.columns["model_scores"]] == pytest.approx([float(x) for x in want])
    assert out.metrics["model_score_rows"] == 2.0
