"""A saved checkpoint as a Hugging Face checkpoint, offline (`cli/export_hf.py`): no Ray, no process group,
and not the device count of the layout that wrote it.

A checkpoint (`<output_dir>/checkpoints/step_N/`) holds the driver's `trainer_state.pt` (the run's config,
and per trained model the train backend and dp/tp/pp its files were written in) and one directory per
trained model in its backend's own format:

- torch: `engine.pt`, a `torch.save` of the model's state dict (HF names; DDP ranks hold the same state);
- fsdp and mesh: `torch.distributed.checkpoint` shards (`.metadata`, `__<rank>_0.distcp`) of the state dict
  `{"model": {HF name: tensor}, "optim": ..., "version": ...}`: DCP stores each tensor's global shape and
  where each rank's piece lies, so the pieces of any dp, tp or pp layout are read back here as whole
  tensors, in a single process (a pipeline stage keeps HF names with global layer indexes);
- LoRA (torch or fsdp): only the adapters (the base is the checkpoint the run started from, unchanged):
  merged into the base as the engine's own export merges them (`engines/train/lora.py`), or written as a peft
  adapter (`adapter_only`).

Weights are read and cast to the run's compute dtype (`actor_config.dtype`, what the engine's own
export gives) a bucket at a time and handed to `models/hf_export.write_hf_checkpoint`, so the result is
the same files `trainer.save_hf` writes at that step. A checkpoint that is incomplete (a missing file
or rank) or of another model is refused naming the file and the fix (`ExportError`).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..engines import registry
from ..models.files import CheckpointFileError, load_file
from ..models.hf_export import CAUSAL_LM, DTYPES, SHARD_BYTES, VALUE, ExportError, write_hf_checkpoint

STATE = "trainer_state.pt"
MODEL_KINDS = {"actor": CAUSAL_LM, "critic": VALUE}   # what each trained model exports as


@dataclass
class SavedModel:
    """One trained model in a checkpoint: where its files are and what wrote them."""
    name: str                 # actor or critic
    directory: Path           # <checkpoint>/<name>
    backend: str              # the train backend that wrote the files
    dtype: str                # the engine's compute dtype (its export's)
    device_kind: str          # placement.device_kind: where the engine held its weights
    base: str                 # the checkpoint the run started from (config.json, tokenizer, a LoRA base)
    lora: dict | None         # actor_config.lora's fields when the policy trained adapters

    @property
    def kind(self) -> str:
        return MODEL_KINDS[self.name]


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` names: a `checkpoints/step_N` directory, a model directory in one, or
    an output_dir (its latest checkpoint, `checkpoints/latest.json`)."""
    p = Path(path)
    if (p / STATE).is_file():
        return p
    if (p.parent / STATE).is_file():
        return p.parent
    latest = p / "checkpoints" / "latest.json"
    if latest.is_file():
        try:
            name = json.loads(latest.read_text())["path"]
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{latest} is damaged; give a checkpoint directory ({p}/checkpoints/step_N)") from None
        return find_checkpoint(p / "checkpoints" / name)
    if not p.exists():
        raise ExportError(f"{p} does not exist; give a checkpoint directory (<output_dir>/checkpoints/step_N) or "
                          "an output_dir")
    raise ExportError(f"{p} is not a checkpoint (no {STATE} in it): it is incomplete or not a mindspeed_rl "
                      "checkpoint; give <output_dir>/checkpoints/step_N (a run with trainer.save_interval > 0 "
                      "writes them) or an output_dir")


