"""The RL step of the Qwen2.5-0.5B architecture on ONE device: each engine beside a plain baseline in the
same process, then the whole trainer for a few steps.

    python benchmarks/single_device.py --json out.json              # on a GPU: the issue's full sizes
    python benchmarks/single_device.py                              # on the CPU: the tiny model, small sizes
    python benchmarks/single_device.py --model tiny --skip-e2e      # smallest

The model: `mindspeed_rl/models/configs/qwen2_5_0_5b.json` with random weights (seed 0), saved with
`save_pretrained` to a temporary directory, the built-in tiny model's tokenizer files copied next to it
(its character ids are valid ids of the 151,936-token vocabulary; docs/performance.md). `--model
qwen2_5_0_5b_2l` is the same config with 2 decoder layers (the full vocabulary); `--model tiny` is the
built-in tiny Qwen2 (the CPU default: the 2-layer model's 136M-entry head made a CPU run take minutes).

What is timed, on `--device` (cuda when there is one, else cpu), every part after one unmeasured
warm-up at the measured sizes (a compile or a graph capture happens there, at the shapes it is timed at),
the median of `--repeats`:

* rollout: the `hf` engine (`make_rollout_engine("hf", ...)`, the model in `--dtype`) generating
  `--new-tokens` for `--rows` prompts of `--prompt-len` random ids, no stop token (every row runs to
  the end), down both of its paths: `engine`, the eager decode (RolloutSpec.cuda_graphs=False), and
  `engine_static`, the fixed-shape decode (cuda_graphs=True, its buffers sized by RolloutSpec.max_seq_len;
  replayed as CUDA graphs on CUDA, run eagerly elsewhere). `generate_config.cuda_graphs` left at null
  runs `engine_static` on CUDA and `engine` elsewhere (`default_engine` in the JSON). Against, on the eager
  engine's module (same weights): HF `generate(do_sample=True)` with its dynamic cache (`hf_generate`);
  HF `generate` with `cache_implementation="static"` (`hf_generate_static`), whose decode step transformers
  compiles itself on CUDA (`torch.compile(mode="reduce-overhead")`, `CompileConfig`'s defaults; skipped on
  the CPU with the reason printed, compiling there takes minutes, unless `--static-generate`, which
  compiles it on the CPU too); a plain loop (DynamicCache, all rows sampled in one `torch.multinomial`
  call, the sampled tokens' log-probs gathered as the engine returns them). Rounds alternate the cases.
  tokens/s = rows x new tokens / time.
* train step: the `fsdp` (single rank, no process group) and `torch` engines through `train_step`
  with a token-mean NLL loss, `--train-rows` rows of `--train-prompt-len` + `--train-response-len`
  tokens in micro-batches of `--micro-batch`, AdamW; against the plain loop a careful user writes
  (`PlainTrainer`): float32 master weights, forward under `torch.autocast(bfloat16)` on CUDA (float32, no
  autocast, on the CPU), the LM head on the response positions only (`logits_to_keep=R + 1`, the first R
  kept: the engines' FSDP path does the same), the log-probs by `F.cross_entropy` (a fused log-softmax and
  gather), `clip_grad_norm_`, `torch.optim.AdamW(fused=True)` on CUDA (`foreach=True` elsewhere).
  The log-softmax stays in float32 under autocast (autocast runs `cross_entropy` in fp32): over 151,936
  tokens bf16's 8-bit mantissa puts a log-prob near -10 on a 0.06-nat grid, which an importance ratio
  exp(new - old) would read as a 6 % change; the engines' log-softmax is float32 too, so both sides do the
  same work. The head's matmul is in the compute dtype on both sides.
  tokens/s = rows x (prompt + response) / step time.
* log-prob pass: each train engine's `log_probs` (the old log-prob stage) over the same rows in
  micro-batches of `--logprob-micro-batch`, against the plain model's no-grad forward (same autocast,
  same head on response positions, same fp32 log-softmax).
* MFU counts the FLOPs the step needs (`needed_flops`): 2 x backbone params x (prompt + response) tokens
  for the decoder (backbone params: every parameter but the embedding table and the LM head, whose lookup
  and matmul are counted apart), plus 2 x hidden x vocab per response token for the head, which no one
  needs on prompt positions; x3 with the backward (train step), x1 forward only (log-prob pass). Attention's
  score and value matmuls (2 x 2 x layers x hidden x context per token) are left out, as in 6ND; over the
  device's stated peak (H100/H200 SXM: 989 TFLOP/s bf16 dense; none on the CPU unless `--peak-tflops`).
  Every side of a comparison is divided by the same count, so a baseline that computes the head on
  prompt positions too gets no credit for it.
* weight sync, in one process: `export_weights(512 MiB)` of each train engine into the rollout
  engine's `update_weights`, against `rollout_model.load_state_dict(plain_model.state_dict())`.
  GB/s = the rollout model's bytes / time.
* memory: per part, `torch.cuda.max_memory_allocated` since the part began (each engine is built,
  measured and dropped in turn; the rollout engine stays); on the CPU the peak RSS of the part
  (VmHWM, reset through /proc/self/clear_refs) and, overall, `ru_maxrss`.

Model features: `--gradient-checkpointing` and `--lora RANK` (LoRA on every linear layer) build every
train engine with them (TrainSpec.gradient_checkpointing, TrainSpec.lora) and pass them to the end-to-end
run (actor_config.gradient_checkpointing, actor_config.lora.rank).

The memory plan against measurement (`--memory`; `--memory-only` runs nothing else): the torch engine and
the hf rollout engine built with those features, each figure the memory plan's term for these sizes
(planning/memory.py, the same functions) beside the measured bytes: on the CPU the RSS (VmRSS) and its peak
(VmHWM, reset through /proc/self/clear_refs; glibc's malloc is told to return every block of 64 KiB or more
to the system, so a freed tensor leaves the RSS), on a GPU torch.cuda.memory_allocated and its peak. Parts:
the train engine's weights (resident after the build), the AdamW state (resident growth over the first
step), the activations a micro-batch keeps for its backward (the RSS when the loss is computed, the graph
alive, over the step's start), the train step's peak over the resident state (grads and activations and
logits, or the optimizer step's temporaries), the log-prob pass's peak, the rollout engine's weights and
its generate call's peak (KV cache, prefill, a step's logits). docs/fitting.md has the table.

    python benchmarks/single_device.py --device cpu --model qwen2_5_0_5b_2l --memory-only [--gradient-checkpointing] [--lora 64]

End to end (`--skip-e2e` leaves it out): `cli/train_grpo.py --config-name grpo_qwen25_0p5b_1gpu` in a
subprocess (its own Ray), with `generate_config.backend=hf`, the fsdp actor and reference colocated in
one worker on the device, the rule stages in another, `--e2e-prompts` x `--e2e-samples` rows,
`--e2e-new-tokens` (no stop token), the built-in copy task with the `digits` reward, `--e2e-steps`
steps. From its metrics.jsonl, over the steps after the first (all steps when only one ran):
tokens/s per device as the driver counts them (`throughput/tokens_per_s`: prompt + response tokens of
the step / step time, the same as verl's perf/throughput on one device) and response tokens only; the
per-stage split (`timing/<stage>`: first start to last end, stages overlap; `busy/<stage>`: compute);
train MFU over `busy/actor_train` (`needed_flops` with the backward, over the step's prompt + response and
response tokens); peak memory: the device's
used memory (all processes, sampled every 0.2 s through `torch.cuda.mem_get_info`) on a GPU, the RSS of
the trainer's process tree (sampled) on the CPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mindspeed_rl.data.base import ANSWER, PROMPT  # noqa: E402
from mindspeed_rl.engines import MicroBatch, OptimConfig, RolloutSpec, SamplingParams, TrainSpec  # noqa: E402
from mindspeed_rl.engines.registry import make_rollout_engine, make_train_engine  # noqa: E402

CONFIG_05B = REPO / "mindspeed_rl" / "models" / "configs" / "qwen2_5_0_5b.json"
MODELS = ("qwen2_5_0_5b", "qwen2_5_0_5b_2l", "tiny")
BUCKET_BYTES = 512 << 20
# stated dense bf16 peaks (TFLOP/s) by device name; None: no MFU
PEAKS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0), ("A100", 312.0))

GPU_DEFAULTS = dict(model="qwen2_5_0_5b", rows=64, new_tokens=128, prompt_len=128, train_rows=64,
                    train_prompt_len=128, train_response_len=256, micro_batch=8, logprob_micro_batch=32,
                    repeats=3, e2e_prompts=8, e2e_samples=8, e2e_new_tokens=128, e2e_steps=3, e2e_timeout=420,
                    rollout_budget=90, budget=540)
CPU_DEFAULTS = dict(model="tiny", rows=8, new_tokens=16, prompt_len=16, train_rows=8,
                    train_prompt_len=16, train_response_len=32, micro_batch=4, logprob_micro_batch=8,
                    repeats=2, e2e_prompts=2, e2e_samples=4, e2e_new_tokens=16, e2e_steps=2, e2e_timeout=300,
                    rollout_budget=60, budget=900)


# ---------------------------------------------------------------------------- helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, object]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak memory of a part: CUDA max_memory_allocated since `reset`, else peak RSS (VmHWM) since it."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")          # VmHWM := current RSS (Linux)
        except OSError:
            pass

    def current_gb(self) -> float:
        """What is held now: memory_allocated on CUDA, the RSS (VmRSS) on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 1e9
        return _status_kb("VmRSS") * 1024 / 1e9

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        try:
            return _status_kb("VmHWM") * 1024 / 1e9
        except OSError:
            return ru_maxrss_gb()


