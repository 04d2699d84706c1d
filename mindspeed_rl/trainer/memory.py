"""The memory plan: what each device holds at each MFC, estimated before any worker starts.

A device's peak is the largest, over the MFCs that run on it, of what its engines hold while that MFC
runs: the engine running it holds its working set (activations, logits, a KV cache) on top of its state,
every other engine on the device holds what it keeps between its own MFCs (less what offload or vLLM's
sleep mode moves off). MFCs that share a device are taken to run one at a time, which a config that shares
a device must arrange anyway (vLLM sleep mode, offload).

The terms are small pure functions, each with its formula and source, so a figure can be checked by hand:
weights, gradients and AdamW state by dtype and shard (mixed precision: fp32 masters, fp32 gradients, two
fp32 moments, compute in `actor_config.dtype`), activations per micro-batch from the model's dimensions
(with or without activation checkpointing), the LM head's logits, the reference, and the rollout engine's
share. Model dimensions come from the model's config.json, else from the architectures this repository
ships (mindspeed_rl/models/configs/), and the estimate says which. docs/fitting.md reads a plan and lists
the knobs; benchmarks/single_device.py measures the terms against the CPU's peaks.

Which devices: with placement.mode=mesh each rank of a group sits on its own device of the group's mesh.
Otherwise a group whose actors ask for num_gpus (num_npus) >= 1 takes whole devices, ceil(share) per actor,
its engines on the actor's first one; groups asking for a fraction are colocated: actor k of every such group
shares the k-th of their common devices, which are numbered after the whole ones. CPU groups share the host.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
# fp32 logits of one chunk of the LM head (engines/train/torch_train.py LOGITS_CHUNK_BYTES, read without torch)
LOGITS_CHUNK_BYTES = 128 << 20
# a trainer process on an accelerator: the CUDA/CANN context, the collective's buffers, allocator slack.
# An allowance, not a measurement (vLLM's gpu_memory_utilization covers its own process)
CONTEXT_BYTES = 1.0 * GB
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


def _read_config(model_path: str) -> dict | None:
    """model_path's config.json (a built-in model's from the repository), or None."""
    from ..models import checkpoint as ck
    try:
        if ck.is_builtin(model_path):
            name = str(model_path)[len(ck.BUILTIN_PREFIX):]
            return json.loads((ck._CONFIG_DIR / ck._BUILTIN_CONFIGS[name]).read_text())
        return json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, KeyError, ValueError):
        return None


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
        c = _read_config(model_path)
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
    """The LM head a chunk of tokens at a time (engines/train/torch_train.py head_log_probs): at most
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


def full_logits_bytes(d: ModelDims, rows: int, response_len: int, compute_bytes: int, train: bool) -> float:
    """An FSDP2 root computes the head inside its forward (its parameters are gathered only there), over the
    rows' response positions: rows x (response + 1) x vocab in the compute dtype, and as much again for
    their gradient in the backward; the fp32 softmax is then chunked (one chunk's worth on top)."""
    logits = rows * (response_len + 1) * d.vocab * compute_bytes
    return logits * (2 if train else 1) + LOGITS_CHUNK_BYTES * (2 if train else 1)


def kv_cache_bytes(d: ModelDims, rows: int, seq_len: int, compute_bytes: int) -> float:
    """The hf engine's KV cache: keys and values of every layer for rows x (prompt + response) tokens, 2 x
    layers x kv_heads x head_dim x bytes per token. The eager decode's DynamicCache appends by concatenation,
    so while a step appends one layer's keys (or values) exist twice: x (1 + 1 / (2 layers)); the static
    CUDA decode (engines/rollout/static_decode.py) preallocates its buffers, which the same figure bounds."""
    full = 2 * d.layers * d.kv_dim * compute_bytes * rows * seq_len
    return full * (1 + 1 / (2 * d.layers))


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


# ---------------------------------------------------------------------------- engines and devices
def fmt_bytes(b: float) -> str:
    """GB with one decimal from 1 GB up, MB below (the CPU's tiny models)."""
    return f"{b / GB:.1f} GB" if b >= GB else f"{b / 1e6:.0f} MB" if b >= 1e6 else f"{b / 1e6:.2f} MB"


@dataclass
class Term:
    """One figure of an estimate: what it is, its bytes, how it is computed, the keys that shrink it."""
    name: str
    bytes: float
    how: str = ""
    knobs: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"name": self.name, "gb": round(self.bytes / GB, 3), "how": self.how, "knobs": list(self.knobs)}


@dataclass
class Load:
    """One engine's bytes on one device: `idle` while an MFC of another engine runs there, `busy[mfc]` while
    its own MFC runs (its state and that MFC's working set)."""
    engine: str
    idle: list[Term]
    busy: dict[str, list[Term]]


