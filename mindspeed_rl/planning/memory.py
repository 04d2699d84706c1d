"""The plan's memory stage: what each device holds at each MFC, estimated before any worker starts, so a
config that cannot fit is refused naming the device, the biggest terms and the keys that shrink them.

A device's peak is the largest, over the MFCs that run on it, of what its engines hold while that MFC
runs: the engine running it holds its working set (activations, logits, a KV cache) on top of its state,
every other engine on the device holds what it keeps between its own MFCs (less what offload or vLLM's
sleep mode moves off). MFCs that share a device are taken to run one at a time, which a config that shares
a device must arrange anyway (vLLM sleep mode, offload). The host is the exception: it holds every process
of the run, and with rl_config.blocking false the stages of one worker process compute at once
(`_host_phases`).

Which devices: with placement.mode=mesh each rank of a group sits on its own device of the group's mesh.
Otherwise a group whose actors ask for num_gpus (num_npus) >= 1 takes whole devices, ceil(share) per actor,
its engines on the actor's first one; groups asking for a fraction are colocated: actor k of every such group
shares the k-th of their common devices, which are numbered after the whole ones. CPU groups share the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ActorConfig, ConfigError, DataConfig, GenerateConfig, PlacementConfig, RLConfig
from ..engines import memory_model as MM
from ..engines.registry import rollout_backend, train_backend
from .memory_terms import (CONTEXT_BYTES, DOCK_BYTES, DRIVER_BYTES, DTYPE_BYTES, GB, HOST_PROCESS_BYTES,
                           RAY_PROCESSES_BYTES, SHIPPED, SHORT_KV, STATIC_DECODERS_KEPT, Layout, ModelDims,
                           attention_probs_bytes, chunked_logits_bytes, decode_logits_bytes, full_logits_bytes, inference_activation_bytes,
                           kv_cache_bytes, load_dims, log_prob_pass_bytes, logits_chunk_bytes, lora_params,
                           optimizer_step_bytes, recompute_bytes, state_bytes, static_kv_bytes, tokens_per_forward,
                           train_activation_bytes, vllm_bytes)
from .keys import (ACTOR, LORA_RANK_KEY, REWARD_SECTION, ROLLOUT_BACKEND_KEY, ROLLOUT_MICRO_BATCH_KEY, SECTION_OF,
                   TOKEN_BUDGET_KEY, TRAIN_BACKEND_KEY)
from .models import ModelSections

DEVICE_MEMORY_KEY = "placement.device_memory_gb"
CHECK_MEMORY_KEY = "placement.check_memory"
MODEL_CONFIG_KEY = f"{ACTOR}.model_config"
REWARD_ROWS_KEY = f"{REWARD_SECTION}.micro_batch_size_per_device"


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
    """The memory stage's result: per set of devices with the same engines, the estimate of every phase."""
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
def _state_terms(d: ModelDims, lay: Layout, who: str, section: str, head: str, trained: bool,
                 lora_rank: int, lora_targets, offload: dict) -> tuple[list[Term], list[Term], list[Term]]:
    """(weights, gradients, optimizer) terms of one engine on one device, per the backend's layout."""
    c, s = lay.compute_bytes, lay.tp * lay.pp
    p = d.params(head)
    dp_shard = lay.dp if lay.sharded else 1
    more_dp = ("more dp (fsdp shards the states over its dp ranks)" if lay.memory == MM.SHARDED else
               f"{TRAIN_BACKEND_KEY}=fsdp with more dp (it shards the states)")
    if not trained:
        return [Term(f"{who} weights", state_bytes(p, c, s * dp_shard), f"{p / 1e9:.2f}B x {c} B / {s * dp_shard}",
                     (f"{'ref_config' if who == 'ref' else section}.offload", more_dp))], [], []
    lora = lora_params(d, lora_rank, lora_targets) if lora_rank else 0
    trainable = lora or p
    w_knobs = (f"{section}.offload.params (off the device between its stages)", f"{section}.lora.rank (a frozen "
               f"16-bit base, only adapters train)" if section == ACTOR else "", more_dp,
               f"{section}.offload.fsdp_cpu_offload (the sharded states on the CPU)" if lay.sharded else "")
    w_knobs = tuple(k for k in w_knobs if k)
    if lay.memory == MM.MODEL_PARALLEL:
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
    g_shard = s * dp_shard   # FSDP2 reduce-scatters each micro-batch's gradients: a rank accumulates its shard
    g_how = f"{trainable / 1e9:.3f}B x 4 B / {g_shard}"
    g_knobs = ((f"{section}.lora.rank (a frozen 16-bit base, only adapters train)",) if section == ACTOR
               else ()) + (more_dp,)
    grads = [Term(f"{who} grads", state_bytes(trainable, 4, g_shard), g_how, g_knobs)]
    if lay.memory == MM.REPLICATED and lay.dp > 1:
        grads.append(Term(f"{who} DDP buckets", state_bytes(trainable, 4), f"{trainable / 1e9:.3f}B x 4 B",
                          (f"{TRAIN_BACKEND_KEY}=fsdp",)))
    opt = [Term(f"{who} optimizer", state_bytes(trainable, 8, s * dp_shard),
                f"{trainable / 1e9:.3f}B x 2 x 4 B / {s * dp_shard}",
                tuple(k for k in (f"{section}.offload.optimizer (off the device between train stages)",
                                  f"{section}.lora.rank (a frozen 16-bit base, only adapters train)"
                                  if section == ACTOR else "", more_dp,
                                  f"{section}.offload.fsdp_cpu_offload (the sharded states on the CPU)"
                                  if lay.sharded else "") if k))]
    if offload.get("fsdp_cpu_offload"):
        weights = [Term(t.name, 0.0, "on the CPU (fsdp_cpu_offload)") for t in weights]
        opt = [Term(t.name, 0.0, "on the CPU (fsdp_cpu_offload)") for t in opt]
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
                     f"{trainable / 1e9:.3f}B x {c} B", (LORA_RANK_KEY,))]
    return []