def ru_maxrss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9   # KiB on Linux


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "cpu: no stated peak, no MFU"
    name = torch.cuda.get_device_name(device)
    for key, tf in PEAKS:
        if key in name:
            return tf, f"{name}: {tf:g} TFLOP/s bf16 dense (stated)"
    return None, f"{name}: peak unknown (give --peak-tflops)"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())   # tied weights once


def backbone_params(params: int, hidden: int, vocab: int, tied: bool) -> int:
    """The parameters a token's decoder pass multiplies by: all but the embedding table (a lookup, no FLOPs)
    and the LM head (counted per response token by `needed_flops`); tied, the two are one table."""
    return params - hidden * vocab * (1 if tied else 2)


def needed_flops(backbone: int, hidden: int, vocab: int, tokens: int, response_tokens: int,
                 backward: bool) -> float:
    """The FLOPs a train step (`backward`) or a log-prob pass needs: the decoder on every token (prompt and
    response: the responses attend to the prompts), the LM head only where a response token is predicted.
    2 FLOPs per multiply-add; the backward is twice the forward. MFU divides this, the same for every side of
    a comparison, so work a baseline does beyond it (the head on prompt positions) counts as time only."""
    passes = 3 if backward else 1
    return 2.0 * passes * (backbone * tokens + hidden * vocab * response_tokens)


FLOPS_HOW = ("2 x backbone params x (prompt + response) tokens + 2 x hidden x vocab x response tokens, x3 with "
             "the backward; attention's score and value matmuls not counted")


def head_dims(model: torch.nn.Module) -> dict:
    """The model's sizes for `needed_flops`: parameters (tied weights once), hidden, vocabulary, tied head."""
    vocab, hidden = model.get_input_embeddings().weight.shape
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    params = count_params(model)
    return {"params": params, "hidden": int(hidden), "vocab": int(vocab), "tied": tied,
            "backbone_params": backbone_params(params, int(hidden), int(vocab), tied)}


# ---------------------------------------------------------------------------- the model

def build_checkpoint(model: str, directory: Path) -> str:
    """A checkpoint directory (or the built-in name) for `model`."""
    if model == "tiny":
        return "builtin:tiny-qwen2"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mindspeed_rl.models import resolve_model_path
    cfg = json.loads(CONFIG_05B.read_text())
    if model == "qwen2_5_0_5b_2l":
        cfg.update(num_hidden_layers=2, max_window_layers=2)
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    config = Qwen2Config(**cfg)
    torch.manual_seed(0)
    with torch.device("cpu"):
        m = Qwen2ForCausalLM(config)   # random init, float32
    m.save_pretrained(directory, safe_serialization=True)
    del m
    tiny = resolve_model_path("builtin:tiny-qwen2")
    for f in tiny.iterdir():   # the character tokenizer: its ids are valid in the 151,936-token vocabulary
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, directory / f.name)
    return str(directory)


def random_rows(n: int, length: int, low: int, high: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(low, high, (length,), generator=gen) for _ in range(n)]


# ---------------------------------------------------------------------------- rollout

