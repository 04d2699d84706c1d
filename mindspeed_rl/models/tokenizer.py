"""The character-level tokenizer of the built-in tiny model.

A real HF tokenizer (saved as `tokenizer.json`, loaded with `AutoTokenizer`) so the tiny default
goes through exactly the code path of a downloaded checkpoint; one token per character over a
16-token vocabulary (digits, `=`, `+`, and the specials) keeps an 84k-parameter model's random
start close to the task: measured, a 100-token vocabulary needs far more RL steps to find digits.
Any other character maps to `<unk>`; the tiny model is for the built-in synthetic tasks, real
data comes with a real model's tokenizer.
"""
from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789=+"
# the tool model's extra tokens (builtin:tiny-qwen2-tool): the `tags` call syntax of the calc tool
# (mindspeed_rl/agent/syntax.py), each one token, so a call is `<calc>1234+5678</calc>` in 11 tokens
TOOL_TOKENS = ("<calc>", "</calc>", "<result>", "</result>")
# builtin:tiny-qwen2-lookup's: the `tags` syntax of the lookup tool, the same ids as the calc model's
LOOKUP_TOKENS = ("<lookup>", "</lookup>", "<result>", "</result>")


def build_char_tokenizer(extra_tokens: tuple[str, ...] = ()):
    """Build the tokenizer: ids 0..3 are pad, bos, eos, unk; then one id per character of CHARACTERS;
    then one per extra token (matched whole, before the text is split into characters)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS) + tuple(extra_tokens))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    if extra_tokens:
        core.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")
