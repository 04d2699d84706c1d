"""Prompt data: datasets (files, preprocessed files, synthetic tasks) and the trainer's loader."""
from .base import PromptDataset, Record
from .loader import (PromptLoader, decode_label, encode_label, encode_prompts, prompt_text,
                     truncate_left, truncation_warning)
from .prompts import (JsonlPromptDataset, ParquetPromptDataset, check_prompt_file, load_prompt_dataset,
                      make_record)
from .synthetic import KINDS as SYNTHETIC_KINDS
from .synthetic import SyntheticPromptDataset, SyntheticTask

__all__ = ["JsonlPromptDataset", "ParquetPromptDataset", "PromptDataset", "PromptLoader", "Record",
           "SYNTHETIC_KINDS", "SyntheticPromptDataset", "SyntheticTask", "check_prompt_file", "decode_label",
           "encode_label", "encode_prompts", "load_prompt_dataset", "make_record", "prompt_text",
           "truncate_left", "truncation_warning"]