def left_pad(prompts, pad: int, device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        attn[i, width - len(p):] = 1
    return ids.to(device), attn.to(device)


@torch.no_grad()
def sampling_loop(model, prompts, pad: int, new_tokens: int, device, gen: torch.Generator) -> torch.Tensor:
    """The plain baseline: a DynamicCache, all rows sampled in one torch.multinomial call per token,
    the sampled tokens' log-probs gathered (what an RL rollout returns)."""
    from transformers import DynamicCache
    ids, attn = left_pad(prompts, pad, device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=DynamicCache(), use_cache=True)
    last = pos[:, -1:]
    ones = torch.ones((ids.shape[0], 1), dtype=attn.dtype, device=device)
    tokens, logps = [], []
    for t in range(new_tokens):
        logp = torch.log_softmax(out.logits[:, -1, :].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        tokens.append(nxt)
        logps.append(logp.gather(-1, nxt))
        if t + 1 == new_tokens:
            break
        attn = torch.cat([attn, ones], 1)
        last = last + 1
        out = model(input_ids=nxt, attention_mask=attn, position_ids=last, past_key_values=out.past_key_values,
                    use_cache=True)
    return torch.cat(tokens, 1)


@torch.no_grad()
def hf_generate(model, prompts, pad: int, new_tokens: int, device, static: bool = False) -> int:
    """HF generate with sampling (temperature 1, no top-k/top-p), the same batch; returns the tokens made.

    `static`: `cache_implementation="static"`, under which transformers compiles the decode step itself
    (`get_compiled_call`: `torch.compile(model.__call__, mode="reduce-overhead")`, the prefill left eager) on
    CUDA; on another device the same `CompileConfig` is marked to compile there too, so a forced CPU run
    measures the same path."""
    ids, attn = left_pad(prompts, pad, device)
    extra = {}
    if static:
        from transformers import CompileConfig
        compile_config = CompileConfig()
        if device.type != "cuda":
            compile_config._compile_all_devices = True
        extra = {"cache_implementation": "static", "compile_config": compile_config}
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, **extra)
    return ids.shape[0] * (out.shape[1] - ids.shape[1])


STATIC_GENERATE_SKIPPED = ("HF generate with a static cache compiles its decode step (torch.compile, "
                           "mode reduce-overhead), minutes on a few CPU cores; --static-generate runs it")


def rollout_spec(a, ckpt: str, pad: int, device, cuda_graphs: bool) -> RolloutSpec:
    """The hf engine down one path: cuda_graphs False is the eager decode, True the fixed-shape one (graphs on
    CUDA), its buffers sized for the run's prompt + new tokens so every round reuses one decoder."""
    return RolloutSpec(model_path=ckpt, dtype=a.dtype, device=str(device), pad_token_id=pad, seed=0,
                       cuda_graphs=cuda_graphs, max_seq_len=a.prompt_len + a.new_tokens)


def bench_rollout(a, ckpt: str, pad: int, device, mem: PeakMemory, prompt_ids: tuple[int, int]) -> tuple[dict, object]:
    mem.reset()
    engine = make_rollout_engine("hf", rollout_spec(a, ckpt, pad, device, cuda_graphs=False))
    static_engine = make_rollout_engine("hf", rollout_spec(a, ckpt, pad, device, cuda_graphs=True))
    g = torch.Generator().manual_seed(1)
    prompts = random_rows(a.rows, a.prompt_len, *prompt_ids, g)
    dgen = torch.Generator(device=device).manual_seed(2)
    sampling = lambda n: SamplingParams(max_new_tokens=n, temperature=1.0)  # noqa: E731
    cases = {
        "engine": lambda r, n: sum(len(x) for x in engine.generate(
            prompts, sampling(n), [r * 1000 + i for i in range(a.rows)]).responses),
        "engine_static": lambda r, n: sum(len(x) for x in static_engine.generate(
            prompts, sampling(n), [r * 1000 + i for i in range(a.rows)]).responses),
        "hf_generate": lambda r, n: hf_generate(engine.model, prompts, pad, n, device),
        "hf_generate_static": lambda r, n: hf_generate(engine.model, prompts, pad, n, device, static=True),
        "sampling_loop": lambda r, n: sampling_loop(engine.model, prompts, pad, n, device, dgen).numel(),
    }
    skipped = {}
    if not a.static_generate:
        del cases["hf_generate_static"]
        skipped["hf_generate_static"] = STATIC_GENERATE_SKIPPED
        print(f"rollout: hf_generate_static skipped: {STATIC_GENERATE_SKIPPED}", file=sys.stderr, flush=True)
    want = a.rows * a.new_tokens
    times: dict[str, list[float]] = {k: [] for k in cases}
    t0 = None
    for r in range(a.repeats + 1):
        # round 0 warms up at the measured sizes (compiles and graph captures are per shape); after the first
        # measured round, more rounds only while the part is within --rollout-budget (a slow case is then
        # measured once)
        if r > 1 and time.perf_counter() - t0 > a.rollout_budget:
            break
        if r == 1:
            t0 = time.perf_counter()
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for k in order:
            s, made = timed(lambda: cases[k](r, a.new_tokens), device)
            if made != want:
                raise RuntimeError(f"rollout {k}: made {made} tokens, expected {want}")
            if r:
                times[k].append(s)
    out = {"rows": a.rows, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "dtype": a.dtype,
           "default_engine": "engine_static" if device.type == "cuda" else "engine", "skipped": skipped}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = {"s": med, "all_s": ts, "tokens_per_s": want / med}
    out["peak_mem_gb"] = mem.peak_gb()
    static_engine.close()
    del static_engine
    free(device)
    return out, engine


# ---------------------------------------------------------------------------- training

def token_mean_nll(out, mb):
    m = out.response_mask.to(out.log_probs.dtype)
    loss = -(out.log_probs * m).sum() / m.sum().clamp(min=1)
    return loss, {"nll": float(loss.detach())}


def micro_batches(prompts, responses, size: int):
    starts = list(range(0, len(prompts), size))
    return [MicroBatch({"prompts": prompts[s:s + size], "responses": responses[s:s + size]},
                       loss_scale=len(prompts[s:s + size]) / len(prompts), last=i == len(starts) - 1)
            for i, s in enumerate(starts)]


def export_into(train_engine, rollout_engine, version: int) -> None:
    for bucket in train_engine.export_weights(BUCKET_BYTES):
        rollout_engine.update_weights(bucket, version)


def adamw_kind(device) -> dict:
    """The AdamW implementation a careful user picks: CUDA's fused kernel, the multi-tensor one elsewhere."""
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}