def _root_grads(d: ModelDims, lay: Layout, who: str, head: str, lora_rank: int) -> list[Term]:
    """An FSDP2 mesh's root (embeddings, head) computes its 16-bit gradients whole in the backward, where they
    live until the root's reduce-scatter at its end (a LoRA model's root is frozen: none)."""
    c = lay.compute_bytes
    if not lay.sharded or c >= 4 or lora_rank:
        return []
    root = d.params(head) - d.layers * d.layer_params()
    return [Term(f"{who} root grads", root * c, f"root {root / 1e9:.2f}B x {c} B before its reduce-scatter",
                 (f"{LORA_RANK_KEY} (a frozen 16-bit base, only adapters train)",))]


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
    if lay.kind == "cpu" and lay.compute_bytes < 4 and seq_len <= SHORT_KV and not checkpointing:
        heads = d.heads
        out.append(Term(f"{who} attention probabilities", attention_probs_bytes(rows, heads, seq_len, layers),
                        f"{rows} rows x {heads} heads x {seq_len}^2 x 6 B x {layers} layers (the CPU's short 16-bit "
                        "attention as matmuls, models/cpu_attention.py)", knobs))
    if checkpointing:
        layer = recompute_bytes(d, tokens, lay.compute_bytes, lay.autocast, lora_rank) / lay.tp
        out.append(Term(f"{who} recompute", max(0.0, layer - logits_bytes),
                        f"one layer recomputed ({layer / GB:.2f} GB) beyond the head's working set "
                        f"({logits_bytes / GB:.2f} GB)", knobs[:2]))
    return out


