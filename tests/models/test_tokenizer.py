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


def test_the_tool_tokenizer_adds_the_call_markers_and_keeps_every_other_id():
    """builtin:tiny-qwen2-tool's tokenizer: the base vocabulary with the same ids, plus the `tags`
    markers of the calc tool, one token each; builtin:tiny-qwen2 (and its cached checkpoint) are unchanged."""
    from mindspeed_rl.models.checkpoint import builtin_fingerprint
    from mindspeed_rl.models.tokenizer import TOOL_TOKENS
    base, tool = build_char_tokenizer(), build_char_tokenizer(TOOL_TOKENS)
    assert len(base) == 16 and len(tool) == 20
    text = "1234+5678="
    assert tool.encode(text, add_special_tokens=False) == base.encode(text, add_special_tokens=False)
    call = "<calc>1234+5678</calc><result>6912</result>6912"
    ids = tool.encode(call, add_special_tokens=False)
    assert ids[0] == 16 and ids[10] == 17 and ids[11] == 18 and ids[16] == 19 and len(ids) == 21
    assert tool.decode(ids + [tool.eos_token_id], skip_special_tokens=True) == call
    import hashlib
    from mindspeed_rl.models import checkpoint as ckpt
    from mindspeed_rl.models.tokenizer import CHARACTERS, SPECIAL_TOKENS
    h = hashlib.sha256((ckpt._CONFIG_DIR / "config.json").read_bytes())  # the formula before the tool model
    h.update(repr((CHARACTERS, SPECIAL_TOKENS, ckpt.TINY_SEED)).encode())
    assert builtin_fingerprint("tiny-qwen2") == h.hexdigest()[:10], "the default model's cached checkpoint changed"
    assert builtin_fingerprint("tiny-qwen2-tool") != builtin_fingerprint("tiny-qwen2")
