"""The hf engine's static decode against its eager loop on one device: the same tokens, and the speed.

    python benchmarks/static_decode_check.py --device cuda [--model qwen2_5_0_5b|qwen2_5_0_5b_2l|tiny]
        [--rows 64] [--prompt 128] [--new 256] [--sampling greedy|sampled]

For each dtype (float32, then bfloat16) it generates the same rows with the eager loop (`cuda_graphs=False`) and
the static one (`cuda_graphs=True`: a CUDA graph per batch and width bucket on CUDA), twice for the static one
(the first call captures its graphs; the second reuses them). The stop tokens come from a run of the eager loop
with the same sampling and seeds but no stops: tokens that run's rows produced (`common_stops`), until every row
holds one, so that in the measured run, which takes the same path up to them, rows end at different steps and
the batch moves down its buckets. `--sampling greedy` (the default) decodes greedily; `sampled` draws at
temperature 1.0 and top-p 0.95.

It prints one JSON line per dtype: tokens/s of both loops, the capturing call's time, the batch and width bucket
moves (the check fails without a batch move), `torch.cuda.set_sync_debug_mode("warn")`'s warnings during a
replaying call beyond its three result copies to the host (expected 0: the running count is copied without
blocking), and how the rows compare:

* `rows_equal`: the share of rows with the same tokens.
* `rows_near_tie`: the share that part only at a near-tie, with the log-probs of the tokens before it within
  `LOGP_TOL`. The static step computes the same logits as the eager one in another order (its own decode
  attention, a bucket's matmuls), so they agree to rounding, not bit for bit; where a row's choice at a step is
  decided by less than that rounding the two loops may choose differently, and the rows then go separate ways.
  Greedy: the row's two largest logits within `NEAR_TIE_LOGIT` of the largest's size (bfloat16: two roundings).
  Sampled (inverse-CDF draws): the row's uniform within `NEAR_TIE_MASS` of the probability mass from a boundary
  between two tokens, or the mass before the top-p cutoff within it of top_p. Measured on the eager model's
  logits for that row at that step (one row, no padding). On a random model at temperature 1 the distribution
  over 151,936 tokens is nearly flat (a token holds ~5e-6 of the mass), so boundaries are dense and a few rows
  in a few hundred draws meet one: on the CPU in float32 one row of 8 parted at a draw 7e-8 of the mass from a
  boundary.
* `rows_unexplained`: rows that differ without a near-tie, or whose log-probs before it disagree: the check
  fails on any.
* `max_logp_diff`: the largest log-prob difference over the tokens both loops share (float32: within
  `LOGP_TOL`, or the check fails).

The exit code is 1 when any dtype's check failed.
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
from mindspeed_rl.engines.rollout.sampling import filter_logits, row_uniforms  # noqa: E402
from mindspeed_rl.models import load_causal_lm  # noqa: E402


RESULT_COPIES = 3   # a call's own syncs: its tokens, log-probs and lengths copied to the host once, at the end
# how close a choice must be to count as a near-tie. Greedy: the two largest logits apart by at most this share of
# the largest's size (at least 1): bfloat16 holds 8 significant bits, so 2**-6 is two of its roundings. Sampled:
# the draw this share of the probability mass from a token boundary (or the mass before the top-p cutoff from top_p)
NEAR_TIE_LOGIT = {"float32": 1e-5, "bfloat16": 2.0 ** -6}
NEAR_TIE_MASS = {"float32": 1e-5, "bfloat16": 1e-3}
LOGP_TOL = {"float32": 1e-4, "bfloat16": 5e-2}   # log-probs of the same token from the two loops


def timed(engine: HFRolloutEngine, prompts, params, seeds, device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def sampling(kind: str, new: int, stops: tuple[int, ...] = ()) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_new_tokens=new, greedy=True, stop_token_ids=stops)
    return SamplingParams(max_new_tokens=new, temperature=1.0, top_p=0.95, stop_token_ids=stops)


def tie_margin(model, prompt: torch.Tensor, prefix: torch.Tensor, params: SamplingParams, seed: int, t: int,
               dtype: str) -> tuple[float, bool]:
    """How close the choice at step `t` of this row was, from the eager model's logits after `prompt + prefix`,
    and whether that is a near-tie: greedy, the gap between the two largest logits (against NEAR_TIE_LOGIT of
    the largest's size); sampled, the smallest share of the mass between the row's draw and a token boundary,
    or between the mass before the top-p cutoff and top_p (against NEAR_TIE_MASS)."""
    ids = torch.cat([prompt, prefix]).to(next(model.parameters()).device)[None]
    with torch.no_grad():
        x = model(input_ids=ids).logits[0, -1].float()
    if params.greedy:
        top2 = x.topk(2).values
        gap = float(top2[0] - top2[1])
        return gap, gap <= NEAR_TIE_LOGIT[dtype] * max(1.0, abs(float(top2[0])))
    x = x / params.temperature
    margins = []
    if params.top_p < 1.0:   # a token on the cutoff's edge: in for one loop, out for the other
        p = torch.softmax(x, -1).sort(descending=True).values
        before = p.cumsum(-1) - p
        k = int((before < params.top_p).sum())   # tokens kept
        margins.append(float(params.top_p - before[k - 1]))
        if k < len(before):
            margins.append(float(before[k] - params.top_p))
    f = filter_logits(x[None], params.top_p, params.top_k)[0]
    cdf = (f - f.max()).exp().cumsum(-1)
    total = cdf[-1]
    target = row_uniforms([seed], params.max_new_tokens)[0, t].to(cdf.device) * total
    tok = int(torch.searchsorted(cdf, target.reshape(1), right=True).clamp(max=len(cdf) - 1))
    below = cdf[tok - 1] if tok else torch.zeros((), device=cdf.device)
    margins += [float((target - below) / total), float((cdf[tok] - target) / total)]
    return min(margins), min(margins) <= NEAR_TIE_MASS[dtype]


def compare_rows(model, prompts, seeds, params, want, got, dtype: str) -> dict:
    """rows_equal, rows_near_tie, rows_unexplained, max_logp_diff and each differing row's story."""
    equal = near = 0
    unexplained, parted, worst = [], [], 0.0
    for r, (a, b) in enumerate(zip(want.responses, got.responses)):
        la, lb = want.log_probs[r], got.log_probs[r]
        n = min(len(a), len(b))
        diff = (a[:n] != b[:n]).nonzero()
        t = int(diff[0]) if len(diff) else n
        prefix = float((la[:t] - lb[:t]).abs().max()) if t else 0.0
        worst = max(worst, prefix)
        if t == n and len(a) == len(b):
            equal += 1
            continue
        if t == n:   # one ended (a stop) where the other did not: same tokens up to there, no choice differed
            unexplained.append(r)
            parted.append({"row": r, "step": t, "why": "lengths differ with equal tokens"})
            continue
        margin, close = tie_margin(model, prompts[r], a[:t], params, seeds[r], t, dtype)
        tie = close and prefix <= LOGP_TOL[dtype]
        near += tie
        if not tie:
            unexplained.append(r)
        parted.append({"row": r, "step": t, "tokens": [int(a[t]), int(b[t])], "margin": margin,
                       "prefix_logp_diff": prefix, "near_tie": tie})
    rows = len(want.responses)
    return {"rows_equal": equal / rows, "rows_near_tie": near / rows, "rows_unexplained": len(unexplained),
            "max_logp_diff": worst, "parted": parted}


def check(ckpt: str, dtype: str, a, device: torch.device) -> dict:
    model = load_causal_lm(ckpt, dtype)
    eager = HFRolloutEngine(model, 0, device, cuda_graphs=False)
    static = HFRolloutEngine(eager.model, 0, device, cuda_graphs=True, max_seq_len=a.prompt + a.new)
    vocab = model.config.vocab_size
    prompts = random_rows(a.rows, a.prompt, 3, min(vocab, 150000), torch.Generator().manual_seed(0))
    seeds = list(range(a.rows))
    free = eager.generate(prompts, sampling(a.sampling, a.new), seeds)   # the same path, no stops
    stops = common_stops(free, share=1.0, most=a.rows)   # every row of the free run holds one
    params = sampling(a.sampling, a.new, stops)
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
    rows = compare_rows(eager.model, prompts, seeds, params, want, got, dtype)
    failed = [why for why, bad in (("no batch bucket move", not decoder.moves),
                                   ("rows differ without a near-tie", rows["rows_unexplained"] > 0),
                                   ("log-probs beyond tolerance", dtype == "float32"
                                    and rows["max_logp_diff"] > LOGP_TOL[dtype])) if bad]
    return {"dtype": dtype, "sampling": a.sampling, "rows": a.rows, "prompt": a.prompt, "new": a.new,
            "stops": list(stops), "lengths": sorted({len(r) for r in want.responses}), "tokens": tokens,
            "eager_tok_s": round(tokens / eager_s, 1), "static_tok_s": round(tokens / static_s, 1),
            "static_over_eager": round(eager_s / static_s, 3), "capture_call_s": round(capture_s, 3),
            **rows, "bucket_moves": decoder.moves, "width_moves": decoder.widened,
            "sync_warnings_in_loop": max(0, sum("synchroniz" in str(w.message) for w in caught) - RESULT_COPIES),
            "passed": not failed, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen2_5_0_5b", choices=("qwen2_5_0_5b", "qwen2_5_0_5b_2l", "tiny"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--sampling", default="greedy", choices=("greedy", "sampled"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    ok = True
    with tempfile.TemporaryDirectory() as d:
        ckpt = build_checkpoint(a.model, Path(d))
        for dtype in a.dtypes.split(","):
            rec = check(ckpt, dtype, a, device)
            ok &= rec["passed"]
            print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "model": a.model, **rec}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