@dataclass
class DeviceEstimate:
    """Devices with the same engines on them (the same estimate), the phase of their peak and its terms."""
    kind: str
    ids: list[int]
    groups: list[str]
    capacity: float | None               # bytes; None: not checked
    phases: dict[str, list[Term]] = field(default_factory=dict)   # MFC -> every term on the device then

    def peak(self) -> tuple[str, float, list[Term]]:
        if not self.phases:
            return "-", 0.0, []
        mfc = max(self.phases, key=lambda m: sum(t.bytes for t in self.phases[m]))
        terms = sorted(self.phases[mfc], key=lambda t: -t.bytes)
        return mfc, sum(t.bytes for t in terms), terms

    @property
    def label(self) -> str:
        if self.kind == "cpu" and self.ids == [-1]:
            return "cpu (host)"
        from ..parallel import format_ids
        return f"{self.kind} {format_ids(self.ids)}"

    @property
    def over(self) -> bool:
        return self.capacity is not None and self.peak()[1] > self.capacity

    def summary(self) -> str:
        """One line: the devices, their groups, the peak against the capacity, its MFC and its terms (terms
        of one name summed: each process on the device has its own context)."""
        mfc, total, terms = self.peak()
        cap = (f" of {self.capacity / GB:.0f} GB" if self.capacity is not None else " (not checked)")
        each = " each" if len(self.ids) > 1 else ""
        named: dict[str, float] = {}
        for t in terms:
            named[t.name] = named.get(t.name, 0.0) + t.bytes
        top = ", ".join(f"{n} {fmt_bytes(b)}" for n, b in sorted(named.items(), key=lambda kv: -kv[1])
                        if b >= 0.01 * total and b > 0)
        flag = "  OVER" if self.over else ""
        return (f"memory {self.label} ({', '.join(self.groups)}): peak {fmt_bytes(total)}{each}{cap} "
                f"at {mfc}: {top or 'nothing'}{flag}")

    def as_dict(self) -> dict:
        mfc, total, terms = self.peak()
        return {"kind": self.kind, "devices": self.ids, "groups": self.groups,
                "capacity_gb": None if self.capacity is None else self.capacity / GB,
                "peak_gb": round(total / GB, 3), "peak_at": mfc, "over": self.over,
                "phases": {m: {"total_gb": round(sum(t.bytes for t in ts) / GB, 3), "terms": [t.as_dict() for t in ts]}
                           for m, ts in self.phases.items()}}


@dataclass
class MemoryPlan:
    devices: list[DeviceEstimate]
    sources: dict[str, str]             # model -> where its dimensions came from
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        src = "; ".join(f"{m}: {s}" for m, s in self.sources.items())
        out = [f"memory plan (estimate; docs/fitting.md), model dimensions from {src or 'nowhere'}"]
        out += [d.summary() for d in self.devices]
        return out + [f"memory plan: {n}" for n in self.notes]

    def as_dict(self) -> dict:
        return {"sources": dict(self.sources), "devices": [d.as_dict() for d in self.devices],
                "notes": list(self.notes)}

    def over(self) -> list[DeviceEstimate]:
        return [d for d in self.devices if d.over]


# ---------------------------------------------------------------------------- from the plan to the devices
@dataclass(frozen=True)
class Layout:
    """How one worker group runs its models: backend, data/tensor/pipeline sizes, device kind, compute bytes."""
    backend: str
    dp: int
    tp: int = 1
    pp: int = 1
    kind: str = "gpu"
    dtype: str = "bfloat16"

    @property
    def compute_bytes(self) -> int:
        """The CPU computes in fp32 whatever the dtype (the engines' rule)."""
        return 4 if self.kind == "cpu" else DTYPE_BYTES.get(self.dtype, 4)

    @property
    def sharded(self) -> bool:
        """FSDP2 over a mesh of dp > 1 ranks (one rank runs the plain module under autocast)."""
        return self.backend == "fsdp" and self.dp > 1

    @property
    def autocast(self) -> bool:
        """fp32 masters computed in a 16-bit dtype under torch.autocast (torch, one-rank fsdp, mesh): the
        residual stream stays fp32 and autocast keeps a 16-bit copy of each weight while a forward's graph
        lives. FSDP2's MixedPrecisionPolicy and Megatron hold 16-bit parameters instead."""
        return self.compute_bytes < 4 and not self.sharded and self.backend != "megatron"




