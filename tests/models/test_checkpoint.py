"""The built-in tiny Qwen2: created once as a real HF checkpoint, deterministic, fingerprinted."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_rl.models import check_model_path, is_builtin, load_causal_lm, resolve_model_path
from mindspeed_rl.models import checkpoint as ckpt
from mindspeed_rl.models import tokenizer as tokmod

BUILTIN = "builtin:tiny-qwen2"


def test_cache_dir_follows_the_environment(cache_env, monkeypatch):
    assert ckpt.cache_dir() == cache_env
    monkeypatch.delenv("MINDSPEED_RL_CACHE")
    assert ckpt.cache_dir().parts[-2:] == (".cache", "mindspeed_rl")


def test_builtin_is_created_once_as_a_real_hf_checkpoint(cache_env, builtin_dir):
    path = resolve_model_path(BUILTIN)
    assert path == builtin_dir == cache_env / f"tiny-qwen2-{ckpt.builtin_fingerprint()}"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    stamp = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in path.iterdir()}
    again = resolve_model_path(BUILTIN)  # found, not rebuilt
    assert again == path
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in again.iterdir()} == stamp
    assert not [p.name for p in cache_env.iterdir() if p.name.startswith(".")]  # no temporary dir left behind
    model = load_causal_lm(BUILTIN)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in path.iterdir()} == stamp


def test_an_incomplete_cached_checkpoint_is_rebuilt(cache_env, builtin_dir):
    """A cache directory that lost its weights and config (seen once under many workers) is rebuilt,
    not loaded or left broken."""
    path = resolve_model_path(BUILTIN)
    want = load_file(str(path / "model.safetensors"))
    for name in ("config.json", "model.safetensors"):
        (path / name).unlink()
    assert resolve_model_path(BUILTIN) == path
    got = load_file(str(path / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (path / "config.json").is_file()
    assert not [p.name for p in cache_env.iterdir() if p.name.startswith(".")]  # no lock or stale copy left


def test_loads_with_the_auto_classes(builtin_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = json.loads((ckpt._CONFIG_DIR / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(builtin_dir))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = AutoConfig.from_pretrained(str(builtin_dir))
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(cfg, key) == spec[key], key
    assert sum(p.numel() for p in model.parameters()) < 100_000  # tiny
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as configured
    tok = AutoTokenizer.from_pretrained(str(builtin_dir))
    assert len(tok) == spec["vocab_size"] == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (spec["pad_token_id"], spec["bos_token_id"],
                                                                       spec["eos_token_id"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("12+34=")])).logits
    assert logits.shape == (1, 6, 16) and torch.isfinite(logits).all()


def test_load_causal_lm_dtype(builtin_dir):
    model = load_causal_lm(str(builtin_dir), dtype="bfloat16")  # a plain local path works as well
    assert next(model.parameters()).dtype == torch.bfloat16


def test_same_weights_on_every_creation(tmp_path, builtin_dir):
    a = ckpt.save_tiny_checkpoint(tmp_path / "a")
    torch.manual_seed(0)
    x = torch.rand(4)
    torch.manual_seed(0)
    b = ckpt.save_tiny_checkpoint(tmp_path / "b")
    assert torch.equal(torch.rand(4), x)  # creation leaves the global RNG alone
    sa, sb, sc = (load_file(str(d / "model.safetensors")) for d in (a, b, builtin_dir))
    assert sa.keys() == sb.keys() == sc.keys() and len(sa) > 5
    for k in sa:
        assert torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]), k
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_fingerprint_is_stable_and_follows_config_vocab_and_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_RL_CACHE", str(tmp_path / "cache"))
    fp = ckpt.builtin_fingerprint()
    assert fp == ckpt.builtin_fingerprint() and len(fp) == 10
    cfg_dir = tmp_path / "tiny_qwen2"
    shutil.copytree(ckpt._CONFIG_DIR, cfg_dir)
    monkeypatch.setattr(ckpt, "_CONFIG_DIR", cfg_dir)
    assert ckpt.builtin_fingerprint() == fp  # same bytes, same fingerprint
    original = (cfg_dir / "config.json").read_bytes()
    (cfg_dir / "config.json").write_text(json.dumps({**json.loads(original), "hidden_size": 32}))
    changed = ckpt.builtin_fingerprint()
    assert changed != fp
    # a changed config resolves to another cache directory (the old checkpoint is never reused)
    target = resolve_model_path(BUILTIN)
    assert target.name == f"tiny-qwen2-{changed}"
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(str(target)).hidden_size == 32
    (cfg_dir / "config.json").write_bytes(original)
    assert ckpt.builtin_fingerprint() == fp
    monkeypatch.setattr(ckpt, "TINY_SEED", ckpt.TINY_SEED + 1)
    assert ckpt.builtin_fingerprint() != fp
    monkeypatch.setattr(ckpt, "TINY_SEED", ckpt.TINY_SEED - 1)
    monkeypatch.setattr(tokmod, "CHARACTERS", tokmod.CHARACTERS + "-")
    assert ckpt.builtin_fingerprint() != fp


def test_is_builtin():
    assert is_builtin(BUILTIN) and is_builtin("builtin:other")
    assert not is_builtin("/models/tiny-qwen2") and not is_builtin("tiny-qwen2")


@pytest.mark.parametrize("path", ["", None])
def test_check_model_path_empty(path):
    with pytest.raises(ValueError) as e:
        check_model_path("actor_config.model_path", path)
    msg = str(e.value)
    assert "actor_config.model_path is empty" in msg and "builtin:tiny-qwen2" in msg


def test_check_model_path_unknown_builtin():
    with pytest.raises(ValueError) as e:
        check_model_path("ref_config.model_path", "builtin:tiny-llama")
    msg = str(e.value)
    assert msg.startswith("ref_config.model_path='builtin:tiny-llama'")
    assert "unknown built-in model 'tiny-llama'" in msg and "builtin:tiny-qwen2" in msg


def test_check_model_path_directory_without_config(tmp_path):
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ValueError) as e:
            check_model_path("actor_config.model_path", str(path))
        msg = str(e.value)
        assert msg.startswith(f"actor_config.model_path={str(path)!r}")
        assert "no config.json" in msg and "builtin:tiny-qwen2" in msg


def test_check_model_path_accepts_builtin_and_checkpoint_dirs(builtin_dir, tmp_path):
    check_model_path("actor_config.model_path", BUILTIN)
    check_model_path("actor_config.model_path", str(builtin_dir))
    (tmp_path / "config.json").write_text("{}")
    check_model_path("actor_config.model_path", str(tmp_path))
    (tmp_path / "config.json").unlink()   # the same directory without its config.json is refused
    with pytest.raises(ValueError, match="actor_config.model_path"):
        check_model_path("actor_config.model_path", str(tmp_path))


def test_resolve_non_builtin_path_is_only_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/ckpt") == tmp_path / "ckpt"
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="unknown built-in model"):
        resolve_model_path("builtin:nope")