class PlainTrainer:
    """The baseline a careful user writes: float32 master weights, bf16 autocast on CUDA (float32 on the CPU),
    the LM head on the response positions only, `F.cross_entropy` for the log-probs (fp32 under autocast),
    fused AdamW on CUDA (see the module's docstring)."""

    def __init__(self, ckpt: str, device, pad: int):
        from mindspeed_rl.models import load_causal_lm
        self.device, self.pad = device, pad
        self.model = load_causal_lm(ckpt, "float32").to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6, **adamw_kind(device))

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        import contextlib
        return contextlib.nullcontext()

    def _logp(self, model, prompts, responses):
        # every row the same length here: no padding. logits_to_keep=R + 1 computes the head on the last R + 1
        # positions; the first R predict the response tokens (the last predicts past the end)
        p = torch.stack(prompts).to(self.device)
        r = torch.stack(responses).to(self.device)
        ids = torch.cat([p, r], 1)
        R = r.shape[1]
        with self.autocast():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                           logits_to_keep=R + 1).logits[:, :R]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), r.reshape(-1),
                                                    reduction="none")
        return -nll.view(r.shape)

    def train_step(self, mbs) -> None:
        for mb in mbs:
            logp = self._logp(self.model, mb.data["prompts"], mb.data["responses"])
            (-logp.mean() * mb.loss_scale).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def log_probs(self, prompts, responses, size: int) -> list:
        out = []
        for s in range(0, len(prompts), size):
            out.extend(self._logp(self.model, prompts[s:s + size], responses[s:s + size]).cpu())
        return out


PLAIN_BASELINE = {
    "cuda": "float32 master weights, bf16 autocast, head on response positions (logits_to_keep), fp32 "
            "cross_entropy, AdamW(fused=True)",
    "cpu": "float32, no autocast, head on response positions (logits_to_keep), cross_entropy, AdamW(foreach=True)",
}


def bench_train(a, ckpt: str, pad: int, device, mem: PeakMemory, rollout_engine, dims: dict,
                peak: float | None, vocab: tuple[int, int]) -> dict:
    g = torch.Generator().manual_seed(3)
    prompts = random_rows(a.train_rows, a.train_prompt_len, *vocab, g)
    responses = random_rows(a.train_rows, a.train_response_len, *vocab, g)
    tokens = a.train_rows * (a.train_prompt_len + a.train_response_len)
    response_tokens = a.train_rows * a.train_response_len
    d = dims
    train_flops = needed_flops(d["backbone_params"], d["hidden"], d["vocab"], tokens, response_tokens, backward=True)
    logprob_flops = needed_flops(d["backbone_params"], d["hidden"], d["vocab"], tokens, response_tokens, backward=False)
    rollout_bytes = sum(p.numel() * p.element_size() for p in rollout_engine.model.parameters())
    results: dict = {"rows": a.train_rows, "prompt_len": a.train_prompt_len, "response_len": a.train_response_len,
                     "micro_batch": a.micro_batch, "logprob_micro_batch": a.logprob_micro_batch, "tokens": tokens,
                     "response_tokens": response_tokens,
                     "plain_baseline": PLAIN_BASELINE["cuda" if device.type == "cuda" else "cpu"],
                     "flops": {"train": train_flops, "log_prob": logprob_flops, "how": FLOPS_HOW}}

    def mfu(flops: float, seconds: float):
        return flops / seconds / (peak * 1e12) if peak else None

    version = 0
    for name in ("fsdp", "torch", "plain"):
        free(device)
        mem.reset()
        if name == "plain":
            eng = PlainTrainer(ckpt, device, pad)
            step = lambda: eng.train_step(micro_batches(prompts, responses, a.micro_batch))  # noqa: E731
            logprob = lambda: eng.log_probs(prompts, responses, a.logprob_micro_batch)  # noqa: E731
            sync_fn = lambda: rollout_engine.model.load_state_dict(eng.model.state_dict())  # noqa: E731
        else:
            eng = make_train_engine(name, train_spec(a, ckpt, pad, device))
            step = lambda: eng.train_step(micro_batches(prompts, responses, a.micro_batch), token_mean_nll)  # noqa: E731
            logprob = lambda: eng.log_probs(prompts, responses, a.logprob_micro_batch)  # noqa: E731

            def sync_fn():
                nonlocal version
                version += 1
                export_into(eng, rollout_engine, version)
        steps = [timed(step, device)[0] for _ in range(a.repeats + 1)][1:]
        train_peak = mem.peak_gb()
        lps = [timed(logprob, device)[0] for _ in range(a.repeats + 1)][1:]
        syncs = [timed(sync_fn, device)[0] for _ in range(a.repeats + 1)][1:]
        st, lp, sy = statistics.median(steps), statistics.median(lps), statistics.median(syncs)
        results[name] = {
            "train": {"s": st, "all_s": steps, "tokens_per_s": tokens / st, "mfu": mfu(train_flops, st),
                      "peak_mem_gb": train_peak},
            "log_prob": {"s": lp, "all_s": lps, "tokens_per_s": tokens / lp, "mfu": mfu(logprob_flops, lp)},
            "sync": {"s": sy, "all_s": syncs, "gb_per_s": rollout_bytes / sy / 1e9, "bytes": rollout_bytes},
            "peak_mem_gb": mem.peak_gb(),
        }
        if name != "plain":
            eng.close()
        del eng, step, logprob, sync_fn
    free(device)
    return results


# ---------------------------------------------------------------------------- end to end

def lora_fields(rank: int) -> dict | None:
    """TrainSpec.lora for `--lora RANK`: every linear layer, alpha 16 (LoraConfig's defaults); None when 0."""
    return {"rank": rank, "alpha": 16.0, "target_modules": ["all-linear"], "dropout": 0.0, "lr": None} if rank else None


def train_spec(a, ckpt: str, pad: int, device) -> TrainSpec:
    """A trained engine's spec with the run's model features (--gradient-checkpointing, --lora)."""
    return TrainSpec(model_path=ckpt, dtype=a.dtype, device=str(device), pad_token_id=pad,
                     optim=OptimConfig(lr=1e-6), seed=0, gradient_checkpointing=a.gradient_checkpointing,
                     lora=lora_fields(a.lora))


# ---------------------------------------------------------------------------- memory plan against measurement