def _state_terms(d: ModelDims, lay: Layout, who: str, section: str, head: str, trained: bool,
                 n_micro: int, lora_rank: int, lora_targets, offload: dict) -> tuple[list[Term], list[Term], list[Term]]:
    """(weights, gradients, optimizer) terms of one engine on one device, per the backend's layout."""
    c, s = lay.compute_bytes, lay.tp * lay.pp
    p = d.params(head)
    dp_shard = lay.dp if lay.sharded else 1
    more_dp = ("more dp (fsdp shards the states over its dp ranks)" if lay.backend == "fsdp" else
               "actor_config.backend=fsdp with more dp (it shards the states)")
    if not trained:
        return [Term(f"{who} weights", state_bytes(p, c, s * dp_shard), f"{p / 1e9:.2f}B x {c} B / {s * dp_shard}",
                     (f"{'ref_config' if who == 'ref' else section}.offload", more_dp))], [], []
    lora = lora_params(d, lora_rank, lora_targets) if lora_rank else 0
    trainable = lora or p
    w_knobs = (f"{section}.offload.params (off the device between its stages)", f"{section}.lora.rank (a frozen "
               f"16-bit base, only adapters train)" if section == "actor_config" else "", more_dp,
               f"{section}.offload.fsdp_cpu_offload (the sharded states on the CPU)" if lay.sharded else "")
    w_knobs = tuple(k for k in w_knobs if k)
    if lay.backend == "megatron":
        dist_opt = True
        weights = [Term(f"{who} weights", state_bytes(p, c, s) + state_bytes(p, 4, s * (lay.dp if dist_opt else 1)),
                        f"{p / 1e9:.2f}B x ({c} B / {s} + 4 B fp32 masters / {s * lay.dp})", w_knobs)]
        grads = [Term(f"{who} grads", state_bytes(p, 4, s), f"{p / 1e9:.2f}B x 4 B / {s} (fp32 main grads)",
                      ("more tp/pp",))]
        opt = [Term(f"{who} optimizer", state_bytes(p, 8, s * lay.dp), f"{p / 1e9:.2f}B x 8 B / {s * lay.dp}",
                    (f"{section}.offload.optimizer", "more dp"))]
        return weights, grads, opt
    if lora:
        base = p
        weights = [Term(f"{who} weights", state_bytes(base, c, s * dp_shard) + state_bytes(lora, 4, s * dp_shard),
                        f"base {base / 1e9:.2f}B x {c} B + adapters {lora / 1e6:.0f}M x 4 B, / {s * dp_shard}", w_knobs)]
    else:
        weights = [Term(f"{who} weights", state_bytes(p, 4, s * dp_shard), f"{p / 1e9:.2f}B x 4 B / {s * dp_shard}",
                        w_knobs)]
    accumulate = lay.sharded and n_micro > 1
    g_shard = 1 if accumulate else s * dp_shard
    g_how = (f"{trainable / 1e9:.3f}B x 4 B unsharded: FSDP2 accumulates {n_micro} micro-batches without "
             f"reduce-scatter" if accumulate else f"{trainable / 1e9:.3f}B x 4 B / {g_shard}")
    g_knobs = ((f"{section}.lora.rank (a frozen 16-bit base, only adapters train)",) if section == "actor_config"
               else ()) + (() if accumulate else (more_dp,))
    grads = [Term(f"{who} grads", state_bytes(trainable, 4, g_shard), g_how, g_knobs)]
    if lay.backend == "torch" and lay.dp > 1:
        grads.append(Term(f"{who} DDP buckets", state_bytes(trainable, 4), f"{trainable / 1e9:.3f}B x 4 B",
                          ("actor_config.backend=fsdp",)))
    opt = [Term(f"{who} optimizer", state_bytes(trainable, 8, s * dp_shard),
                f"{trainable / 1e9:.3f}B x 2 x 4 B / {s * dp_shard}",
                tuple(k for k in (f"{section}.offload.optimizer (off the device between train stages)",
                                  f"{section}.lora.rank (a frozen 16-bit base, only adapters train)"
                                  if section == "actor_config" else "", more_dp,
                                  f"{section}.offload.fsdp_cpu_offload (the sharded states on the CPU)"
                                  if lay.sharded else "") if k))]
    if offload.get("fsdp_cpu_offload"):
        weights = [Term(t.name, 0.0, "on the CPU (fsdp_cpu_offload)") for t in weights]
        opt = [Term(t.name, 0.0, "on the CPU (fsdp_cpu_offload)") for t in opt]
        if not accumulate:
            grads = [Term(t.name, 0.0, "on the CPU (fsdp_cpu_offload)") for t in grads]
    return weights, grads, opt


