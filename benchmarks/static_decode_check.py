"""The hf engine's static decode against its eager loop on one device: the same tokens, and the speed.

    python benchmarks/static_decode_check.py --device cuda [--model qwen2_5_0_5b|qwen2_5_0_5b_2l|tiny]
        [--rows 64] [--prompt 128] [--new 256]

For each dtype (float32, then bfloat16) it generates the same rows with the eager loop (`cuda_graphs=False`) and
the static one (`cuda_graphs=True`: a CUDA graph per batch and width bucket on CUDA), twice each (the first
static call captures its graphs; the second reuses them), with stop tokens the tokens most rows of a greedy run
produced (a random model's greedy output repeats itself), so rows end at different times and the batch moves
down buckets. It prints one JSON line per dtype: tokens/s of both, the capture call's time, the share of rows
whose tokens are equal (float32: expected 1.0; bfloat16: rows may part after a near-tie, since a bucket's
matmuls may round differently from the eager batch's), the batch and width bucket moves, and
`torch.cuda.set_sync_debug_mode("warn")`'s warnings over a static call beyond its three result copies
(expected 0: the running count is copied without blocking).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_first_run import common_stops  # noqa: E402
from single_device import build_checkpoint, random_rows  # noqa: E402

from mindspeed_rl.engines.base import SamplingParams  # noqa: E402
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine  # noqa: E402
from mindspeed_rl.models import load_causal_lm  # noqa: E402


RESULT_COPIES = 3   # a call's own syncs: its tokens, log-probs and lengths copied to the host once, at the end


def timed(engine: HFRolloutEngine, prompts, params, seeds, device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def check(ckpt: str, dtype: str, a, device: torch.device) -> dict:
    model = load_causal_lm(ckpt, dtype)
    eager = HFRolloutEngine(model, 0, device, cuda_graphs=False)
    static = HFRolloutEngine(eager.model, 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new)
    vocab = model.config.vocab_size
    prompts = random_rows(a.rows, a.prompt, 3, min(vocab, 150000), torch.Generator().manual_seed(0))
    seeds = list(range(a.rows))
    greedy = eager.generate(prompts, SamplingParams(max_new_tokens=a.new, greedy=True), seeds)
    stops = common_stops(greedy)
    params = SamplingParams(max_new_tokens=a.new, temperature=1.0, top_p=0.95, stop_token_ids=stops)
    want, eager_s = timed(eager, prompts, params, seeds, device)
    _, capture_s = timed(static, prompts, params, seeds, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        got, static_s = timed(static, prompts, params, seeds, device)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    [decoder] = [d for free_ in static._decoders._free.values() for d in free_]
    tokens = sum(len(r) for r in want.responses)
    same = sum(torch.equal(x, y) for x, y in zip(want.responses, got.responses)) / a.rows
    return {"dtype": dtype, "rows": a.rows, "prompt": a.prompt, "new": a.new, "tokens": tokens,
            "eager_tok_s": round(tokens / eager_s, 1), "static_tok_s": round(tokens / static_s, 1),
            "static_over_eager": round(eager_s / static_s, 3), "capture_call_s": round(capture_s, 3),
            "rows_equal": same, "bucket_moves": decoder.moves, "width_moves": decoder.widened,
            "sync_warnings_in_loop": max(0, sum("synchroniz" in str(w.message) for w in caught) - RESULT_COPIES)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2_5_0_5b", choices=("qwen2_5_0_5b", "qwen2_5_0_5b_2l", "tiny"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    a = ap.parse_args()
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory() as d:
        ckpt = build_checkpoint(a.model, Path(d))
        for dtype in ("float32", "bfloat16"):
            print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "model": a.model, **check(ckpt, dtype, a, device)}), flush=True)


if __name__ == "__main__":
    main()
