"""Model and tokenizer loading: local HF checkpoints and the built-in tiny Qwen2."""
from .checkpoint import (BUILTIN_PREFIX, cache_dir, check_model_path, is_builtin, load_causal_lm,
                         load_tokenizer, load_value_model, resolve_model_path)
from .tokenizer import build_char_tokenizer

__all__ = ["BUILTIN_PREFIX", "build_char_tokenizer", "cache_dir", "check_model_path", "is_builtin",
           "load_causal_lm", "load_tokenizer", "load_value_model", "resolve_model_path"]
