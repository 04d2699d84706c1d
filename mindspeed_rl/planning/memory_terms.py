"""The terms of a memory plan: a model's dimensions and the bytes each part of a step takes.

The terms are small pure functions, each with its formula and source, so a figure can be checked by hand:
weights, gradients and AdamW state by dtype and shard (mixed precision: fp32 masters, fp32 gradients, two
fp32 moments, compute in `actor_config.dtype`), activations per micro-batch from the model's dimensions
(with or without activation checkpointing), the LM head's logits, the reference, and the rollout engine's
share. Model dimensions come from the model's config.json, else from the architectures this repository
ships (mindspeed_rl/models/configs/), and the estimate says which. docs/fitting.md reads a plan and lists
the knobs; benchmarks/single_device.py measures the terms against the CPU's peaks.

`Layout` says how a worker group runs a model (backend, dp/tp/pp, device kind, dtype), which the
terms read; `memory.py` adds them up per device and MFC.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..engines import memory_model as MM
from ..models.checkpoint import read_config

GB = 1e9
# fp32 logits of one chunk of the LM head on the CPU and on an accelerator (engines/train/log_probs.py
# LOGITS_CHUNK_BYTES and ACCELERATOR_LOGITS_CHUNK_BYTES, read without torch)
LOGITS_CHUNK_BYTES = 128 << 20
ACCELERATOR_LOGITS_CHUNK_BYTES = 1 << 30


def logits_chunk_bytes(kind: str) -> int:
    """The fp32 logits one chunk holds on a device of this kind ("cpu", "gpu", "npu")."""
    return LOGITS_CHUNK_BYTES if kind == "cpu" else ACCELERATOR_LOGITS_CHUNK_BYTES
# a trainer process on an accelerator: the CUDA/CANN context, the collective's buffers, allocator slack.
# An allowance, not a measurement (vLLM's gpu_memory_utilization covers its own process)
CONTEXT_BYTES = 1.0 * GB
# a worker process on the host: Python with torch, transformers and Ray's core worker imported, before any model
# (measured here: 0.64-0.71 GB resident for the rule reward's worker of configs/grpo_smollm2_arith.yaml)
HOST_PROCESS_BYTES = 0.7 * GB
# the run's own processes beside its workers on the host: the driver (0.66-0.76 GB measured, as a worker: torch
# and transformers loaded) and a dock's actor (0.38-0.41 GB: torch without transformers); validation has a dock
# of its own
DRIVER_BYTES = 0.7 * GB
DOCK_BYTES = 0.4 * GB
# Ray's own processes when the trainer starts Ray on this host (GCS, raylet, dashboard and its agents, log
# monitor): 0.57 GB resident together, measured beside configs/grpo_smollm2_arith.yaml's run
RAY_PROCESSES_BYTES = 0.57 * GB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CONFIG_DIR = Path(__file__).resolve().parents[1] / "models" / "configs"
SHIPPED = {"qwen2.5-0.5b": "qwen2_5_0_5b.json", "qwen2.5-1.5b": "qwen2_5_1_5b.json", "qwen2.5-3b": "qwen2_5_3b.json",
           "qwen2.5-7b": "qwen2_5_7b.json", "qwen2.5-14b": "qwen2_5_14b.json", "qwen2.5-32b": "qwen2_5_32b.json",
           "qwen2.5-72b": "qwen2_5_72b.json"}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------- the model's dimensions
@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs of a decoder-only (Qwen2/Llama-style) model's config.json."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie: bool = False             # tie_word_embeddings: the LM head is the embedding
    qkv_bias: bool = True         # Qwen2 has biases on q, k, v; Llama (attention_bias false) none

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, c: dict) -> "ModelDims":
        c = c.get("text_config", c)
        heads = int(c["num_attention_heads"])
        return cls(hidden=int(c["hidden_size"]), intermediate=int(c["intermediate_size"]),
                   layers=int(c["num_hidden_layers"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads), vocab=int(c["vocab_size"]),
                   tie=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by the module names LoRA targets."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        """One decoder layer: its linear layers, the q/k/v biases, two RMSNorm weights."""
        bias = (self.hidden + 2 * self.kv_dim) if self.qkv_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + 2 * self.hidden

    def params(self, head: str = "lm") -> int:
        """All parameters, tied weights once. head: "lm" (a causal LM), "value" (a critic or reward model:
        a 1-wide head in place of the LM head)."""
        embed = self.vocab * self.hidden
        top = (0 if self.tie else embed) if head == "lm" else self.hidden
        return embed + self.layers * self.layer_params() + self.hidden + top


def shipped_name(path: str | None) -> str | None:
    """The shipped architecture a model path's name says (`/models/Qwen2.5-7B-Instruct` -> qwen2.5-7b), or None."""
    if not path:
        return None
    m = re.search(r"qwen2\.?5[-_ ]?(\d+(?:[._]\d+)?)b", Path(str(path).rstrip("/")).name.lower())
    if not m:
        return None
    name = f"qwen2.5-{m.group(1).replace('_', '.')}b"
    return name if name in SHIPPED else None