def _compute_copy(d: ModelDims, lay: Layout, who: str, head: str, trainable: int) -> list[Term]:
    """16-bit copies of fp32 weights while a forward's graph lives: autocast caches each weight's cast
    (trainable x c), an FSDP2 mesh gathers the root (embeddings, head) and about two layers at a time."""
    c = lay.compute_bytes
    if c >= 4:
        return []
    if lay.sharded:
        root = d.params(head) - d.layers * d.layer_params()
        n = root + 2 * d.layer_params()
        return [Term(f"{who} gathered weights", n * c, f"(root {root / 1e9:.2f}B + 2 layers) x {c} B",
                     ("actor_config.backend_options.reshard_after_forward",))]
    if lay.autocast:
        return [Term(f"{who} autocast weights", trainable * c / (lay.tp * lay.pp),
                     f"{trainable / 1e9:.3f}B x {c} B", ("actor_config.lora.rank",))]
    return []


def _activations(d: ModelDims, lay: Layout, who: str, section: str, rows: int, n_micro: int, seq_len: int,
                 budget: int | None, checkpointing: bool, lora_rank: int, rows_key: str,
                 logits_bytes: float) -> list[Term]:
    """The activations a micro-batch keeps for its backward, and with checkpointing the recomputed layer's
    excess over the head's working set (the two live one after the other)."""
    tokens = tokens_per_forward(rows, seq_len, budget)
    layers = math.ceil(d.layers / lay.pp)
    in_flight = min(lay.pp, max(1, n_micro)) if lay.pp > 1 else 1
    b = train_activation_bytes(d, tokens, lay.compute_bytes, lay.autocast, checkpointing, layers, lora_rank)
    b = b * in_flight / lay.tp
    how = (f"{tokens} tokens ({rows} rows x {seq_len}{f', budget {budget}' if budget else ''}) x {layers} layers"
           f"{' in flight x ' + str(in_flight) if in_flight > 1 else ''}{f' / tp {lay.tp}' if lay.tp > 1 else ''}, "
           f"checkpointing {'on' if checkpointing else 'off'}")
    knobs = (() if checkpointing else (f"{section}.gradient_checkpointing=true",)) + (
        f"a smaller {rows_key} (now {rows})",
        f"a smaller {section}.max_tokens_per_micro_batch (now {budget})" if budget else
        f"{section}.max_tokens_per_micro_batch (a token budget per forward)")
    out = [Term(f"{who} activations", b, how, knobs)]
    if checkpointing:
        layer = recompute_bytes(d, tokens, lay.compute_bytes, lay.autocast, lora_rank) / lay.tp
        out.append(Term(f"{who} recompute", max(0.0, layer - logits_bytes),
                        f"one layer recomputed ({layer / GB:.2f} GB) beyond the head's working set "
                        f"({logits_bytes / GB:.2f} GB)", knobs[:2]))
    return out


