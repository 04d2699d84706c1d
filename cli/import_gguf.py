"""A GGUF model as a Hugging Face checkpoint: `python cli/import_gguf.py <file.gguf> <out_dir>`.

The same conversion `model_path: <file.gguf>` does into the cache on first use (models/gguf.py): transformers'
GGUF loader dequantizes the tensors, the weights are saved as float32 safetensors beside the tokenizer files
and the chat template, so the directory loads anywhere without the gguf package. A file that is missing,
truncated, not GGUF, or of an architecture transformers cannot load exits 2 with one line.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="import_gguf.py", description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the directory to write the Hugging Face checkpoint to (must not exist, or be empty)")
    args = p.parse_args(argv)
    from mindspeed_rl.models.gguf import convert
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"import error: {args.out} exists and is not empty; give a new directory", file=sys.stderr)
        return 2
    try:
        out = convert(args.gguf, args.out)
    except ValueError as e:
        if os.path.isdir(args.out) and not os.listdir(args.out):   # leave no empty directory behind
            shutil.rmtree(args.out, ignore_errors=True)
        print(f"import error: {e}", file=sys.stderr)
        return 2
    print(f"Hugging Face checkpoint: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
