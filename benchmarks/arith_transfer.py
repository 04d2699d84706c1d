"""Does what a policy learned on builtin:arith carry over to phrasings the task never uses? Judged by transformers
alone (no trainer code in the loop): greedy answers to questions in `data/arith.py`'s UNSEEN_TEMPLATES.

    python benchmarks/arith_transfer.py outputs/grpo_smollm2_arith/hf/final [--base builtin:smollm2-135m-instruct] \\
        [--questions 256] [--json out.json]

Each model answers the same questions (seeded), rendered with its tokenizer's chat template, greedy, at most 24 new
tokens, in batches of 32 (left padding); a reply counts as right when `gsm8k_flexible` (its last number) matches.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def accuracy(model_path: str, questions: list[tuple[str, str]], max_new_tokens: int, batch: int = 32) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindspeed_rl.models import resolve_model_path
    from mindspeed_rl.rewards.gsm8k import gsm8k_flexible
    path = str(resolve_model_path(model_path))
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    right = 0
    for i in range(0, len(questions), batch):
        part = questions[i:i + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                 for q, _ in part]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop)
        for (q, answer), row in zip(part, out):
            reply = tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True)
            right += gsm8k_flexible(reply, answer) >= 1.0
    return right / len(questions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a trained policy (an HF checkpoint directory or a model path the trainer takes)")
    ap.add_argument("--base", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--num-digits", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from mindspeed_rl.data import arith
    questions = arith.sample_many(np.random.default_rng(args.seed), args.questions, args.num_digits,
                                  arith.UNSEEN_TEMPLATES)
    result = {"questions": args.questions, "templates": [t for t, _ in arith.UNSEEN_TEMPLATES], "seed": args.seed,
              "base": args.base, "model": args.model,
              "base_accuracy": accuracy(args.base, questions, args.max_new_tokens),
              "model_accuracy": accuracy(args.model, questions, args.max_new_tokens)}
    print(f"unseen phrasings, {args.questions} questions: base {result['base_accuracy']:.3f}, "
          f"trained {result['model_accuracy']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