def load_dims(model_path: str | None, model_config: str | None = None) -> tuple[ModelDims | None, str]:
    """The model's dimensions and where they came from: `model_config` (a config.json path or a shipped
    architecture's name), else model_path's config.json, else the shipped architecture model_path's name
    says. Raises ValueError for a model_config that names neither."""
    if model_config:
        if model_config.lower() in SHIPPED:
            name = model_config.lower()
            return (ModelDims.from_config(json.loads((CONFIG_DIR / SHIPPED[name]).read_text())),
                    f"shipped {name} (model_config)")
        p = Path(model_config).expanduser()
        p = p / "config.json" if p.is_dir() else p
        try:
            return ModelDims.from_config(json.loads(p.read_text())), f"{p} (model_config)"
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{model_config!r} is neither a readable config.json ({e}) nor a shipped "
                             f"architecture ({sorted(SHIPPED)})") from None
    if model_path:
        c = read_config(model_path)
        if c is not None:
            try:
                return ModelDims.from_config(c), f"{model_path} config.json"
            except (KeyError, ValueError, TypeError):
                pass
    name = shipped_name(model_path)
    if name:
        return (ModelDims.from_config(json.loads((CONFIG_DIR / SHIPPED[name]).read_text())),
                f"shipped {name} (by the name of {model_path})")
    return None, "unknown"


# ---------------------------------------------------------------------------- the terms (bytes)
def state_bytes(n_params: int, bytes_per_param: float, shards: int = 1) -> float:
    """Weights, gradients or optimizer state: n x bytes / shards (FSDP and Megatron's distributed optimizer
    shard over dp ranks, tp x pp split the model; DDP keeps a full replica: 1 shard)."""
    return n_params * bytes_per_param / max(1, shards)


def optimizer_step_bytes(trainable: int, shards: int, foreach: bool, largest: int) -> float:
    """AdamW's step beyond its state: torch's foreach implementation (the default on accelerators) makes one
    fp32 temporary of every moment at once (sqrt of exp_avg_sq: 4 x trainable / shards); the per-tensor loop
    (the CPU's) two of the largest tensor's size at a time (its sqrt, then the division)."""
    return 4 * trainable / max(1, shards) if foreach else 2 * 4 * largest


def lora_params(d: ModelDims, rank: int, targets: list[str] | tuple[str, ...]) -> int:
    """Adapter parameters: r x (in + out) per targeted linear layer (A: in x r, B: r x out; LoRA, Hu et al.
    2021). "all-linear" (peft's name) targets every linear layer but the LM head."""
    if rank <= 0:
        return 0
    names = LORA_MODULES if "all-linear" in targets else [m for m in LORA_MODULES if m in set(targets)]
    shapes = d.linear_shapes()
    return d.layers * sum(rank * sum(shapes[n]) for n in names)


def activation_bytes_per_token_layer(d: ModelDims, compute_bytes: int, fp32_residual: bool,
                                     lora_rank: int = 0) -> float:
    """Bytes one token keeps for the backward in one decoder layer (Qwen2/Llama: RMSNorm, GQA attention
    through a fused kernel, SwiGLU MLP), counted as Korthikanti et al. 2022 count a GPT layer (their
    34 x hidden in 16-bit with dropout and a 4h GELU MLP), and measured on the CPU within 7 % (the 0.5B
    architecture, fp32, with and without checkpointing and LoRA: benchmarks/single_device.py --memory-only,
    docs/fitting.md):

      norms    2 x (4 h + r h)   each RMSNorm keeps its fp32 input and its normalized input to the weight
                                 (not with LoRA: a frozen weight needs no gradient, 2 x 4 h)
      inputs   c h x (3 + 2)     the attention's and the MLP's input, one copy per linear when autocast casts
                                 an fp32 residual (q, k, v; gate, up), else c h x (1 + 1)
      attention c h (2 + 2 g) + c h   q, k, v (g = kv_heads / heads), the kernel's output, o_proj's input
      rope     8 head_dim        cos and sin, fp32
      mlp      4 c I             gate, up, silu(gate) and their product
      lora     7 c rank          each adapter's A output (LoRA on every linear layer)

    c: compute bytes; r: the residual stream's (4 under autocast, which keeps it fp32, else c)."""
    h, c = d.hidden, compute_bytes
    r = 4 if fp32_residual else c
    g = d.kv_heads / d.heads
    casts = 5 if (fp32_residual and c < 4) else 2
    norms = 2 * 4 * h + (0 if lora_rank else 2 * r * h)
    return (norms + c * h * casts + c * h * (2 + 2 * g) + c * h + 8 * d.head_dim
            + 4 * c * d.intermediate + 7 * c * lora_rank)