def limit_malloc_caching() -> None:
    """glibc: every allocation of 64 KiB or more through mmap, and the heap trimmed above it, so a freed
    tensor leaves the RSS at once (by default the thresholds grow to 32 MiB and freed blocks stay resident,
    which hides a later part's peak under an earlier part's garbage)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 64 << 10)   # M_MMAP_THRESHOLD (fixing it turns off the dynamic threshold)
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD


def memory_estimates(a, ckpt: str, device) -> dict:
    """The memory plan's terms (planning/memory.py) for this run's sizes, in GB, by part."""
    from mindspeed_rl.engines import memory_model as MM
    from mindspeed_rl.planning import memory_terms as M
    d, src = M.load_dims(ckpt)
    kind = "cpu" if device.type == "cpu" else "gpu"
    lay = M.Layout("torch", MM.REPLICATED, 1, kind=kind, dtype=a.dtype)
    c = lay.compute_bytes
    p = d.params()
    lora = M.lora_params(d, a.lora, ["all-linear"])
    trainable = lora or p
    weights = M.state_bytes(p, c) + M.state_bytes(lora, 4) if lora else M.state_bytes(p, 4)
    tokens = a.micro_batch * (a.train_prompt_len + a.train_response_len)
    act = M.train_activation_bytes(d, tokens, c, lay.autocast, a.gradient_checkpointing, lora_rank=a.lora)
    recompute = M.recompute_bytes(d, tokens, c, lay.autocast, a.lora) if a.gradient_checkpointing else 0.0
    logits = M.chunked_logits_bytes(d, a.micro_batch * a.train_response_len, True, c, head_trained=not a.lora)
    grads = M.state_bytes(trainable, 4)
    largest = (max(a.lora * max(x, y) for x, y in d.linear_shapes().values()) if lora
               else max(d.vocab * d.hidden, max(x * y for x, y in d.linear_shapes().values())))
    step = M.optimizer_step_bytes(trainable, 1, device.type != "cpu", largest)
    copy = trainable * c if lay.autocast else 0.0
    lp_rows = min(a.logprob_micro_batch, a.train_rows)
    lp_tokens = lp_rows * (a.train_prompt_len + a.train_response_len)
    logprob = M.log_prob_pass_bytes(M.inference_activation_bytes(d, lp_tokens, c, lora=bool(a.lora)),
                                    M.chunked_logits_bytes(d, lp_rows * a.train_response_len, False, c),
                                    lp_tokens, d, c) + copy
    rc = 4 if device.type == "cpu" and a.dtype == "float32" else M.DTYPE_BYTES[a.dtype]
    gen = (M.kv_cache_bytes(d, a.rows, a.prompt_len + a.new_tokens, rc)
           + M.inference_activation_bytes(d, a.rows * a.prompt_len, rc) + M.decode_logits_bytes(d, a.rows))
    gb = 1e9
    return {"source": src, "params": p, "lora_params": lora,
            "train weights": weights / gb,
            "optimizer state": M.state_bytes(trainable, 8) / gb,
            "activations": act / gb,
            "train step peak": (grads + max(act + max(logits, recompute) + copy, step)) / gb,
            "log-prob peak": logprob / gb,
            "rollout weights": M.state_bytes(p, rc) / gb,
            "rollout generate peak": gen / gb,
            "how": {"train step peak": "grads + max(activations + max(logits, recomputed layer) + autocast copy, "
                               "optimizer step)",
                    "activations": f"{tokens} tokens, checkpointing {'on' if a.gradient_checkpointing else 'off'}"
                                   f"{f', LoRA rank {a.lora}' if a.lora else ''}",
                    "rollout generate peak": f"KV cache {a.rows} rows x {a.prompt_len + a.new_tokens} + prefill + logits"}}


def bench_memory(a, ckpt: str, pad: int, device, mem: PeakMemory, ids: tuple[int, int]) -> dict:
    """Each part's measured bytes beside the memory plan's estimate (see the module's docstring)."""
    est = memory_estimates(a, ckpt, device)
    g = torch.Generator().manual_seed(5)
    prompts = random_rows(a.train_rows, a.train_prompt_len, *ids, g)
    responses = random_rows(a.train_rows, a.train_response_len, *ids, g)
    got: dict[str, float] = {}
    if "train" in a.memory_parts:
        train_memory(a, ckpt, pad, device, mem, prompts, responses, got)
    if "rollout" in a.memory_parts:
        rollout_memory(a, ckpt, pad, device, mem, random_rows(a.rows, a.prompt_len, *ids, g), got)
    rows = {k: {"estimate_gb": est[k], "measured_gb": v, "ratio": (est[k] / v) if v > 0 else None,
                "how": est["how"].get(k, "")} for k, v in got.items()}
    return {"source": est["source"], "params": est["params"], "lora_params": est["lora_params"],
            "gradient_checkpointing": a.gradient_checkpointing, "lora": a.lora, "parts": rows,
            "sizes": {"train_rows": a.train_rows, "micro_batch": a.micro_batch, "train_prompt_len": a.train_prompt_len,
                      "train_response_len": a.train_response_len, "logprob_micro_batch": a.logprob_micro_batch,
                      "rows": a.rows, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "dtype": a.dtype}}


def train_memory(a, ckpt: str, pad: int, device, mem: PeakMemory, prompts, responses, got: dict) -> None:
    """The torch engine's parts: weights, AdamW state, a micro-batch's activations, the step's and the
    log-prob pass's peaks over what is resident."""
    free(device)
    base = mem.current_gb()
    eng = make_train_engine("torch", train_spec(a, ckpt, pad, device))
    for t in eng.parameters():   # resident: a weight the build left mapped from the checkpoint file is read once
        float(t.reshape(-1)[::512].sum())
    free(device)
    got["train weights"] = mem.current_gb() - base

    at_loss: list[float] = []

    def loss_fn(out, mb):
        if not at_loss:
            at_loss.append(mem.current_gb())   # the first micro-batch's graph is alive: its activations
        return token_mean_nll(out, mb)

    steps = []
    for k in range(2):      # the first step creates AdamW's state; the second runs on it
        free(device)
        start = mem.current_gb()
        at_loss.clear()
        mem.reset()
        eng.train_step(micro_batches(prompts, responses, a.micro_batch), loss_fn)
        peak = mem.peak_gb()
        free(device)
        steps.append({"start": start, "peak": peak, "at_loss": at_loss[0], "end": mem.current_gb()})
    got["optimizer state"] = steps[0]["end"] - steps[0]["start"]
    got["activations"] = steps[1]["at_loss"] - steps[1]["start"]
    got["train step peak"] = steps[1]["peak"] - steps[1]["start"]
    free(device)
    start = mem.current_gb()
    mem.reset()
    with torch.no_grad():
        eng.log_probs(prompts, responses, a.logprob_micro_batch)
    got["log-prob peak"] = mem.peak_gb() - start
    eng.close()
    del eng
    free(device)


def rollout_memory(a, ckpt: str, pad: int, device, mem: PeakMemory, gp, got: dict) -> None:
    """The hf rollout engine's parts: its weights and one generate call's peak over them."""
    base = mem.current_gb()
    rollout = make_rollout_engine("hf", RolloutSpec(model_path=ckpt, dtype=a.dtype, device=str(device),
                                                    pad_token_id=pad, seed=0))
    for t in rollout.model.parameters():
        float(t.reshape(-1)[::512].sum())
    free(device)
    got["rollout weights"] = mem.current_gb() - base
    start = mem.current_gb()
    mem.reset()
    rollout.generate(gp, SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0), list(range(a.rows)))
    got["rollout generate peak"] = mem.peak_gb() - start
    rollout.close()
    del rollout
    free(device)


