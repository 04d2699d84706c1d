"""Per-token sampling cost of the rollout engine's sampler against two plain ways to draw a token.

    python benchmarks/rollout_sampling.py                      # table, on cuda if present else cpu
    python benchmarks/rollout_sampling.py --json out.json --rows 64 --vocab 151936

What is timed, one token step for `rows` rows over a `vocab`-wide logits tensor (random logits, std
`--scale`; bfloat16 on an accelerator as a model in bf16 returns them, float32 on the CPU):

* engine: `sampling.sample_next(logits, params, draws[:, t])`, the `hf` and `mesh` engines' sampler:
  counter-based uniforms (computed once per generate call, so outside the step; their cost for a
  whole `--tokens`-token table is reported apart), an inverse-CDF draw, the token's log-prob.
* multinomial: a plain loop's step, `torch.multinomial(torch.softmax(logits.float() / T, -1), 1)`:
  every row in one call, one global generator (rows are not independently seeded), no log-prob.
* multinomial+logp: the same plus the log-prob of the drawn tokens (what the engine also returns).
* per-row generators: the engine's sampler before counter-based draws: log_softmax, the probs
  copied to the host, one `torch.multinomial` per row with that row's own CPU `torch.Generator`.

The methods take turns, `--repeats` rounds after a warm-up round, so a loaded machine slows them
alike; the table gives each one's median and min (ms) and `x multinomial` = multinomial's median /
the method's median (above 1: faster than one batched `torch.multinomial` call).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mindspeed_rl.engines.base import SamplingParams  # noqa: E402
from mindspeed_rl.engines.rollout.sampling import filter_logits, row_uniforms, sample_next  # noqa: E402


def per_row_generators(logits: torch.Tensor, params: SamplingParams, gens: list) -> tuple:
    """The engine's former `sample_next`: one CPU generator per row, a host copy of the probs."""
    logp = torch.log_softmax(filter_logits(logits.float() / params.temperature, params.top_p, params.top_k), -1)
    probs = logp.exp().cpu()
    tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])
    tokens = tokens.to(logits.device)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def multinomial(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits.float() / params.temperature, -1), 1)


def multinomial_logp(logits: torch.Tensor, params: SamplingParams) -> tuple:
    logp = torch.log_softmax(logits.float() / params.temperature, -1)
    tokens = torch.multinomial(logp.exp(), 1)
    return tokens, logp.gather(-1, tokens)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=g) * args.scale).to(device=device, dtype=dtype)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    seeds = list(range(1000, 1000 + args.rows))
    draws = row_uniforms(seeds, args.tokens, device)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    methods = {
        "engine (counter-based, inverse CDF)": lambda: sample_next(logits, params, draws[:, 0]),
        "multinomial (one call)": lambda: multinomial(logits, params),
        "multinomial+logp (one call)": lambda: multinomial_logp(logits, params),
        "per-row generators (former engine)": lambda: per_row_generators(logits, params, gens),
    }
    times = {name: [] for name in methods}
    for r in range(args.repeats + 1):
        for name, fn in methods.items():
            t = timed(fn, device)
            if r:  # round 0 warms up
                times[name].append(t)
    table_cost = [timed(lambda: row_uniforms(seeds, args.tokens, device), device) for _ in range(args.repeats)]
    base = statistics.median(times["multinomial (one call)"])
    rows = [{"method": name, "median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
             "x_multinomial": base / statistics.median(ts)} for name, ts in times.items()]
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "rows": args.rows, "vocab": args.vocab, "logits_dtype": str(dtype),
            "params": vars(params), "repeats": args.repeats, "results": rows,
            "uniform_table_ms": {"tokens": args.tokens, "median_ms": 1e3 * statistics.median(table_cost)}}


def print_table(out: dict) -> None:
    print(f"device {out['device']} ({out['device_name']}, {out['threads']} threads), torch {out['torch']}; "
          f"{out['rows']} rows x {out['vocab']} vocab, {out['logits_dtype']} logits, {out['repeats']} repeats")
    print(f"{'method':40s} {'median ms':>10s} {'min ms':>10s} {'x multinomial':>14s}")
    for r in out["results"]:
        print(f"{r['method']:40s} {r['median_ms']:10.2f} {r['min_ms']:10.2f} {r['x_multinomial']:14.2f}")
    u = out["uniform_table_ms"]
    print(f"(the engine's uniforms for {u['tokens']} tokens, once per generate call: {u['median_ms']:.3f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256, help="response length of the uniforms table")
    ap.add_argument("--scale", type=float, default=3.0, help="std of the random logits")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    out = run(args)
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