def train_activation_bytes(d: ModelDims, tokens: int, compute_bytes: int, fp32_residual: bool,
                           checkpointing: bool, layers: int | None = None, lora_rank: int = 0) -> float:
    """Activations of one micro-batch's forward kept for its backward, over `layers` decoder layers (a
    pipeline stage's; default all). Without checkpointing every layer keeps its full set
    (`activation_bytes_per_token_layer`); with it each layer keeps only its input, r x h per token (Chen et
    al. 2016; transformers' gradient_checkpointing_enable, Megatron's full recompute), and one layer's full
    set lives again while it is recomputed in the backward (`recompute_bytes`). The final norm adds 4 h + r h
    per token."""
    n = d.layers if layers is None else layers
    r = 4 if fp32_residual else compute_bytes
    full = activation_bytes_per_token_layer(d, compute_bytes, fp32_residual, lora_rank)
    per_token = n * r * d.hidden if checkpointing else n * full
    return tokens * (per_token + 4 * d.hidden + r * d.hidden)


def recompute_bytes(d: ModelDims, tokens: int, compute_bytes: int, fp32_residual: bool, lora_rank: int = 0) -> float:
    """With checkpointing, the one layer recomputed in the backward holds its full set again. It lives after
    the head's backward has freed the logits' working set, so a step's peak holds the larger of the two
    (the non-checkpointed backward starts at the head with every layer's activations alive: their sum)."""
    return tokens * activation_bytes_per_token_layer(d, compute_bytes, fp32_residual, lora_rank)


def inference_activation_bytes(d: ModelDims, tokens: int, compute_bytes: int, lora: bool = False) -> float:
    """A forward without grad keeps nothing between layers: its peak is one layer's working set, the
    residual and norm output (about 4 h) and the MLP's silu(gate), up and their product (3 I) per token;
    with LoRA a linear layer's output and its adapter's sum exist together (one I more)."""
    return tokens * compute_bytes * (4 * d.hidden + (4 if lora else 3) * d.intermediate)


def log_prob_pass_bytes(layers_peak: float, logits_peak: float, tokens: int, d: ModelDims,
                        compute_bytes: int) -> float:
    """A log-prob pass runs the layers, then the head on the last hidden states: its peak is the larger
    of the two working sets, over the hidden states it keeps (tokens x h)."""
    return max(layers_peak, logits_peak) + tokens * d.hidden * compute_bytes