def memory_table(m: dict) -> str:
    feats = ", ".join(f for f in ("checkpointing" if m["gradient_checkpointing"] else "",
                                  f"LoRA rank {m['lora']}" if m["lora"] else "") if f) or "no checkpointing, no LoRA"
    s = m["sizes"]
    lines = [f"memory plan vs measured ({feats}; train {s['train_rows']} rows of {s['train_prompt_len']}+"
             f"{s['train_response_len']} in micro-batches of {s['micro_batch']}; rollout {s['rows']} rows of "
             f"{s['prompt_len']}+{s['new_tokens']}; {s['dtype']}; dimensions: {m['source']})",
             f"  {'part':<24} {'estimate GB':>12} {'measured GB':>12} {'est/meas':>9}"]
    for k, r in m["parts"].items():
        lines.append(f"  {k:<24} {r['estimate_gb']:>12.3f} {r['measured_gb']:>12.3f} {fmt(r['ratio'], '.2f'):>9}")
    return "\n".join(lines)


def e2e_overrides(a, ckpt: str, out_dir: str, device) -> list[str]:
    o = [f"actor_config.model_path={ckpt}", "generate_config.backend=hf", "actor_config.backend=fsdp",
         "~placement.groups.rollout", "data.dataset=builtin:copy", "rl_config.reward_fn=digits",
         f"data.prompt_key={PROMPT}", f"data.answer_key={ANSWER}", "data.chat_template=false",
         "generate_config.stop_tokens=[]", f"generate_config.max_new_tokens={a.e2e_new_tokens}",
         f"rl_config.prompts_per_step={a.e2e_prompts}", f"rl_config.n_samples_per_prompt={a.e2e_samples}",
         f"actor_config.ppo_mini_batch_size={max(1, a.e2e_prompts // 2)}",   # 2 updates per step, as the config
         f"actor_config.dtype={a.dtype}", f"trainer.total_steps={a.e2e_steps}", f"trainer.output_dir={out_dir}",
         "trainer.dashboard=false", "trainer.report=false", "trainer.plot=false", "trainer.logger=[jsonl]",
         "trainer.progress=false", "trainer.save_interval=0",
         f"actor_config.gradient_checkpointing={str(a.gradient_checkpointing).lower()}",
         f"actor_config.lora.rank={a.lora}"]
    if device.type == "cuda":
        o += ["placement.groups.integrated.num_gpus=1"]
    else:
        cpus = max(1, (os.cpu_count() or 2))
        threads = a.threads
        o += ["placement.groups.integrated.num_cpus=1", "placement.groups.integrated.num_gpus=0",
              "placement.groups.integrated.device=cpu", f"+placement.groups.integrated.torch_threads={threads}",
              "placement.groups.rule.num_cpus=0.5", "placement.device_kind=cpu",
              f"placement.ray_num_cpus={cpus}"]
    return o


def _tree_rss_bytes(root: int) -> int:
    """RSS of `root` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/statm") as f:
                rss[int(d)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def _run_trainer(cmd, env, work: Path, log: Path, device, timeout_s: float) -> tuple[int | None, int]:
    """Run the trainer's command in a session of its own (killed whole on timeout); (rc, peak memory bytes)."""
    import signal
    peak_used = [0]
    stop = threading.Event()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                start_new_session=True)

        def sample():
            while not stop.is_set():
                try:
                    if device.type == "cuda":
                        f, total = torch.cuda.mem_get_info(device)
                        peak_used[0] = max(peak_used[0], total - f)
                    else:
                        peak_used[0] = max(peak_used[0], _tree_rss_bytes(proc.pid))
                except Exception:  # noqa: BLE001 - a missed sample is not an error
                    pass
                stop.wait(0.2 if device.type == "cuda" else 0.5)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop.set()
            th.join()
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:   # its whole session: the driver, and Ray's processes if any outlived it
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
    return rc, peak_used[0]


