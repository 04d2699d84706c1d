"""Reward models: the one-label-classifier check and its errors, init from a causal LM, save/load as a
plain HF checkpoint, re-tokenization for a reward model with a tokenizer of its own."""
from __future__ import annotations

import json

import pytest
import torch

from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.models.reward import (check_reward_model, init_reward_model, load_reward_model, retokenize,
                                        same_tokenizer, save_reward_model)

KEY = "reward_model.model_path"


@pytest.fixture(scope="module")
def saved_rm(tmp_path_factory, builtin_dir):
    torch.manual_seed(0)
    model = init_reward_model(str(builtin_dir), pad_token_id=0)
    out = tmp_path_factory.mktemp("rm") / "final"
    save_reward_model(model, build_char_tokenizer(), out)
    return out, model


def test_init_from_a_causal_lm_gives_a_one_label_classifier(saved_rm, builtin_dir):
    out, model = saved_rm
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0
    assert model.score.weight.shape == (1, 64)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    check_reward_model(KEY, str(out))          # accepted as a reward model
    # the backbone is the causal LM's
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(str(builtin_dir))
    assert torch.equal(lm.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_saved_reward_model_loads_with_the_same_scores(saved_rm):
    out, model = saved_rm
    again = load_reward_model(str(out))
    ids = torch.tensor([[5, 6, 7, 14, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, again(ids).logits)


def test_shared_storage_parameters_save(tmp_path, builtin_dir):
    from mindspeed_rl.engines.base import flatten_parameters
    model = init_reward_model(str(builtin_dir), pad_token_id=0)
    flatten_parameters(model)   # what a torch engine does to its parameters
    save_reward_model(model, None, tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_errors_name_the_key(tmp_path, builtin_dir):
    with pytest.raises(ValueError, match=rf"{KEY} is empty"):
        check_reward_model(KEY, None)
    with pytest.raises(ValueError, match=rf"{KEY}='{tmp_path}/nope': no HF checkpoint there"):
        check_reward_model(KEY, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=rf"{KEY}='builtin:tiny-qwen2': a built-in model is a causal LM"):
        check_reward_model(KEY, "builtin:tiny-qwen2")
    with pytest.raises(ValueError, match=r"\['Qwen2ForCausalLM'\] is not a sequence classifier"):
        check_reward_model(KEY, str(builtin_dir))
    check_reward_model(KEY, str(builtin_dir), trainable_from_lm=True)   # what reward modeling starts from
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match=rf"{KEY}='{two}': Qwen2ForSequenceClassification with 2 labels"):
        check_reward_model(KEY, str(two))
    with pytest.raises(ValueError, match="with 2 labels"):
        load_reward_model(str(two))


# ------------------------------------------------------------------ re-tokenization
def other_tokenizer(chat_template: bool):
    """A tokenizer that differs from the built-in one: the same characters in another id order (the
    specials last), optionally with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "=+9876543210|ua"   # '|', 'u', 'a' for the template's markers
    specials = ("<eos>", "<pad>")
    vocab = {tok: i for i, tok in enumerate(tuple(chars) + specials + ("<unk>",))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    if chat_template:
        tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}|{{ m['content'] }}|{% endfor %}"
                             "{% if add_generation_prompt %}a|{% endif %}")
    return tok


def test_retokenize_without_a_chat_template():
    policy, rm = build_char_tokenizer(), other_tokenizer(False)
    assert not same_tokenizer(policy, rm) and same_tokenizer(policy, build_char_tokenizer())
    prompts = [torch.tensor(policy("123=", add_special_tokens=False)["input_ids"])]
    responses = [torch.tensor(policy("12<eos>", add_special_tokens=False)["input_ids"])]
    p, r = retokenize(prompts, responses, policy, rm)
    assert rm.decode(p[0].tolist()) == "123=" and rm.decode(r[0].tolist()) == "12"   # <eos> skipped
    assert p[0].tolist() == [rm.convert_tokens_to_ids(c) for c in "123="]
    assert p[0].tolist() != prompts[0].tolist()   # other ids for the same text


def test_retokenize_with_the_reward_models_chat_template():
    policy, rm = build_char_tokenizer(), other_tokenizer(True)
    prompts = [torch.tensor(policy("45=", add_special_tokens=False)["input_ids"])]
    responses = [torch.tensor(policy("45", add_special_tokens=False)["input_ids"])]
    p, r = retokenize(prompts, responses, policy, rm)
    # template: "u|45=|" + generation prompt "a|"; the full rendering adds "a|45|" after the user turn
    assert rm.decode(p[0].tolist()) == "u|45=|a|"
    assert rm.decode(r[0].tolist()) == "45|"
