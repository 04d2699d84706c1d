"""LoRA adapters on a trained policy through peft (`actor_config.lora`, the torch and fsdp backends).

Why peft: it is what verl, TRL and OpenRLHF use, so a user's adapter means the same thing here. peft
injects its layers into the HF model in place (`q_proj` becomes a `lora.Linear` holding `base_layer`,
`lora_A`, `lora_B`), so the engine keeps running the same `Qwen2ForCausalLM` object and its backbone;
only parameter names change (`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`).

Memory, which is why LoRA exists here: the base is frozen and held in the compute dtype (bf16 on a GPU:
15.2 GB for 7B, no fp32 master and no AdamW state for it); the adapters are fp32 masters with fp32 AdamW
state. Readers (the hf and vLLM rollout engines) know nothing of adapters: they are sent the merged
weights (base W + alpha / r * B @ A) under the base model's HF names, computed a bucket at a time
(`write_bucket`), never a second copy of the model. The reference, when it is the initial policy, is
the same base with the adapters off (`BaseReference`, peft's `disable_adapter()`).

Adapters are switched off for the whole model at once (a flag in each LoRA layer), so a reference pass
must not interleave with the policy's own forwards in another thread: `Adapters.lock` is held by the
reference for its whole pass, and by the engine around each of its forwards (with the backward that may
recompute them under activation checkpointing).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..base import ALIGN, Bucket, TrainEngine, bucketed

ALL_LINEAR = "all-linear"
ADAPTER = "default"   # peft's adapter name: one adapter per model here
ORIGINAL = ".original_module."                 # a modules_to_save layer's frozen base, in parameter names
TRAINED = f".modules_to_save.{ADAPTER}."       # and its trained copy


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Names of the model's linear layers that may take an adapter: every `nn.Linear` but the LM head
    (peft's all-linear leaves the output layer out too; with tied embeddings it is the input embedding)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def check_target_modules(model: torch.nn.Module, target_modules: Sequence[str]) -> None:
    """Refuse names that take no adapter: one matching no linear layer (peft matches a name against the
    end of a module's dotted name) or matching only the LM head. The message names the model's linear
    layers, so the user sees what to write. `model` may live on the meta device (the plan's check)."""
    targets = list(target_modules)
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            raise ValueError(f"actor_config.lora.target_modules={targets}: {ALL_LINEAR} already takes every linear "
                             f"layer but the LM head; list it alone, or name the layers without it")
        return
    linear = linear_layer_names(model)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(f"actor_config.lora.target_modules={targets}: {missing} match no linear layer of the model "
                         f"(the LM head takes none); its linear layers are named {kinds} (e.g. "
                         f"{linear[0] if linear else 'none'}); name some of these, or [{ALL_LINEAR}]")


def check_target_modules_of_config(config: dict, target_modules: Sequence[str],
                                   modules_to_save: Sequence[str] = ()) -> None:
    """`check_target_modules` and `modules_to_save_names` against the model an HF `config.json` describes, built on the meta device (no
    weights, a fraction of a second for 7B): the plan's check before any worker starts. A config transformers
    cannot build here is left to the engine's own check."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    try:
        hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (KeyError, ValueError, TypeError):
        return
    check_target_modules(model, target_modules)
    modules_to_save_names(model, modules_to_save)


def peft_target(target_modules: Sequence[str]) -> str | list[str]:
    """peft's spelling: the string "all-linear", or the list of names."""
    targets = list(target_modules)
    return ALL_LINEAR if targets == [ALL_LINEAR] else targets


class Adapters:
    """The peft LoRA injected into one model: what the engine trains and what turns it off."""

    def __init__(self, peft_model: Any, lock: Any = None):
        self.peft_model = peft_model
        self.lock = lock if lock is not None else threading.RLock()

    def trainable(self, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter parameters of `module` (the engine's model, sharded or not), by name."""
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    @contextlib.contextmanager
    def disabled(self):
        """The base model alone, for the length of the block (and no forward of the policy meanwhile)."""
        with self.lock, self.peft_model.disable_adapter():
            yield

    def in_use(self):
        """Held around a forward (and its backward) of the policy: never while a reference pass runs."""
        return self.lock


def modules_to_save_names(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """The full dotted names of the modules `actor_config.lora.modules_to_save` takes: a name takes every module
    whose dotted name ends with it as a string (`norm` takes `input_layernorm` and the final `norm` alike), a
    module inside one already taken is not taken again. Resolved here and handed to peft whole, because peft's
    own suffix rule differs between its releases (0.22 matches only whole dotted parts). A name that takes no
    module is refused with the model's module kinds."""
    modules = [n for n, _ in model.named_modules() if n]
    taken: list[str] = []
    for n in modules:
        if any(n.endswith(t) for t in names) and not any(n.startswith(f"{p}.") for p in taken):
            taken.append(n)
    missing = [t for t in names if not any(n.endswith(t) for n in modules)]
    if missing:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in modules if not n.rsplit(".", 1)[-1].isdigit()})
        raise ValueError(f"actor_config.lora.modules_to_save={list(names)}: {missing} match no module of the model "
                         f"(a name matches the end of a module's dotted name); its modules are named {kinds}")
    return taken


def apply_lora(model: torch.nn.Module, lora: dict, base_dtype: torch.dtype, lock: Any = None) -> Adapters:
    """Inject LoRA adapters into `model` in place (peft): the base frozen in `base_dtype`, the adapters
    trainable fp32 masters. `lora`: LoraConfig's fields (rank, alpha, target_modules, dropout)."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, lora.get("target_modules", [ALL_LINEAR]))
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != base_dtype:
                p.data = p.data.to(base_dtype)
    config = LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora.get("alpha", 16.0)),
                        target_modules=peft_target(lora.get("target_modules", [ALL_LINEAR])),
                        lora_dropout=float(lora.get("dropout", 0.0)), bias="none",
                        modules_to_save=modules_to_save_names(model, lora.get("modules_to_save") or []) or None)
    peft_model = get_peft_model(model, config)
    if peft_model.base_model.model is not model:   # the engine keeps running `model` itself
        raise RuntimeError("peft did not inject its adapters into the model in place")
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return Adapters(peft_model, lock)


def trained_groups(module: torch.nn.Module, lora: dict | None, lr: float) -> list[dict]:
    """AdamW's parameter groups of what trains in `module`: without LoRA every parameter at `lr`; with LoRA
    the adapters at `lora.lr` (else `lr`) and the modules peft trains whole (`modules_to_save`, e.g. the
    RMSNorm weights) at `lora.modules_to_save_lr` (else the adapters' lr). A norm's weight scales the
    logits directly, so on a base whose head cannot grow (frozen) it is what sharpens the policy, and it
    needs a step size of its own: the adapters' B @ A product moves quadratically in theirs."""
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not lora:
        return [{"params": [p for _, p in trained], "lr": lr}]
    adapter_lr = lora.get("lr") or lr
    whole = [p for n, p in trained if TRAINED in n]
    groups = [{"params": [p for n, p in trained if TRAINED not in n], "lr": adapter_lr}]
    if whole:
        groups.append({"params": whole, "lr": lora.get("modules_to_save_lr") or adapter_lr})
    return groups


# ---------------------------------------------------------------------------- merged weights
@dataclass(frozen=True)
class Export:
    """One weight a reader gets: HF `name`, from parameter `source`, plus `scale * B @ A` of the adapter
    parameters `lora` = (A, B) when that layer has one."""
    name: str
    source: str
    lora: tuple[str, str] | None = None
    scale: float = 0.0


def export_plan(model: torch.nn.Module, adapters: bool = True) -> list[Export]:
    """The weights of the base model's HF checkpoint, in its parameter order (tied ones under each name,
    `lm_head.weight` too), each with where it comes from. `adapters=False`: the base alone (the reference)."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    copied = ORIGINAL if not adapters else TRAINED
    out = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        if ORIGINAL in name or TRAINED in name:   # a module peft copies to train whole (modules_to_save)
            if copied in name:
                out.append(Export(name.replace(copied, "."), name))
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner[:-len(".base_layer")] in layers:
            layer_name = owner[:-len(".base_layer")]
            layer = layers[layer_name]
            hf = f"{layer_name}.{leaf}"
            if leaf == "weight" and adapters and ADAPTER in layer.lora_A:
                out.append(Export(hf, name, (f"{layer_name}.lora_A.{ADAPTER}.weight",
                                             f"{layer_name}.lora_B.{ADAPTER}.weight"), float(layer.scaling[ADAPTER])))
            else:
                out.append(Export(hf, name))
        else:
            out.append(Export(name, name))
    return out


def _merged(e: Export, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """W + scale * B @ A in fp32 (one layer's transient), or the parameter as it is."""
    w = get(e.source)
    if e.lora is None:
        return w
    a, b = (get(n).float() for n in e.lora)
    return torch.addmm(w.float(), b, a, alpha=e.scale)   # out of place: `w` may be the base parameter itself


def write_bucket(entries: list[Export], get: Callable[[str], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str, align: int = ALIGN) -> Bucket:
    """One bucket of exported weights in `dtype`, all in ONE new buffer at the offsets weight sync's wire
    gives them (`align`-aligned, a tied weight once), so it still goes as one broadcast; each merged
    weight is made in fp32 and cast into its place, one layer at a time."""
    places: dict[tuple, int] = {}
    total = 0
    for e in entries:
        key = (e.source, e.lora)
        if key not in places:
            places[key] = total
            size = get(e.source).numel() * torch.empty((), dtype=dtype).element_size()
            total = (total + size + align - 1) // align * align
    buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    views: dict[tuple, torch.Tensor] = {}
    out: Bucket = []
    with torch.no_grad():
        for e in entries:
            key = (e.source, e.lora)
            if key not in views:
                t = _merged(e, get)
                n = t.numel() * torch.empty((), dtype=dtype).element_size()
                views[key] = buf[places[key]:places[key] + n].view(dtype).view(t.shape)
                views[key].copy_(t)
            out.append((e.name, views[key]))
    return out


def merged_buckets(module: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int,
                   adapters: bool = True) -> Iterator[Bucket]:
    """The merged weights of a model whose parameters are all local (not sharded), by HF name, a bucket
    of at most `bucket_bytes` in `dtype` at a time (`export_weights` of the torch backend)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    plan = export_plan(module, adapters)
    by_name = {e.name: e for e in plan}
    device = next(iter(params.values())).device
    meta = ((e.name, torch.empty(params[e.source].shape, dtype=dtype, device="meta")) for e in plan)
    for planned in bucketed(meta, bucket_bytes):
        yield write_bucket([by_name[n] for n, _ in planned], lambda n: params[n].detach(), dtype, device)


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by parameter name: what a checkpoint holds of the model (the base is the
    unchanged checkpoint it loads from)."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def load_adapter_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's adapters back; refuses one of another LoRA layout (rank, target modules) or of a
    model trained without LoRA, naming what differs."""
    own = dict(module.named_parameters())
    mine = {n for n, p in own.items() if p.requires_grad}
    if set(state) != mine:
        extra, lacking = sorted(set(state) - mine)[:3], sorted(mine - set(state))[:3]
        raise RuntimeError(f"the checkpoint's adapters do not match this model's LoRA layout (in the checkpoint "
                           f"only: {extra}; here only: {lacking}): actor_config.lora differs from the saved run's")
    with torch.no_grad():
        for n, t in state.items():
            if tuple(own[n].shape) != tuple(t.shape):
                raise RuntimeError(f"the checkpoint's adapter {n} has shape {tuple(t.shape)}, this model's "
                                   f"{tuple(own[n].shape)}: actor_config.lora.rank differs from the saved run's")
            own[n].copy_(t)


# ---------------------------------------------------------------------------- the reference
class BaseReference(TrainEngine):
    """The reference model when it is the initial policy and the policy trains LoRA in the same worker:
    the policy's own engine, run with the adapters off. No second copy of the weights; the inference
    members of a TrainEngine, nothing that trains or loads."""

    def __init__(self, engine: TrainEngine):
        if getattr(engine, "lora", None) is None:
            raise ValueError(f"a LoRA reference needs a policy engine with adapters; {type(engine).__name__} has "
                             "none (actor_config.lora.rank is 0)")
        self.engine = engine
        self.collective_forward = engine.collective_forward

    def holding(self, for_training: bool, why: str):
        """The policy's parameters on the device for a pass of its base (engines/train/offload.py: a policy that
        offloads between stages brings them back here too)."""
        return self.engine.holding(False, why)

    def log_probs(self, prompts, responses, micro_batch_size: int) -> list[torch.Tensor]:
        with self.engine.lora.disabled():
            return self.engine.log_probs(prompts, responses, micro_batch_size)

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The base's weights by HF name (every rank of a sharded engine iterates to the end)."""
        return self.engine.export_weights(bucket_bytes, adapters=False)

    def state_checksum(self) -> str:
        """Of the base's weights as a reader would get them: unchanged by training (only adapters train).
        On a sharded engine every rank calls it (the gathers are collective)."""
        from ..sync.weight_sync import Checksum
        digest = Checksum()
        for bucket in self.export_weights(64 << 20):
            digest.update(bucket)
        return digest.hexdigest()

    def _refuse(self, what: str):
        raise RuntimeError(f"{what}: the LoRA reference is the policy's base with its adapters off; it is never "
                           "trained, loaded or saved on its own")

    def train_step(self, micro_batches, loss_fn):
        self._refuse("train_step")

    def update_weights(self, named_tensors, version: int) -> None:
        self._refuse("update_weights")

    def save_checkpoint(self, directory: str) -> list[str]:
        self._refuse("save_checkpoint")

    def load_checkpoint(self, directory: str) -> None:
        self._refuse("load_checkpoint")

    def close(self) -> None:
        """The policy's engine owns the model and closes it."""