def bench_e2e(a, ckpt: str, device, dims: dict, peak: float | None, work: Path) -> dict:
    import shlex
    out_dir = work / "e2e"
    cmd = [sys.executable, str(REPO / "cli" / "train_grpo.py"), "--config-name", "grpo_qwen25_0p5b_1gpu",
           *e2e_overrides(a, ckpt, str(out_dir), device)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    log = work / "e2e.log"
    free(device)
    base = None
    if device.type == "cuda":
        f0, total = torch.cuda.mem_get_info(device)
        base = total - f0
    out: dict = {"command": " ".join(shlex.quote(c) for c in cmd), "tries": []}
    t0 = time.perf_counter()
    while True:
        # the trainer gets --e2e-timeout, cut to what is left of --budget (the whole command's wall time)
        timeout_s = max(30.0, min(a.e2e_timeout, a.budget - (time.perf_counter() - a.t_start) - 15))
        shutil.rmtree(out_dir, ignore_errors=True)
        rc, peak_bytes = _run_trainer(cmd, env, work, log, device, timeout_s)
        text = log.read_text()
        out["tries"].append({"rc": rc, "timeout_s": timeout_s})
        # Ray's raylet must start within 30 s (hard-coded in ray): on an overloaded machine it may not; once more
        if (rc != 0 and "timed out during startup" in text and len(out["tries"]) < 2
                and a.budget - (time.perf_counter() - a.t_start) > 90):
            continue
        break
    out.update({"wall_s": time.perf_counter() - t0, "rc": rc, "timeout_s": timeout_s})
    tail = text[-3000:]
    metrics = out_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    if rc != 0 or len(recs) < a.e2e_steps:
        out["error"] = (f"trainer exited with {rc} (None: killed at its {timeout_s:.0f} s timeout) after {len(recs)} "
                        f"of {a.e2e_steps} steps" + (f"; the figures are from those {len(recs)}" if recs else "")
                        + f"; log tail:\n{tail}")
        if not recs:
            return out
    used = recs[1:] if len(recs) > 1 else recs
    rows = a.e2e_prompts * a.e2e_samples

    def mean(key):
        vals = [r[key] for r in used if key in r]
        return sum(vals) / len(vals) if vals else None

    steps = [r["timing/step"] for r in used]
    total_tokens = [r["throughput/tokens_per_s"] * r["timing/step"] for r in used]
    resp_tokens = [r["response_length/mean"] * rows for r in used]
    step_s = sum(steps) / len(steps)
    split = {k[len("timing/"):]: mean(k) for k in sorted({k for r in used for k in r if k.startswith("timing/")})}
    busy = {k[len("busy/"):]: mean(k) for k in sorted({k for r in used for k in r if k.startswith("busy/")})}
    train_busy = busy.get("actor_train")
    mean_tokens = sum(total_tokens) / len(total_tokens)
    out.update({
        "steps_measured": [r["step"] for r in used], "rows_per_step": rows, "new_tokens": a.e2e_new_tokens,
        "step_s": step_s, "all_step_s": [r["timing/step"] for r in recs],
        "tokens_per_s": sum(total_tokens) / sum(steps),             # prompt + response, per device (1 device)
        "response_tokens_per_s": sum(resp_tokens) / sum(steps),
        "driver_tokens_per_s": [r["throughput/tokens_per_s"] for r in recs],
        "tokens_per_step": mean_tokens, "response_tokens_per_step": sum(resp_tokens) / len(resp_tokens),
        # the stages this run's graph has (an on-policy update has no actor_log_prob stage)
        "split_s": {k: split[k] for k in ("actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train",
                                          "weight_sync", "step") if k in split},
        "busy_s": {k: busy[k] for k in ("actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train")
                   if k in busy},
        "timing_s": split, "all_busy_s": busy,
        "train_mfu": (needed_flops(dims["backbone_params"], dims["hidden"], dims["vocab"], mean_tokens,
                                   sum(resp_tokens) / len(resp_tokens), backward=True) / train_busy / (peak * 1e12))
        if peak and train_busy else None,
        "logprob_diff_max": mean("rollout/logprob_diff_max"),
        "peak_mem_gb": peak_bytes / 1e9,
        "peak_mem_what": ("device memory used by all processes (mem_get_info, sampled), "
                          f"{(base or 0) / 1e9:.2f} GB of it held before the trainer started")
        if device.type == "cuda" else "RSS of the trainer's process tree (sampled)",
    })
    return out


# ---------------------------------------------------------------------------- main

def fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


ROLLOUT_RATIOS = {   # name: (the engine's row, the baseline's row)
    "rollout_over_hf_generate": ("engine", "hf_generate"),
    "rollout_over_sampling_loop": ("engine", "sampling_loop"),
    "rollout_over_hf_static_generate": ("engine", "hf_generate_static"),
    "static_rollout_over_hf_generate": ("engine_static", "hf_generate"),
    "static_rollout_over_sampling_loop": ("engine_static", "sampling_loop"),
    "static_rollout_over_hf_static_generate": ("engine_static", "hf_generate_static"),
}


def rollout_ratios(rollout: dict) -> dict:
    """Each engine path's tokens/s over each baseline's, from the same run; None where a row is skipped."""
    return {name: (rollout[e]["tokens_per_s"] / rollout[b]["tokens_per_s"] if e in rollout and b in rollout else None)
            for name, (e, b) in ROLLOUT_RATIOS.items()}


def table(res: dict) -> str:
    lines = []
    ro = res["rollout"]
    lines.append(f"rollout ({ro['rows']} rows x {ro['new_tokens']} new tokens, prompt {ro['prompt_len']}, {ro['dtype']})")
    for k in ("engine", "engine_static", "hf_generate", "hf_generate_static", "sampling_loop"):
        tag = " (the default here)" if k == ro["default_engine"] else ""
        if k in ro:
            lines.append(f"  {k:<28} {ro[k]['tokens_per_s']:>12,.1f} tok/s   {ro[k]['s']:.3f} s{tag}")
        else:
            lines.append(f"  {k:<28} skipped: {ro['skipped'].get(k, '')}")
    lines.append(f"  peak memory {ro['peak_mem_gb']:.2f} GB")
    tr = res["train"]
    lines.append(f"train step / log-prob pass / weight sync ({tr['rows']} rows x {tr['prompt_len']}+{tr['response_len']} "
                 f"tokens, micro-batch {tr['micro_batch']}; plain: {tr['plain_baseline']})")
    lines.append(f"  {'':<8} {'train tok/s':>12} {'MFU':>6} {'train GB':>9} {'logprob tok/s':>14} {'MFU':>6} "
                 f"{'sync GB/s':>10} {'peak GB':>8}")
    for k in ("fsdp", "torch", "plain"):
        e = tr[k]
        lines.append(f"  {k:<8} {e['train']['tokens_per_s']:>12,.1f} {fmt(e['train']['mfu'], '.1%'):>6} "
                     f"{e['train']['peak_mem_gb']:>9.2f} {e['log_prob']['tokens_per_s']:>14,.1f} "
                     f"{fmt(e['log_prob']['mfu'], '.1%'):>6} {e['sync']['gb_per_s']:>10.2f} {e['peak_mem_gb']:>8.2f}")
    lines.append(f"  MFU: needed FLOPs ({tr['flops']['how']}) / time / peak")
    lines.append("ratios (project / plain baseline, tokens/s or GB/s):")
    for k, v in res["ratios"].items():
        lines.append(f"  {k:<40} {fmt(v, '.3f')}")
    e2e = res.get("e2e")
    if e2e and "tokens_per_s" in e2e:
        lines.append(f"end to end ({e2e['rows_per_step']} rows x {e2e['new_tokens']} new tokens, steps "
                     f"{e2e['steps_measured']} measured; all steps {[round(s, 2) for s in e2e['all_step_s']]} s)")
        lines.append(f"  tokens/s per device: {e2e['tokens_per_s']:,.1f} (prompt + response), "
                     f"{e2e['response_tokens_per_s']:,.1f} (response); step {e2e['step_s']:.2f} s; "
                     f"train MFU {fmt(e2e['train_mfu'], '.2%')}; peak memory {e2e['peak_mem_gb']:.2f} GB")
        lines.append("  stage     " + " ".join(f"{k:>15}" for k in e2e["split_s"]))
        lines.append("  span s    " + " ".join(f"{fmt(v, '.3f'):>15}" for v in e2e["split_s"].values()))
        lines.append("  busy s    " + " ".join(f"{fmt(e2e['busy_s'].get(k), '.3f'):>15}" for k in e2e["split_s"]))
    if e2e and "error" in e2e:
        lines.append(f"end to end FAILED: {e2e['error'][:2000]}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cuda:0, cpu (default: cuda when available)")
    p.add_argument("--model", choices=MODELS, default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    for k in ("rows", "new_tokens", "prompt_len", "train_rows", "train_prompt_len", "train_response_len",
              "micro_batch", "logprob_micro_batch", "repeats", "e2e_prompts", "e2e_samples", "e2e_new_tokens",
              "e2e_steps", "e2e_timeout", "rollout_budget", "budget"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"GPU default {GPU_DEFAULTS[k]}, CPU default {CPU_DEFAULTS[k]}")
    p.add_argument("--skip-e2e", action="store_true", help="leave out the whole-trainer run")
    p.add_argument("--static-generate", action=argparse.BooleanOptionalAction, default=None,
                   help="the HF generate baseline with a static cache and its compiled decode step (default: on CUDA "
                        "only; compiling on a few CPU cores takes minutes)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="train engines (and the end-to-end actor) recompute each layer's activations in the backward")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="LoRA adapters of this rank on every linear layer of the train engines and the end-to-end actor")
    p.add_argument("--memory", action="store_true", help="also: the memory plan's terms against measured peaks")
    p.add_argument("--memory-only", action="store_true", help="only the memory plan against measured peaks")
    p.add_argument("--memory-parts", nargs="+", choices=("train", "rollout"), default=["train", "rollout"],
                   help="which engines --memory measures (default both)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU only: torch threads here and in the trainer's worker (default 1: on a loaded machine, "
                        "OpenMP threads spin-waiting for each other made the tiny model's ops ~100x slower)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (default: by name)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.device.type == "cuda" and a.device.index is None:
        a.device = torch.device("cuda", torch.cuda.current_device())
    defaults = GPU_DEFAULTS if a.device.type == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.dtype = a.dtype or ("bfloat16" if a.device.type == "cuda" else "float32")
    if a.static_generate is None:
        a.static_generate = a.device.type == "cuda"
    return a


def machine(device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "platform": platform.platform()}


def finish_memory_only(a, memory: dict, device, t_start: float) -> int:
    res = {"machine": machine(device), "args": {k: (str(v) if isinstance(v, torch.device) else v)
                                                for k, v in vars(a).items()},
           "model": {"name": a.model, "params": memory["params"], "dtype": a.dtype}, "memory": memory,
           "ru_maxrss_gb": ru_maxrss_gb(), "wall_s": time.perf_counter() - t_start}
    print(f"single-device memory: {a.model} ({memory['params'] / 1e6:.1f}M params) on {res['machine']['device']} "
          f"[{device}], torch {torch.__version__}, load {res['machine']['load_avg'][0]:.1f}")
    print(memory_table(memory))
    print(f"wall {res['wall_s']:.0f} s; ru_maxrss {res['ru_maxrss_gb']:.2f} GB")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    device = a.device
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
        if a.memory or a.memory_only:
            limit_malloc_caching()
    peak, peak_what = (a.peak_tflops, f"given: {a.peak_tflops:g} TFLOP/s") if a.peak_tflops else peak_tflops(device)
    t_start = a.t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="single_device_") as tmp:
        work = Path(tmp)
        (work / "model").mkdir()
        ckpt = build_checkpoint(a.model, work / "model")
        from mindspeed_rl.models import load_tokenizer
        tok = load_tokenizer(ckpt)
        pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        # prompt and response ids: the tokenizer's (valid in any of the three vocabularies), never the pad id
        ids = (pad + 1, len(tok))
        mem = PeakMemory(device)
        memory = None
        if a.memory or a.memory_only:   # first: a clean process, nothing of the other parts resident
            memory = bench_memory(a, ckpt, pad, device, mem, ids)
            print(f"memory done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        if a.memory_only:
            return finish_memory_only(a, memory, device, t_start)
        rollout, rollout_engine = bench_rollout(a, ckpt, pad, device, mem, ids)
        dims = head_dims(rollout_engine.model)
        n_params = dims["params"]
        print(f"rollout done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        train = bench_train(a, ckpt, pad, device, mem, rollout_engine, dims, peak, ids)
        print(f"train done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        rollout_engine.close()
        del rollout_engine
        free(device)
        ratios = {**rollout_ratios(rollout),
            "train_over_plain_autocast": train["fsdp"]["train"]["tokens_per_s"] / train["plain"]["train"]["tokens_per_s"],
            "torch_train_over_plain_autocast": train["torch"]["train"]["tokens_per_s"] / train["plain"]["train"]["tokens_per_s"],
            "log_prob_over_plain": train["fsdp"]["log_prob"]["tokens_per_s"] / train["plain"]["log_prob"]["tokens_per_s"],
            "torch_log_prob_over_plain": train["torch"]["log_prob"]["tokens_per_s"] / train["plain"]["log_prob"]["tokens_per_s"],
            "sync_over_load_state_dict": train["fsdp"]["sync"]["gb_per_s"] / train["plain"]["sync"]["gb_per_s"],
            "torch_sync_over_load_state_dict": train["torch"]["sync"]["gb_per_s"] / train["plain"]["sync"]["gb_per_s"],
        }
        res = {
            "machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                        "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": sys.version.split()[0],
                        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "platform": platform.platform(), "peak": peak_what},
            "args": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in vars(a).items()},
            "model": {"name": a.model, "dtype": a.dtype, **dims},
            "rollout": rollout, "train": train, "ratios": ratios,
        }
        if memory is not None:
            res["memory"] = memory
        if not a.skip_e2e:
            res["e2e"] = bench_e2e(a, ckpt, device, dims, peak, work)
            print(f"e2e done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        res["ru_maxrss_gb"] = ru_maxrss_gb()
        res["wall_s"] = time.perf_counter() - t_start
    print(f"single-device RL step: {a.model} ({n_params / 1e6:.1f}M params) on {res['machine']['device']} "
          f"[{device}], torch {torch.__version__}, load {res['machine']['load_avg'][0]:.1f}; {peak_what}")
    print(table(res))
    if "memory" in res:
        print(memory_table(res["memory"]))
    print(f"wall {res['wall_s']:.0f} s; ru_maxrss {res['ru_maxrss_gb']:.2f} GB")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 1 if "error" in res.get("e2e", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