def _logits(d: ModelDims, lay: Layout, who: str, rows: int, seq_len: int, response_len: int, budget: int | None,
            train: bool, rows_key: str, head_trained: bool = True) -> Term:
    rows_fwd = max(1, tokens_per_forward(rows, seq_len, budget) // seq_len)
    if lay.sharded:
        b = full_logits_bytes(d, rows_fwd, response_len, lay.compute_bytes, train)
        how = f"{rows_fwd} rows x {response_len + 1} x {d.vocab} x {lay.compute_bytes} B{' x 2 (grad)' if train else ''}"
    elif lay.backend == "megatron":
        b = full_logits_bytes(d, rows_fwd, seq_len, lay.compute_bytes + 4, train) / lay.tp
        how = f"{rows_fwd} rows x {seq_len} x {d.vocab} / tp {lay.tp}, 16-bit + fp32"
    else:
        b = chunked_logits_bytes(d, rows_fwd * response_len, train, lay.compute_bytes, head_trained)
        how = f"chunks of {LOGITS_CHUNK_BYTES >> 20} MiB fp32" + (
            "" if not train else " x 4, the head's gradient once more" if head_trained else " x 4")
    return Term(f"{who} logits", b, how, (f"a smaller {rows_key} (now {rows})",
                                           "actor_config.max_tokens_per_micro_batch (a token budget per forward)"))


def _infer_working_set(d: ModelDims, lay: Layout, who: str, rows: int, seq_len: int, response_len: int,
                       budget: int | None, head: str, rows_key: str, lora: bool = False) -> list[Term]:
    tokens = tokens_per_forward(rows, seq_len, budget)
    layers = inference_activation_bytes(d, tokens, lay.compute_bytes, lora) / lay.tp
    logits = _logits(d, lay, who, rows, seq_len, response_len, budget, False, rows_key).bytes if head == "lm" else 0.0
    b = log_prob_pass_bytes(layers, logits, tokens, d, lay.compute_bytes)
    return [Term(f"{who} forward", b, f"{tokens} tokens: the larger of one layer's working set "
                 f"({layers / GB:.2f} GB) and the head's ({logits / GB:.2f} GB), over the hidden states",
                 (f"a smaller {rows_key} (now {rows})",
                  "actor_config.max_tokens_per_micro_batch (a token budget per forward)"))]


def _reduced(grads: list[Term], d: ModelDims, lay: Layout, trainable: int) -> list[Term]:
    """The gradients at the optimizer step: FSDP2 has reduce-scattered what it accumulated unsharded."""
    if not lay.sharded:
        return grads
    shards = lay.dp * lay.tp * lay.pp
    return [Term(t.name, state_bytes(trainable, 4, shards), f"{trainable / 1e9:.3f}B x 4 B / {shards}", t.knobs)
            if t.name.endswith(" grads") else t for t in grads]


def _step_term(d: ModelDims, lay: Layout, who: str, trainable: int, lora_rank: int) -> Term:
    foreach = lay.kind != "cpu"
    shards = lay.tp * lay.pp * (lay.dp if lay.sharded else 1)
    largest = (max(lora_rank * max(a, b) for a, b in d.linear_shapes().values()) if lora_rank else
               max(d.vocab * d.hidden, max(a * b for a, b in d.linear_shapes().values())))
    return Term(f"{who} optimizer step", optimizer_step_bytes(trainable, shards, foreach, largest),
                f"{'foreach: 4 B x ' + format(trainable / 1e9, '.3f') + 'B / ' + str(shards) if foreach else 'per tensor: 2 x 4 B x ' + format(largest / 1e6, '.0f') + 'M'}",
                ("actor_config.offload.optimizer",))


def _running(terms: list[Term]) -> list[Term]:
    """The terms of an engine while its own MFC runs: moving state off between stages does not shrink them."""
    return [Term(t.name, t.bytes, t.how, tuple(k for k in t.knobs if not (".offload." in k and "fsdp_cpu" not in k)
                                              and not k.endswith(".offload")))
            for t in terms]


def _off(terms: list[Term], why: str) -> list[Term]:
    return [Term(t.name, 0.0, why, t.knobs) for t in terms]


def _model_load(cfg, d: ModelDims, lay: Layout, model: str, kind: str, mfcs: list, trained: bool, rows_per_step: int,
                lora_shared_ref: bool) -> Load:
    """The Load of one model engine of a worker group: a trained policy/critic/reward model or an inference
    one (the reference, a reader of a model trained elsewhere, a reward model)."""
    from ..config.sizes import train_sizes
    from ..dataflow.mfc import InterfaceType
    rl, a = cfg.rl_config, cfg.actor_config
    seq_len = cfg.data.max_prompt_length + cfg.generate_config.max_new_tokens
    resp = cfg.generate_config.max_new_tokens
    head = "lm" if kind == "policy" else "value"
    if kind == "value":
        section, sec = "critic_config", cfg.critic_config
    elif kind == "reward":
        section, sec = "reward_model", cfg.reward_model
    else:
        section, sec = "actor_config", a
    budget = getattr(sec, "max_tokens_per_micro_batch", None) if kind != "reward" else None
    if model == "ref":
        budget = a.max_tokens_per_micro_batch
    lora_rank = a.lora.rank if (kind == "policy" and model == "actor" and trained) else 0
    offload = {}
    if trained and hasattr(sec, "offload") and not isinstance(sec.offload, bool):
        offload = {k: getattr(sec.offload, k) for k in ("params", "optimizer", "fsdp_cpu_offload")}
    who = model
    per_dev = max(1, rows_per_step // lay.dp)
    micro_rows, n_micro = 1, 1
    if trained:
        if kind == "reward":
            micro_rows = 2 * cfg.reward_model.micro_batch_size_per_device
            n_micro = 1
        else:
            s = train_sizes(sec.ppo_mini_batch_size, sec.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                            rl.n_samples_per_prompt, lay.dp)
            micro_rows, n_micro = s.micro_rows, max(1, s.mini_rows_per_device // s.micro_rows)
    weights, grads, opt = _state_terms(d, lay, who, section, head, trained, n_micro, lora_rank,
                                       a.lora.target_modules, offload)
    if lora_shared_ref:
        weights = [Term(f"{who} weights", 0.0, "the actor's base with adapters off (LoRA): no copy")]
    trainable = (lora_params(d, lora_rank, a.lora.target_modules) if lora_rank else d.params(head))
    copy = _compute_copy(d, lay, who, head, trainable if trained else 0) if (trained or lay.sharded) else []
    if not trained and lay.sharded:
        copy = [Term(t.name, (d.params(head) - (d.layers - 2) * d.layer_params()) * lay.compute_bytes, t.how, t.knobs)
                for t in copy]
    ref_offload = model == "ref" and cfg.ref_config.offload
    idle = (_off(weights, "offloaded between its passes") if (offload.get("params") or ref_offload) else weights)
    idle = idle + (_off(opt, "offloaded between train stages") if offload.get("optimizer") else opt)
    busy: dict[str, list[Term]] = {}
    for m in mfcs:
        it = InterfaceType(m.interface_type)
        if it is InterfaceType.TRAIN_STEP:
            rows_key = (f"{section}.ppo_micro_batch_size_per_device" if kind != "reward"
                        else "reward_model.micro_batch_size_per_device")
            logits = (_logits(d, lay, who, micro_rows, seq_len, resp, budget, True, rows_key, not lora_rank)
                      if head == "lm" else None)
            terms = weights + grads + opt + copy + _activations(
                d, lay, who, section, micro_rows, n_micro, seq_len, budget,
                bool(getattr(sec, "gradient_checkpointing", False)), lora_rank, rows_key,
                logits.bytes if logits else 0.0) + ([logits] if logits else [])
            busy[m.name] = _running(terms)
            if lay.backend != "megatron" and not offload.get("fsdp_cpu_offload"):
                busy[f"{m.name} (optimizer step)"] = _running(weights + _reduced(grads, d, lay, trainable) + opt + [
                    _step_term(d, lay, who, trainable, lora_rank)])
            continue
        else:
            if model == "ref":
                rows_key, rows = ("ref_config.log_prob_micro_batch_size_per_device",
                                  cfg.ref_config.log_prob_micro_batch_size_per_device)
            elif kind == "value":
                rows_key, rows = ("critic_config.forward_micro_batch_size_per_device",
                                  cfg.critic_config.forward_micro_batch_size_per_device)
            elif kind == "reward":
                rows_key, rows = ("reward_model.micro_batch_size_per_device", cfg.reward_model.micro_batch_size_per_device)
            else:
                rows_key, rows = ("actor_config.log_prob_micro_batch_size_per_device",
                                  a.log_prob_micro_batch_size_per_device)
            rows = min(rows, per_dev)
            kept_opt = _off(opt, "offloaded between train stages") if offload.get("optimizer") else opt
            terms = weights + kept_opt + copy + _infer_working_set(d, lay, who, rows, seq_len, resp, budget, head,
                                                                   rows_key, lora=bool(lora_rank))
        busy[m.name] = _running(terms)
    label = f"{model} ({lay.backend}{f' dp {lay.dp}' if lay.dp > 1 else ''}{f' tp {lay.tp}' if lay.tp > 1 else ''}" \
            f"{f' pp {lay.pp}' if lay.pp > 1 else ''})"
    return Load(label, idle, busy)


def _rollout_load(cfg, d: ModelDims | None, lay: Layout, backend: str, mfcs: list, rows_per_step: int,
                  capacity: float | None) -> Load:
    """The rollout engine: vLLM's share of the device (none while asleep), or the hf engine's weights and
    its KV cache for the rows of one generate call."""
    g = cfg.generate_config
    names = [m.name for m in mfcs]
    if backend == "simulate":
        return Load("rollout (no model)", [], {n: [] for n in names})
    if backend == "vllm":
        v = g.vllm
        if lay.kind != "cpu" and capacity is not None:
            awake = Term("vLLM", vllm_bytes(v.gpu_memory_utilization, capacity),
                         f"gpu_memory_utilization {v.gpu_memory_utilization:g} x {capacity / GB:.0f} GB",
                         ("generate_config.vllm.gpu_memory_utilization", "generate_config.vllm.enable_sleep_mode"))
        else:
            w = d.params() * DTYPE_BYTES.get(cfg.actor_config.dtype, 4) if d else 0.0
            awake = Term("vLLM", v.kv_cache_gb * (1 << 30) + w, f"kv_cache_gb {v.kv_cache_gb:g} GiB + weights",
                         ("generate_config.vllm.kv_cache_gb",))
        asleep = (Term("vLLM (asleep)", 0.0, f"sleep level {v.sleep_level}: weights "
                       f"{'to the CPU' if v.sleep_level == 1 else 'dropped'}, KV cache dropped",
                       awake.knobs) if v.enable_sleep_mode else awake)
        return Load("rollout (vllm)", [asleep], {n: [awake] for n in names})
    if d is None:
        return Load(f"rollout ({backend})", [], {n: [] for n in names})
    from ..config.sizes import group_rows
    c = lay.compute_bytes if lay.kind == "cpu" else DTYPE_BYTES.get(cfg.actor_config.dtype, 4)
    s = lay.tp * lay.pp
    rows = min(group_rows(g.micro_batch_size_per_device, cfg.rl_config.n_samples_per_prompt) or 1,
               max(1, rows_per_step // lay.dp))
    seq = cfg.data.max_prompt_length + g.max_new_tokens
    weights = Term("rollout weights", state_bytes(d.params(), c, s), f"{d.params() / 1e9:.2f}B x {c} B / {s}",
                   ("generate_config.backend=vllm with enable_sleep_mode",))
    kv = Term("rollout KV cache", kv_cache_bytes(d, rows, seq, c) / lay.tp,
              f"{rows} rows x {seq} tokens x {d.layers} layers x 2 x {d.kv_dim} x {c} B",
              ("generate_config.micro_batch_size_per_device", "generate_config.max_new_tokens"))
    work = Term("rollout forward", inference_activation_bytes(d, rows * cfg.data.max_prompt_length, c) / lay.tp
                + decode_logits_bytes(d, rows), "the prompt's prefill, one layer, and a step's logits",
                ("generate_config.micro_batch_size_per_device",))
    return Load(f"rollout ({backend})", [weights], {n: [weights, kv, work] for n in names})


def _group_kind(cfg, p) -> str:
    from ..device import device_spec
    dev = p.resources.device
    if dev == "auto":
        return device_spec(cfg.placement.device_kind).name
    return device_spec(dev).name


def group_loads(cfg, p, model_kinds: dict[str, str], dims: dict[str, ModelDims | None], rows_per_step: int,
                capacity: float | None, lora_shared: bool) -> list[Load]:
    """Every engine Load of one worker group's rank, plus the trainer process's context on an accelerator."""
    from ..dataflow.mfc import InterfaceType
    kind = _group_kind(cfg, p)
    loads: list[Load] = []
    gens = [m for m in p.mfcs if InterfaceType(m.interface_type) is InterfaceType.GENERATE]
    if gens:
        lay = Layout(p.rollout_backend or cfg.generate_config.backend, p.resources.dp, p.tp, p.pp, kind,
                     cfg.actor_config.dtype)
        loads.append(_rollout_load(cfg, dims.get("actor"), lay, lay.backend, gens, rows_per_step, capacity))
    by_model: dict[str, list] = {}
    for m in p.mfcs:
        if model_kinds.get(m.name) in ("policy", "value", "reward"):
            by_model.setdefault(m.model_name, []).append(m)
    for model, mfcs in by_model.items():
        d = dims.get(model)
        if d is None:
            continue
        kind_ = model_kinds[mfcs[0].name]
        trained = any(InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP for m in mfcs)
        dtype = cfg.reward_model.dtype if kind_ == "reward" else cfg.actor_config.dtype
        backend = p.train_backend or cfg.actor_config.backend
        if kind_ == "reward" and cfg.reward_model.backend:
            backend = cfg.reward_model.backend
        lay = Layout(backend, p.resources.dp, p.tp, p.pp, kind, dtype)
        if backend == "simulate":
            continue
        shared = lora_shared and model == "ref" and "actor" in by_model
        loads.append(_model_load(cfg, d, lay, model, kind_, mfcs, trained, rows_per_step, shared))
    if by_model and kind != "cpu":
        ctx = Term("context", CONTEXT_BYTES, "CUDA/CANN context, collective buffers (allowance)", ())
        loads.append(Load("process", [ctx], {}))
    return loads


def _placements(cfg, groups: dict) -> dict[tuple[str, int], list[str]]:
    """(device kind, device id) -> the groups with a rank there; id -1: the host (CPU groups off a mesh)."""
    from ..device import accelerator_share
    out: dict[tuple[str, int], list[str]] = {}
    shared: list[tuple[str, object]] = []
    nxt: dict[str, int] = {}
    for g, p in groups.items():
        kind = _group_kind(cfg, p)
        if p.devices:       # placement.mode=mesh: one rank per device of the group's mesh
            for dev in p.devices:
                out.setdefault((kind, dev), []).append(g)
            nxt[kind] = max(nxt.get(kind, 0), max(p.devices) + 1)
    for g, p in groups.items():
        if p.devices:
            continue
        kind = _group_kind(cfg, p)
        if kind == "cpu":
            out.setdefault(("cpu", -1), []).append(g)
            continue
        share = accelerator_share(p.resources)
        if share >= 1:
            for _ in range(p.resources.dp):
                out.setdefault((kind, nxt.get(kind, 0)), []).append(g)
                nxt[kind] = nxt.get(kind, 0) + math.ceil(share)
        else:
            shared.append((g, p))
    base = dict(nxt)
    for g, p in shared:
        kind = _group_kind(cfg, p)
        for k in range(p.resources.dp):
            out.setdefault((kind, base.get(kind, 0) + k), []).append(g)
    return out


def estimate_memory(cfg, groups: dict, model_kinds: dict[str, str], model_paths: dict[str, str],
                    rows_per_step: int) -> MemoryPlan:
    """The plan's memory estimate per device (see the module's docstring). Raises ValueError for an
    actor_config.model_config that names no readable config."""
    from ..dataflow.mfc import InterfaceType
    from ..device.kinds import device_memory_gb
    dims: dict[str, ModelDims | None] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    models = {m.model_name for p in groups.values() for m in p.mfcs
              if model_kinds.get(m.name) in ("policy", "value", "reward", "rollout")}
    for model in sorted(models):
        path = model_paths.get(model) or model_paths.get("actor")
        same = path == model_paths.get("actor") and model in ("actor", "ref", "critic")
        d, src = load_dims(path, cfg.actor_config.model_config if same else None)
        dims[model] = d
        if d is None:
            notes.append(f"no dimensions for {model} ({path!r}): not estimated; set actor_config.model_config to a "
                         f"config.json or one of {sorted(SHIPPED)}")
        elif not sources or src not in sources.values():
            sources[model] = src
        else:
            sources[model] = "as " + next(m for m, s in sources.items() if s == src)
    trains_actor = {g for g, p in groups.items() for m in p.mfcs
                    if m.model_name == "actor" and InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP}
    lora_shared = bool(cfg.actor_config.lora.rank) and not cfg.ref_config.model_path
    per_group: dict[str, list[Load]] = {}
    for g, p in groups.items():
        kind = _group_kind(cfg, p)
        cap_gb = device_memory_gb(kind, cfg.placement.device_memory_gb)
        cap = cap_gb * GB if cap_gb is not None else None
        per_group[g] = group_loads(cfg, p, model_kinds, dims, rows_per_step, cap, lora_shared and g in trains_actor)
    by_devices: dict[tuple, list[int]] = {}
    for (kind, dev), gs in sorted(_placements(cfg, groups).items()):
        gs = [g for g in gs if per_group.get(g)]
        if gs:
            by_devices.setdefault((kind, tuple(gs)), []).append(dev)
    devices = []
    for (kind, gs), ids in by_devices.items():
        cap_gb = device_memory_gb(kind, cfg.placement.device_memory_gb)
        est = DeviceEstimate(kind, ids, list(gs), cap_gb * GB if cap_gb is not None else None)
        loads = [ld for g in gs for ld in per_group[g]]
        phases = [m for ld in loads for m in ld.busy]
        for mfc in dict.fromkeys(phases):
            est.phases[mfc] = [t for ld in loads for t in (ld.busy[mfc] if mfc in ld.busy else ld.idle)]
        devices.append(est)
    return MemoryPlan(devices, sources, notes)


def refusal(cfg, plan: MemoryPlan) -> str | None:
    """The one-line message for the first device over its memory (None when all fit): the device, its groups,
    the phase of its peak, the biggest terms with the keys that shrink them."""
    over = plan.over()
    if not over:
        return None
    dev = over[0]
    mfc, total, terms = dev.peak()
    top = terms[:3]
    knobs: dict[str, str] = {}
    for k in (k for t in top for k in t.knobs):
        knobs.setdefault(k.split(" ")[0], k)    # one hint per key (the first term's wording)
    knobs = list(knobs.values())
    cap_key = ("placement.device_memory_gb" if cfg.placement.device_memory_gb is not None else
               f"placement.device_memory_gb=null: the {dev.kind} default")
    return (f"placement: the memory plan puts {total / GB:.1f} GB on {dev.label} ({', '.join(dev.groups)}) at {mfc}, "
            f"over its {dev.capacity / GB:.0f} GB ({cap_key}); the biggest terms: "
            + "; ".join(f"{t.name} {t.bytes / GB:.1f} GB ({t.how})" for t in top)
            + f"; to shrink them: {'; '.join(knobs)}; or more devices. placement.check_memory=false runs it anyway "
              "(docs/fitting.md)")


def plan_memory(cfg, groups: dict, model_kinds: dict[str, str], model_paths: dict[str, str],
                rows_per_step: int) -> MemoryPlan:
    """make_plan's step: the estimate, refused (ConfigError, one line) when a device is over its memory and
    placement.check_memory is on, else kept with a warning note."""
    from ..config import ConfigError
    try:
        est = estimate_memory(cfg, groups, model_kinds, model_paths, rows_per_step)
    except ValueError as e:
        raise ConfigError(f"actor_config.model_config={cfg.actor_config.model_config!r}: {e}") from None
    message = refusal(cfg, est)
    if message and cfg.placement.check_memory:
        raise ConfigError(message)
    if message:
        est.notes.append(f"WARNING (placement.check_memory=false): {message}")
    return est