def chunked_logits_bytes(d: ModelDims, response_tokens: int, train: bool, compute_bytes: int = 4,
                         head_trained: bool = True, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> float:
    """The LM head a chunk of tokens at a time (engines/train/log_probs.py head_log_probs): at most
    `chunk_bytes` of fp32 logits per chunk (fewer when the micro-batch's response tokens are fewer).
    Without grad: the fp32 logits and their log-softmax (2 chunks), and the 16-bit logits they were cast
    from (half a chunk more). With grad: 4 chunks (the chunk recomputed in the backward with its gradient),
    and with more than one chunk each chunk's gradient of the head's weight is made whole before it is added
    to the one accumulated (4 x vocab x hidden more; not with LoRA, whose head is frozen). Measured on the
    CPU: benchmarks/single_device.py."""
    chunk = min(chunk_bytes, 4 * d.vocab * max(1, response_tokens))
    if not train:
        return chunk * (2 + (0.5 if compute_bytes < 4 else 0))
    several = 4 * d.vocab * response_tokens > chunk_bytes
    return chunk * 4 + (4 * d.vocab * d.hidden if several and head_trained else 0)


def full_logits_bytes(d: ModelDims, rows: int, response_len: int, compute_bytes: int, train: bool,
                      chunk_bytes: int = LOGITS_CHUNK_BYTES) -> float:
    """An FSDP2 root computes the head inside its forward (its parameters are gathered only there), over the
    rows' response positions: rows x (response + 1) x vocab in the compute dtype, and as much again for
    their gradient in the backward; the fp32 softmax is then chunked (one chunk's worth on top)."""
    logits = rows * (response_len + 1) * d.vocab * compute_bytes
    return logits * (2 if train else 1) + chunk_bytes * (2 if train else 1)


def kv_cache_bytes(d: ModelDims, rows: int, seq_len: int, compute_bytes: int) -> float:
    """The hf engine's KV cache: keys and values of every layer for rows x (prompt + response) tokens, 2 x
    layers x kv_heads x head_dim x bytes per token. The eager decode's DynamicCache appends by concatenation,
    so while a step appends one layer's keys (or values) exist twice: x (1 + 1 / (2 layers)); the static
    CUDA decode (engines/rollout/static_decode.py) preallocates its buffers, which the same figure bounds."""
    full = 2 * d.layers * d.kv_dim * compute_bytes * rows * seq_len
    return full * (1 + 1 / (2 * d.layers))


# keys up to which attention on the CPU in 16 bits runs as matmuls and keeps its probabilities for the backward
# (models/cpu_attention.py SHORT_KV, read without torch)
SHORT_KV = 128


def attention_probs_bytes(rows: int, heads: int, seq_len: int, layers: int) -> float:
    """The matmul attention's saved softmax: its fp32 output and the 16-bit probabilities the second matmul reads,
    [rows, heads, seq, seq] per layer."""
    return rows * heads * seq_len * seq_len * 6 * layers


# the static decode's decoders kept per engine (engines/rollout/static_decode.py StaticDecoders.KEEP, read without
# torch): a run's training and validation sampling
STATIC_DECODERS_KEPT = 2


def static_kv_bytes(d: ModelDims, rows: int, seq_len: int, compute_bytes: int) -> float:
    """One static decoder's K/V buffers: rows x (prompt + response) columns for every layer, allocated whole."""
    return 2 * d.layers * d.kv_dim * compute_bytes * rows * seq_len


def decode_logits_bytes(d: ModelDims, rows: int) -> float:
    """One decoding step's last-position logits in fp32 and their softmax (the hf engine samples all rows
    at once)."""
    return 2 * 4 * rows * d.vocab


def vllm_bytes(gpu_memory_utilization: float, device_bytes: float) -> float:
    """vLLM takes gpu_memory_utilization x the device's memory while awake (weights, activations, KV cache,
    its CUDA context), whatever the model."""
    return gpu_memory_utilization * device_bytes


def tokens_per_forward(rows: int, seq_len: int, budget: int | None) -> int:
    """Tokens of one forward: rows padded to prompt_len + max_new_tokens each, or, with a token budget
    (max_tokens_per_micro_batch), at most the budget (a row longer than it goes alone)."""
    full = rows * seq_len
    return full if not budget else min(full, max(budget, seq_len))


@dataclass(frozen=True)
class Layout:
    """How one worker group runs its models: backend (its name, for labels) and how it holds a model
    (`memory`, the backend's `engines/memory_model.py` kind: what the arithmetic reads), data/tensor/pipeline
    sizes, device kind, compute bytes."""
    backend: str
    memory: str
    dp: int
    tp: int = 1
    pp: int = 1
    kind: str = "gpu"
    dtype: str = "bfloat16"

    @property
    def compute_bytes(self) -> int:
        """Bytes of the dtype the engines compute in (autocast to it on the CPU too, over fp32 masters)."""
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def sharded(self) -> bool:
        """FSDP2 over a mesh of dp > 1 ranks (one rank runs the plain module under autocast)."""
        return self.memory == MM.SHARDED and self.dp > 1

    @property
    def autocast(self) -> bool:
        """fp32 masters computed in a 16-bit dtype under torch.autocast (torch, one-rank fsdp, mesh): the
        residual stream stays fp32 and autocast keeps a 16-bit copy of each weight while a forward's graph
        lives. FSDP2's MixedPrecisionPolicy and Megatron hold 16-bit parameters instead."""
        return self.compute_bytes < 4 and not self.sharded and self.memory != MM.MODEL_PARALLEL