def saved_model(checkpoint: Path, name: str = "actor", base: str | None = None) -> SavedModel:
    """What `checkpoint` holds of model `name`, from its driver state; `base` overrides the base model path."""
    if name not in MODEL_KINDS:
        raise ExportError(f"--model {name}: must be one of {list(MODEL_KINDS)} (the reward model of cli/train_rm.py "
                          "is written as a Hugging Face checkpoint by the run itself: <output_dir>/final)")
    try:
        state = load_file(str(checkpoint / STATE), what="driver state")
    except CheckpointFileError as e:
        raise ExportError(str(e)) from None
    layouts, cfg = state.get("layouts"), state.get("config")
    if not isinstance(layouts, dict) or cfg is None:
        raise ExportError(f"{checkpoint / STATE} records no config or layouts: it is not a mindspeed_rl checkpoint")
    if name not in layouts:
        raise ExportError(f"checkpoint {checkpoint} holds no {name!r} (it holds {sorted(layouts)}); "
                          f"choose --model {' or '.join(sorted(set(layouts) & set(MODEL_KINDS))) or 'actor'}")
    a = cfg.actor_config
    if base is None:
        base = a.model_path if name == "actor" else (cfg.critic_config.model_path or a.model_path)
    lora = None
    if name == "actor" and getattr(getattr(a, "lora", None), "rank", 0):
        import dataclasses
        lora = dataclasses.asdict(a.lora)
    return SavedModel(name=name, directory=checkpoint / name, backend=layouts[name]["backend"], dtype=a.dtype,
                      device_kind=cfg.placement.device_kind, base=base, lora=lora)


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, model: str = "actor",
                      base: str | None = None, adapter_only: bool = False,
                      shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the model `model` of the checkpoint at `path` as a Hugging Face checkpoint in `out` (a peft
    adapter with `adapter_only`). Raises ExportError naming the file and the fix."""
    checkpoint = find_checkpoint(path)
    saved = saved_model(checkpoint, model, base)
    if not saved.directory.is_dir():
        raise ExportError(f"checkpoint {checkpoint} has no {model}/ directory: it is incomplete; export a complete "
                          "checkpoint (the one checkpoints/latest.json names)")
    if adapter_only and saved.lora is None:
        raise ExportError(f"--adapter-only: {model} in {checkpoint} trained no LoRA adapters (actor_config.lora.rank "
                          "is 0); export the whole model without --adapter-only")
    if saved.lora is not None:
        return export_lora(saved, Path(out), adapter_only=adapter_only, shard_bytes=shard_bytes)
    buckets = bucket_cast(read_weights(saved, shard_bytes), DTYPES[saved.dtype], shard_bytes)
    return write_hf_checkpoint(buckets, out, saved.base, kind=saved.kind, dtype=saved.dtype,
                               source=str(_source(saved)))


def bucket_cast(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in buckets of at most `bucket_bytes` (sized in `dtype`), floating ones cast to `dtype`
    as each bucket is pulled: the buckets the run's engine exports (`cast_buckets`), from what a checkpoint holds."""
    from ..engines.base import bucketed

    for bucket in bucketed(named, bucket_bytes, dtype):
        yield [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in bucket]