def _logits(d: ModelDims, lay: Layout, who: str, rows: int, seq_len: int, response_len: int, budget: int | None,
            train: bool, rows_key: str, head_trained: bool = True) -> Term:
    rows_fwd = max(1, tokens_per_forward(rows, seq_len, budget) // seq_len)
    chunk = logits_chunk_bytes(lay.kind)
    if lay.sharded:
        b = full_logits_bytes(d, rows_fwd, response_len, lay.compute_bytes, train, chunk)
        how = f"{rows_fwd} rows x {response_len + 1} x {d.vocab} x {lay.compute_bytes} B{' x 2 (grad)' if train else ''}"
    elif lay.memory == MM.MODEL_PARALLEL:
        b = full_logits_bytes(d, rows_fwd, seq_len, lay.compute_bytes + 4, train) / lay.tp
        how = f"{rows_fwd} rows x {seq_len} x {d.vocab} / tp {lay.tp}, 16-bit + fp32"
    else:
        b = chunked_logits_bytes(d, rows_fwd * response_len, train, lay.compute_bytes, head_trained, chunk)
        how = f"chunks of {chunk >> 20} MiB fp32" + (
            "" if not train else " x 4, the head's gradient once more" if head_trained else " x 4")
    return Term(f"{who} logits", b, how, (f"a smaller {rows_key} (now {rows})",
                                           f"{TOKEN_BUDGET_KEY} (a token budget per forward)"))


def _infer_working_set(d: ModelDims, lay: Layout, who: str, rows: int, seq_len: int, response_len: int,
                       budget: int | None, head: str, rows_key: str, lora: bool = False) -> list[Term]:
    tokens = tokens_per_forward(rows, seq_len, budget)
    layers = inference_activation_bytes(d, tokens, lay.compute_bytes, lora) / lay.tp
    logits = _logits(d, lay, who, rows, seq_len, response_len, budget, False, rows_key).bytes if head == "lm" else 0.0
    b = log_prob_pass_bytes(layers, logits, tokens, d, lay.compute_bytes)
    return [Term(f"{who} forward", b, f"{tokens} tokens: the larger of one layer's working set "
                 f"({layers / GB:.2f} GB) and the head's ({logits / GB:.2f} GB), over the hidden states",
                 (f"a smaller {rows_key} (now {rows})",
                  f"{TOKEN_BUDGET_KEY} (a token budget per forward)"))]


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


def _infer_rows(models: ModelSections, model: str, kind: str) -> tuple[str, int]:
    """The config key, and its value, that sets an inference pass's micro-batch rows for this model."""
    if model == "ref":
        return "ref_config.log_prob_micro_batch_size_per_device", models.ref.log_prob_micro_batch_size_per_device
    if kind == "value":
        return ("critic_config.forward_micro_batch_size_per_device",
                models.critic.forward_micro_batch_size_per_device)
    if kind == "reward":
        return REWARD_ROWS_KEY, models.reward.micro_batch_size_per_device
    return "actor_config.log_prob_micro_batch_size_per_device", models.actor.log_prob_micro_batch_size_per_device


def model_load(models: ModelSections, generate: GenerateConfig, rl: RLConfig, data: DataConfig, d: ModelDims,
               lay: Layout, model: str, kind: str, mfcs: list, trained: bool, rows_per_step: int,
               lora_shared_ref: bool) -> Load:
    """The Load of one model engine of a worker group: a trained policy/critic/reward model or an inference
    one (the reference, a reader of a model trained elsewhere, a reward model)."""
    from ..config.sizes import train_sizes
    from ..dataflow.mfc import InterfaceType
    a = models.actor
    seq_len = data.max_prompt_length + generate.max_new_tokens
    resp = generate.max_new_tokens
    head = "lm" if kind == "policy" else "value"
    if kind == "value":
        section, sec = SECTION_OF["critic"], models.critic
    elif kind == "reward":
        section, sec = REWARD_SECTION, models.reward
    else:
        section, sec = ACTOR, a
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
            micro_rows = 2 * models.reward.micro_batch_size_per_device
            n_micro = 1
        else:
            s = train_sizes(sec.ppo_mini_batch_size, sec.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                            rl.n_samples_per_prompt, lay.dp)
            micro_rows, n_micro = s.micro_rows, max(1, s.mini_rows_per_device // s.micro_rows)
    weights, grads, opt = _state_terms(d, lay, who, section, head, trained, lora_rank,
                                       a.lora.target_modules, offload)
    if lora_shared_ref:
        weights = [Term(f"{who} weights", 0.0, "the actor's base with adapters off (LoRA): no copy")]
    trainable = (lora_params(d, lora_rank, a.lora.target_modules) if lora_rank else d.params(head))
    copy = _compute_copy(d, lay, who, head, trainable if trained else 0) if (trained or lay.sharded) else []
    if not trained and lay.sharded:
        copy = [Term(t.name, (d.params(head) - (d.layers - 2) * d.layer_params()) * lay.compute_bytes, t.how, t.knobs)
                for t in copy]
    ref_offload = model == "ref" and models.ref.offload
    idle = (_off(weights, "offloaded between its passes") if (offload.get("params") or ref_offload) else weights)
    idle = idle + (_off(opt, "offloaded between train stages") if offload.get("optimizer") else opt)
    busy: dict[str, list[Term]] = {}
    for m in mfcs:
        it = InterfaceType(m.interface_type)
        if it is InterfaceType.TRAIN_STEP:
            rows_key = (f"{section}.ppo_micro_batch_size_per_device" if kind != "reward"
                        else REWARD_ROWS_KEY)
            logits = (_logits(d, lay, who, micro_rows, seq_len, resp, budget, True, rows_key, not lora_rank)
                      if head == "lm" else None)
            terms = weights + grads + opt + copy + _activations(
                d, lay, who, section, micro_rows, n_micro, seq_len, budget,
                bool(getattr(sec, "gradient_checkpointing", False)), lora_rank, rows_key,
                logits.bytes if logits else 0.0) + ([logits] if logits else []) + _root_grads(
                d, lay, who, head, lora_rank)
            busy[m.name] = _running(terms)
            if lay.memory != MM.MODEL_PARALLEL and not offload.get("fsdp_cpu_offload"):
                busy[f"{m.name} (optimizer step)"] = _running(weights + grads + opt + [
                    _step_term(d, lay, who, trainable, lora_rank)])
            continue
        else:
            rows_key, rows = _infer_rows(models, model, kind)
            rows = min(rows, per_dev)
            kept_opt = _off(opt, "offloaded between train stages") if offload.get("optimizer") else opt
            terms = weights + kept_opt + copy + _infer_working_set(d, lay, who, rows, seq_len, resp, budget, head,
                                                                   rows_key, lora=bool(lora_rank))
        busy[m.name] = _running(terms)
    label = f"{model} ({lay.backend}{f' dp {lay.dp}' if lay.dp > 1 else ''}{f' tp {lay.tp}' if lay.tp > 1 else ''}" \
            f"{f' pp {lay.pp}' if lay.pp > 1 else ''})"
    return Load(label, idle, busy)


def _rollout_load(generate: GenerateConfig, actor: ActorConfig, rl: RLConfig, data: DataConfig, d: ModelDims | None,
                  lay: Layout, mfcs: list, rows_per_step: int, capacity: float | None) -> Load:
    """The rollout engine: vLLM's share of the device (none while asleep), or the hf engine's weights and
    its KV cache for the rows of one generate call (in the actor's dtype)."""
    g = generate
    names = [m.name for m in mfcs]
    if lay.memory == MM.NO_MODEL:
        return Load("rollout (no model)", [], {n: [] for n in names})
    if lay.memory == MM.DEVICE_SHARE:
        v = g.vllm
        if lay.kind != "cpu" and capacity is not None:
            awake = Term("vLLM", vllm_bytes(v.gpu_memory_utilization, capacity),
                         f"gpu_memory_utilization {v.gpu_memory_utilization:g} x {capacity / GB:.0f} GB",
                         ("generate_config.vllm.gpu_memory_utilization", "generate_config.vllm.enable_sleep_mode"))
        else:
            w = d.params() * DTYPE_BYTES.get(actor.dtype, 4) if d else 0.0
            kv = v.kv_cache_gb if v.kv_cache_gb is not None else type(v).kv_cache_gb   # null: the default
            awake = Term("vLLM", kv * (1 << 30) + w, f"kv_cache_gb {kv:g} GiB + weights",
                         ("generate_config.vllm.kv_cache_gb",))
        asleep = (Term("vLLM (asleep)", 0.0, f"sleep level {v.sleep_level}: weights "
                       f"{'to the CPU' if v.sleep_level == 1 else 'dropped'}, KV cache dropped",
                       awake.knobs) if v.enable_sleep_mode else awake)
        return Load(f"rollout ({lay.backend})", [asleep], {n: [awake] for n in names})
    if d is None:
        return Load(f"rollout ({lay.backend})", [], {n: [] for n in names})
    from ..config.sizes import group_rows
    c = lay.compute_bytes if lay.kind == "cpu" else DTYPE_BYTES.get(actor.dtype, 4)
    s = lay.tp * lay.pp
    rows = min(group_rows(g.micro_batch_size_per_device, rl.n_samples_per_prompt) or 1,
               max(1, rows_per_step // lay.dp))
    seq = data.max_prompt_length + g.max_new_tokens
    weights = Term("rollout weights", state_bytes(d.params(), c, s), f"{d.params() / 1e9:.2f}B x {c} B / {s}",
                   (f"{ROLLOUT_BACKEND_KEY}=vllm with enable_sleep_mode",))
    static = g.cuda_graphs if g.cuda_graphs is not None else lay.kind == "gpu"
    if static:   # fixed buffers per kept shape (static_decode.StaticDecoders.KEEP: training's and validation's)
        kv = Term("rollout KV cache", STATIC_DECODERS_KEPT * static_kv_bytes(d, rows, seq, c) / lay.tp,
                  f"{STATIC_DECODERS_KEPT} static decoders x {rows} rows x {seq} tokens x {d.layers} layers x 2 x "
                  f"{d.kv_dim} x {c} B", (ROLLOUT_MICRO_BATCH_KEY,
                                          "generate_config.cuda_graphs=false (the eager decode's cache)"))
    else:
        kv = Term("rollout KV cache", kv_cache_bytes(d, rows, seq, c) / lay.tp,
                  f"{rows} rows x {seq} tokens x {d.layers} layers x 2 x {d.kv_dim} x {c} B",
                  (ROLLOUT_MICRO_BATCH_KEY, "generate_config.max_new_tokens"))
    work = Term("rollout forward", inference_activation_bytes(d, rows * data.max_prompt_length, c) / lay.tp
                + decode_logits_bytes(d, rows), "the prompt's prefill, one layer, and a step's logits",
                (ROLLOUT_MICRO_BATCH_KEY,))
    return Load(f"rollout ({lay.backend})", [weights], {n: [weights, kv, work] for n in names})


def _group_kind(placement: PlacementConfig, p) -> str:
    """The device kind a group's ranks run on (device "auto": placement.device_kind's)."""
    from ..device import device_spec
    dev = p.resources.device
    if dev == "auto":
        return device_spec(placement.device_kind).name
    return device_spec(dev).name


def group_loads(models: ModelSections, generate: GenerateConfig, rl: RLConfig, data: DataConfig,
                placement: PlacementConfig, p, model_kinds: dict[str, str], dims: dict[str, ModelDims | None],
                rows_per_step: int, capacity: float | None, lora_shared: bool) -> list[Load]:
    """Every engine Load of one worker group's rank, plus the trainer process's context on an accelerator."""
    from ..dataflow.mfc import InterfaceType
    kind = _group_kind(placement, p)
    a = models.actor
    loads: list[Load] = []
    gens = [m for m in p.mfcs if InterfaceType(m.interface_type) is InterfaceType.GENERATE]
    if gens:
        row = p.rollout_row or rollout_backend(generate.backend)
        lay = Layout(row.name, row.memory, p.resources.dp, p.tp, p.pp, kind, a.dtype)
        loads.append(_rollout_load(generate, a, rl, data, dims.get("actor"), lay, gens, rows_per_step, capacity))
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
        dtype = models.reward.dtype if kind_ == "reward" else a.dtype
        row = p.train_row or train_backend(a.backend)
        if kind_ == "reward" and models.reward.backend:
            row = train_backend(models.reward.backend)
        lay = Layout(row.name, row.memory, p.resources.dp, p.tp, p.pp, kind, dtype)
        if lay.memory == MM.NO_MODEL:
            continue
        shared = lora_shared and model == "ref" and "actor" in by_model
        loads.append(model_load(models, generate, rl, data, d, lay, model, kind_, mfcs, trained, rows_per_step,
                                 shared))
    if by_model and kind != "cpu":
        ctx = Term("context", CONTEXT_BYTES, "CUDA/CANN context, collective buffers (allowance)", ())
        loads.append(Load("process", [ctx], {}))
    if kind == "cpu":   # on the host every worker process counts with its libraries, a model's or not
        runtime = Term("worker process", HOST_PROCESS_BYTES, "Python, torch, transformers and Ray's core worker "
                       "(measured)", ())
        loads.append(Load("process", [runtime], {}))
    return loads


def _busiest(load: Load) -> list[Term]:
    """What an engine holds in the largest of its own MFCs (its idle terms when it runs none)."""
    return max(load.busy.values(), key=lambda ts: sum(t.bytes for t in ts), default=load.idle)


def _host_processes(placement: PlacementConfig, validates: bool) -> list[Term]:
    """The run's processes on the host beside its workers: the driver, the docks' actors (validation has its
    own), and Ray's own processes when the trainer starts Ray here."""
    docks = 2 if validates else 1
    terms = [Term("driver", DRIVER_BYTES, "the driver process: torch and transformers loaded (measured)", ()),
             Term("docks", docks * DOCK_BYTES, f"{docks} dock actor(s): training's"
                  + (" and validation's" if docks == 2 else "") + " (measured)", ("trainer.val_interval",))]
    if not placement.ray_address:
        terms.append(Term("Ray processes", RAY_PROCESSES_BYTES, "GCS, raylet, dashboard and agents (measured)",
                          ("placement.ray_address",)))
    return terms


def _host_phases(rl: RLConfig, placement: PlacementConfig, validates: bool, groups: dict, names: list[str],
                 per_group: dict[str, list[Load]]) -> dict[str, list[Term]]:
    """The host's terms at each MFC of its groups. Every rank of a CPU group is a process of its own on the
    host, so its loads count once per rank. With rl_config.blocking false the stages of every worker overlap
    (a worker's rollout generates its next micro-batch beside its update): while one MFC runs, every other
    engine is taken at its largest working set, not at rest."""
    loads = [ld for g in names for ld in per_group[g] * groups[g].world]
    overlap = not rl.blocking
    host = _host_processes(placement, validates)
    phases: dict[str, list[Term]] = {}
    for mfc in dict.fromkeys(m for ld in loads for m in ld.busy):
        phases[mfc] = [t for ld in loads for t in (ld.busy[mfc] if mfc in ld.busy else
                                                   _busiest(ld) if overlap else ld.idle)] + host
    return phases


def _placements(placement: PlacementConfig, groups: dict) -> dict[tuple[str, int], list[str]]:
    """(device kind, device id) -> the groups with a rank there; id -1: the host (CPU groups off a mesh)."""
    from ..device import accelerator_share
    out: dict[tuple[str, int], list[str]] = {}
    shared: list[tuple[str, object]] = []
    nxt: dict[str, int] = {}
    for g, p in groups.items():
        kind = _group_kind(placement, p)
        if p.devices:       # placement.mode=mesh: one rank per device of the group's mesh
            for dev in p.devices:
                out.setdefault((kind, dev), []).append(g)
            nxt[kind] = max(nxt.get(kind, 0), max(p.devices) + 1)
    for g, p in groups.items():
        if p.devices:
            continue
        kind = _group_kind(placement, p)
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
        kind = _group_kind(placement, p)
        for k in range(p.resources.dp):
            out.setdefault((kind, base.get(kind, 0) + k), []).append(g)
    return out


def estimate_memory(models: ModelSections, generate: GenerateConfig, rl: RLConfig, data: DataConfig,
                    placement: PlacementConfig, validates: bool, groups: dict, model_kinds: dict[str, str],
                    model_paths: dict[str, str], rows_per_step: int) -> MemoryPlan:
    """The plan's memory estimate per device (see the module's docstring). Raises ValueError for an
    actor_config.model_config that names no readable config."""
    from ..dataflow.mfc import InterfaceType
    from ..device.kinds import device_memory_gb
    dims: dict[str, ModelDims | None] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    estimated = {m.model_name for p in groups.values() for m in p.mfcs
                 if model_kinds.get(m.name) in ("policy", "value", "reward", "rollout")}
    for model in sorted(estimated):
        path = model_paths.get(model) or model_paths.get("actor")
        same = path == model_paths.get("actor") and model in ("actor", "ref", "critic")
        d, src = load_dims(path, models.actor.model_config if same else None)
        dims[model] = d
        if d is None:
            notes.append(f"no dimensions for {model} ({path!r}): not estimated; set {MODEL_CONFIG_KEY} to a "
                         f"config.json or one of {sorted(SHIPPED)}")
        elif not sources or src not in sources.values():
            sources[model] = src
        else:
            sources[model] = "as " + next(m for m, s in sources.items() if s == src)
    trains_actor = {g for g, p in groups.items() for m in p.mfcs
                    if m.model_name == "actor" and InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP}
    lora_shared = bool(models.actor.lora.rank) and not models.ref.model_path
    per_group: dict[str, list[Load]] = {}
    for g, p in groups.items():
        kind = _group_kind(placement, p)
        cap_gb = device_memory_gb(kind, placement.device_memory_gb)
        cap = cap_gb * GB if cap_gb is not None else None
        per_group[g] = group_loads(models, generate, rl, data, placement, p, model_kinds, dims, rows_per_step, cap,
                                   lora_shared and g in trains_actor)
    by_devices: dict[tuple, list[int]] = {}
    for (kind, dev), gs in sorted(_placements(placement, groups).items()):
        gs = [g for g in gs if per_group.get(g)]
        if any(ld.busy for g in gs for ld in per_group[g]):   # a device with an engine on it
            by_devices.setdefault((kind, tuple(gs)), []).append(dev)
    devices = []
    for (kind, gs), ids in by_devices.items():
        cap_gb = device_memory_gb(kind, placement.device_memory_gb)
        est = DeviceEstimate(kind, ids, list(gs), cap_gb * GB if cap_gb is not None else None)
        if kind == "cpu" and ids == [-1]:
            est.phases = _host_phases(rl, placement, validates, groups, list(gs), per_group)
        else:
            loads = [ld for g in gs for ld in per_group[g]]
            for mfc in dict.fromkeys(m for ld in loads for m in ld.busy):
                est.phases[mfc] = [t for ld in loads for t in (ld.busy[mfc] if mfc in ld.busy else ld.idle)]
        devices.append(est)
    return MemoryPlan(devices, sources, notes)


def refusal(placement: PlacementConfig, plan: MemoryPlan) -> str | None:
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
    cap_key = (DEVICE_MEMORY_KEY if placement.device_memory_gb is not None else
               f"{DEVICE_MEMORY_KEY}=null: the {dev.kind} default")
    return (f"placement: the memory plan puts {total / GB:.1f} GB on {dev.label} ({', '.join(dev.groups)}) at {mfc}, "
            f"over its {dev.capacity / GB:.0f} GB ({cap_key}); the biggest terms: "
            + "; ".join(f"{t.name} {t.bytes / GB:.1f} GB ({t.how})" for t in top)
            + f"; to shrink them: {'; '.join(knobs)}; or more devices. {CHECK_MEMORY_KEY}=false runs it anyway "
              "(docs/fitting.md)")


def plan_memory(models: ModelSections, generate: GenerateConfig, rl: RLConfig, data: DataConfig,
                placement: PlacementConfig, validates: bool, groups: dict, model_kinds: dict[str, str],
                model_paths: dict[str, str], rows_per_step: int) -> MemoryPlan:
    """The memory stage: the estimate, refused (ConfigError, one line) when a device is over its memory and
    placement.check_memory is on, else kept with a warning note. `validates`: the run has validation's dock."""
    try:
        est = estimate_memory(models, generate, rl, data, placement, validates, groups, model_kinds, model_paths,
                              rows_per_step)
    except ValueError as e:
        raise ConfigError(f"{MODEL_CONFIG_KEY}={models.actor.model_config!r}: {e}") from None
    message = refusal(placement, est)
    if message and placement.check_memory:
        raise ConfigError(message)
    if message:
        est.notes.append(f"WARNING ({CHECK_MEMORY_KEY}=false): {message}")
    return est
