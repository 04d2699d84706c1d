"""Tokenize a prompt dataset once, ahead of training: writes the preprocessed JSONL.

    python cli/preprocess_data.py --input data.jsonl --output out.jsonl --tokenizer builtin:tiny-qwen2
    python cli/preprocess_data.py --input gsm8k_train.parquet --output gsm8k.jsonl \\
        --tokenizer /models/Qwen2.5-0.5B-Instruct --prompt-key question --answer-key answer \\
        --chat-template --max-prompt-length 512

Each output line is `{"prompt": ..., "answer": ..., "prompt_ids": [...]}`; `load_prompt_dataset`
recognises the file by `prompt_ids` and the loader skips tokenizing. The answer is kept whole (a
GSM8K solution ending in `#### 42` stays as it is: the `gsm8k` reward reads what follows `####`).
Prompts longer than `--max-prompt-length` keep their last tokens and are counted.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

if importlib.util.find_spec("mindspeed_rl") is None:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from mindspeed_rl.data import SYNTHETIC_KINDS  # noqa: E402 (torch-free)
from mindspeed_rl.data.base import ANSWER, PROMPT, PROMPT_IDS  # noqa: E402 (the record's fields)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help=f"a .jsonl / .json / .parquet file, or builtin:{'|'.join(SYNTHETIC_KINDS)}")
    p.add_argument("--output", required=True, help="the preprocessed .jsonl to write")
    p.add_argument("--tokenizer", required=True,
                   help="builtin:tiny-qwen2 or a local HF checkpoint / tokenizer directory")
    p.add_argument("--prompt-key", default=PROMPT, help="input field with the prompt (dotted for nested)")
    p.add_argument("--answer-key", default=ANSWER, help="input field with the answer (dotted for nested)")
    p.add_argument("--chat-template", action="store_true",
                   help="render each prompt with the tokenizer's chat template")
    p.add_argument("--max-prompt-length", type=int, default=None,
                   help="keep only the last N tokens of longer prompts")
    p.add_argument("--num-digits", type=int, default=3, help="builtin tasks: digits per number")
    p.add_argument("--size", type=int, default=10000, help="builtin tasks: number of records")
    p.add_argument("--seed", type=int, default=0, help="builtin tasks: seed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mindspeed_rl.data import encode_prompts, load_prompt_dataset
    from mindspeed_rl.models import load_tokenizer

    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        raise SystemExit("--max-prompt-length must be a positive integer")
    try:
        dataset = load_prompt_dataset(args.input, prompt_key=args.prompt_key,
                                      answer_key=args.answer_key, num_digits=args.num_digits,
                                      size=args.size, seed=args.seed)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"error: {exc}")
    tokenizer = load_tokenizer(args.tokenizer)
    if args.chat_template and not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: --chat-template given but the tokenizer {args.tokenizer!r} has no "
                         f"chat template")
    records = list(dataset)
    ids, truncated = encode_prompts(tokenizer, [r[PROMPT] for r in records],
                                    apply_chat_template=args.chat_template,
                                    max_prompt_length=args.max_prompt_length)
    empty = [i for i, x in enumerate(ids) if len(x) == 0]
    if empty:
        raise SystemExit(f"error: {len(empty)} prompts tokenize to nothing (first: record {empty[0]}: "
                         f"{records[empty[0]][PROMPT]!r})")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for record, x in zip(records, ids):
            f.write(json.dumps({PROMPT: record[PROMPT], ANSWER: record[ANSWER], PROMPT_IDS: x.tolist()},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    lengths = [len(x) for x in ids]
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    print(f"wrote {out}: rows={len(records)} truncated={truncated} "
          f"mean_prompt_length={mean:.1f} max_prompt_length={max(lengths, default=0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