def read_weights(saved: SavedModel, bucket_bytes: int = SHARD_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The saved model's weights by HF name as its checkpoint holds them (fp32 masters of a trained model),
    at most about `bucket_bytes` of them read at a time."""
    fmt = _format(saved)
    if fmt == registry.STATE_FILE:
        yield from _torch_state(saved.directory).items()
    elif fmt == registry.DCP:
        yield from read_dcp(saved.directory, "model", bucket_bytes)
    elif fmt == registry.MEGATRON_DIST:
        raise ExportError(f"{saved.directory} was written by the {saved.backend} backend (megatron-core's distributed "
                          "checkpoint, read only through megatron-core on the layout's devices); export it with "
                          "the run itself: trainer.save_hf=final or every_save writes <output_dir>/hf/ through "
                          "the engine's HF converter")
    else:
        readable = [n for n, b in registry.TRAIN_BACKENDS.items() if b.checkpoint in (registry.STATE_FILE, registry.DCP)]
        raise ExportError(f"{saved.directory} was written by the {saved.backend!r} train backend, which this export "
                          f"does not read (it reads {', '.join(readable)}); export it with the run itself: "
                          "trainer.save_hf")


def _format(saved: SavedModel) -> str:
    """How the backend that wrote `saved` holds its weights (the registry's `Backend.checkpoint`)."""
    row = registry.TRAIN_BACKENDS.get(saved.backend)
    return row.checkpoint if row is not None else ""


def _source(saved: SavedModel) -> Path:
    """What the exported model names as its source: the state file, or the checkpoint's directory."""
    return saved.directory / "engine.pt" if _format(saved) == registry.STATE_FILE else saved.directory


def _torch_state(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / "engine.pt"
    try:
        state = load_file(str(path), map_location="cpu", what="engine state")
    except CheckpointFileError as e:
        raise ExportError(str(e)) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ExportError(f"engine state {path} holds no model state dict: it is not a torch-backend checkpoint")
    return state["model"]


def read_dcp(directory: Path, section: str, bucket_bytes: int = SHARD_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors under `section` of the `torch.distributed.checkpoint` at `directory`, whole, by their name
    in that section: read `bucket_bytes` at a time (each tensor from every rank's file holding a piece of it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    metadata = _dcp_metadata(directory)
    names = {key: path[1] for key, path in metadata.planner_data.items()
             if len(path) == 2 and path[0] == section}
    if not names:
        raise ExportError(f"{directory / '.metadata'} holds no {section!r} tensors: it is not a checkpoint of a "
                          "trained model's engine")
    groups: list[list[str]] = [[]]
    size = 0
    for key in names:
        m = metadata.state_dict_metadata[key]
        n = m.size.numel() * torch.empty((), dtype=m.properties.dtype).element_size()
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    for keys in groups:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            state = _load_state_dict_from_keys(set(keys), storage_reader=FileSystemReader(str(directory)))
        for key in keys:
            yield names[key], state[section].pop(names[key])


def _dcp_metadata(directory: Path):
    """DCP's metadata of `directory`, after checking every shard file it names is there."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / ".metadata").is_file():
        raise ExportError(f"{directory / '.metadata'} is missing: the checkpoint in {directory} is incomplete "
                          "(its save did not finish) or was not written by the fsdp or mesh backend; export a "
                          "complete checkpoint (the one checkpoints/latest.json names)")
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged file: named with its cause
        raise ExportError(f"{directory / '.metadata'} is damaged ({type(e).__name__}: {e}); export another "
                          "checkpoint") from None
    files = sorted({d.relative_path for d in metadata.storage_data.values()})
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise ExportError(f"{directory / missing[0]} is missing ({len(missing)} of the {len(files)} shard files "
                          f"{files} are): a rank's part of the checkpoint in {directory} is lost; export a "
                          "complete checkpoint (copy every rank's __<rank>_0.distcp from where it was written)")
    return metadata


# ------------------------------------------------------------------------------------------------ LoRA
def export_lora(saved: SavedModel, out: Path, *, adapter_only: bool, shard_bytes: int = SHARD_BYTES) -> Path:
    """A LoRA policy's checkpoint (its adapters) with the base it trains on: the merged weights, made by
    the engines' own merge (`engines/train/lora.py`: the base as the engine held it, W + alpha / r * B @ A in fp32,
    cast to the compute dtype) so they equal the run's `save_hf`; or, `adapter_only`, a peft adapter
    directory (`adapter_config.json`, `adapter_model.safetensors`) for `PeftModel.from_pretrained` on the base.
    The base model is loaded whole (an adapter's merge needs its layer's base weight, and peft its model)."""
    from ..engines.train.lora import apply_lora, load_adapter_state, merged_buckets
    from ..models import load_causal_lm, resolve_model_path
    from ..models.hf_export import model_layout

    model_layout(saved.base, CAUSAL_LM, saved.dtype)   # the base exists and is a causal LM (else ExportError)
    adapters = dict(read_weights(saved))
    source = _source(saved)
    # the base in the dtype the engine held it in: the compute dtype, but fp32 where the backend keeps it so on a CPU
    row = registry.TRAIN_BACKENDS.get(saved.backend)
    held = "float32" if row is not None and row.lora_base_fp32_on_cpu and saved.device_kind == "cpu" else saved.dtype
    model = load_causal_lm(saved.base, held)
    lora = apply_lora(model, saved.lora, DTYPES[held])
    try:
        load_adapter_state(model, adapters)
    except RuntimeError as e:
        raise ExportError(f"{source}: {e}; export it with the base model and actor_config.lora it was trained "
                          "with (--base-model)") from None
    if not adapter_only:
        return write_hf_checkpoint(merged_buckets(model, DTYPES[saved.dtype], shard_bytes), out, saved.base,
                                   kind=CAUSAL_LM, dtype=saved.dtype, source=str(source))
    import shutil
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        lora.peft_model.peft_config["default"].base_model_name_or_path = str(resolve_model_path(saved.base))
        lora.peft_model.save_pretrained(str(tmp), safe_serialization=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
