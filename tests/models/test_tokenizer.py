"""The 16-token character tokenizer of the built-in model."""
import pytest

from mindspeed_rl.models import build_char_tokenizer, load_tokenizer
from mindspeed_rl.models.tokenizer import CHARACTERS, SPECIAL_TOKENS


@pytest.fixture(params=["built", "saved", "load_tokenizer"])
def tok(request, builtin_dir, cache_root, monkeypatch):
    if request.param == "built":
        return build_char_tokenizer()
    if request.param == "saved":
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(builtin_dir))
    monkeypatch.setenv("MINDSPEED_RL_CACHE", str(cache_root))
    return load_tokenizer("builtin:tiny-qwen2")


def test_vocabulary_and_special_ids(tok):
    assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert len(tok) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert tok.padding_side == "left"


def test_digits_round_trip(tok):
    assert tok.encode(CHARACTERS) == list(range(4, 16))  # one id per character, no specials added
    for text in ("0", "12+34=46", "9876543210", "7+7=14"):
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    ids = [1] + tok.encode("3+4=7") + [2, 0]
    assert tok.decode(ids, skip_special_tokens=True) == "3+4=7"


def test_batch_padding_is_left(tok):
    enc = tok(["1", "123"], padding=True)
    assert enc["input_ids"] == [[0, 0, 5], [5, 6, 7]]
    assert enc["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_unknown_characters_are_unk(tok):
    assert tok.encode("1a 2") == [5, 3, 3, 6]
