"""A trained model as a Hugging Face checkpoint, written a bucket of weights at a time.

Every train engine gives its weights as buckets of (HF name, full tensor) (`TrainEngine.export_weights`,
whatever its layout: gathered from FSDP shards, tp x pp pieces, megatron's through its converter), and
offline readers of saved checkpoints give the same (`trainer/export.py`). `write_hf_checkpoint` turns
such buckets into the directory `from_pretrained` (transformers, vLLM, peft, evaluation harnesses)
reads: one safetensors shard per bucket (`model.safetensors`, or numbered shards with
`model.safetensors.index.json`), the `config.json` of the model the run started from with the export's
dtype, its tokenizer files and `generation_config.json`. Only one bucket is alive at a time, so the
writing rank never holds a second copy of the model.

Names and shapes are checked against the architecture the base config builds (on the meta device, no
memory): a checkpoint of another model is refused naming the weight and the file it came from. Tied
weights (Qwen2's `lm_head.weight` = the embedding) are written once, as `save_pretrained` writes them.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .checkpoint import resolve_model_path

CAUSAL_LM, VALUE = "causal_lm", "value"   # a policy, or a critic (a one-label token classifier: verl's value model)
KINDS = (CAUSAL_LM, VALUE)
SHARD_BYTES = 2 << 30     # the most bytes of one safetensors shard (and of a bucket asked of an engine)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FINAL = "final"
# what a tokenizer may be saved as (AutoTokenizer reads whichever exist)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """A checkpoint that cannot be exported (incomplete, of another model); the message names the file and the fix."""


@dataclass
class ModelLayout:
    """What an exported checkpoint of the base model must hold."""
    config: Any                          # the transformers config written as config.json
    shapes: dict[str, tuple[int, ...]]   # HF name -> shape of every weight written
    aliases: dict[str, str]              # a tied weight's other name -> the name written
    base: Path                           # the base checkpoint directory (tokenizer, generation config)

    @property
    def architecture(self) -> str:
        return (self.config.architectures or ["?"])[0]


def model_layout(base_path: str, kind: str = CAUSAL_LM, dtype: str | None = None) -> ModelLayout:
    """The layout of the model at `base_path` (a checkpoint dir or `builtin:` name) as a `kind` model, its
    config carrying `dtype` (the export's). Built on the meta device: seconds for any size, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {list(KINDS)}")
    base = resolve_model_path(base_path)
    if not (base / "config.json").is_file():
        raise ExportError(f"base model {base_path!r}: no config.json in {base}; give the checkpoint the run started "
                          "from (actor_config.model_path), e.g. with --base-model")
    if kind == VALUE:
        config = AutoConfig.from_pretrained(str(base), num_labels=1)
        config.classifier_dropout = 0.0
        cls = AutoModelForTokenClassification
    else:
        config = AutoConfig.from_pretrained(str(base))
        cls = AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config)
    config.architectures = [type(model).__name__]
    if dtype is not None:
        config.dtype = dtype
    written: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in written:
            aliases[name] = written[id(p)]
        else:
            written[id(p)] = name
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in aliases}
    return ModelLayout(config=config, shapes=shapes, aliases=aliases, base=base)


def write_hf_checkpoint(buckets: Iterable[list[tuple[str, torch.Tensor]]], directory: str | os.PathLike,
                        base_path: str, *, kind: str = CAUSAL_LM, dtype: str | None = None,
                        source: str = "the exported weights") -> Path:
    """Write `buckets` (lists of (HF name, tensor), in the dtype to save) as an HF checkpoint at `directory`.

    Written into a temporary directory beside it and renamed into place when whole, so a reader never
    sees half a checkpoint and a failed export leaves nothing. On a failure the remaining buckets are
    still drawn (a sharded engine's gathers are collective: the other ranks would wait for this one)
    before the error is raised. `source` names where the weights came from in errors.
    Raises ExportError for weights that do not fit the base model's architecture."""
    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    iterator = iter(buckets)
    try:
        layout = model_layout(base_path, kind, dtype)
        directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shards = _write_shards(iterator, tmp, layout, source)
        _finish(tmp, layout, shards, kind)
    except BaseException as e:
        for _ in iterator:   # let a sharded engine's other ranks finish their collectives
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):   # a full disk, no permission: named, with what to do
            raise ExportError(f"cannot write the Hugging Face checkpoint {directory}: {e.strerror or e}; free space "
                              "there or point it elsewhere (trainer.output_dir, or export_hf's <out>); nothing was "
                              "left half-written") from None
        raise
    if directory.is_symlink() or directory.is_file():
        directory.unlink()
    elif directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def _write_shards(buckets: Iterator, tmp: Path, layout: ModelLayout, source: str) -> list[tuple[str, list[str], int]]:
    """One safetensors file per non-empty bucket; [(file, names, bytes)]."""
    from safetensors.torch import save_file

    shards: list[tuple[str, list[str], int]] = []
    seen: set[str] = set()
    for bucket in buckets:
        tensors: dict[str, torch.Tensor] = {}
        for name, t in bucket:
            target = layout.aliases.get(name, name)
            want = layout.shapes.get(target)
            if want is None:
                raise ExportError(f"{source}: {name!r} is not a weight of {layout.architecture} as configured in "
                                  f"{layout.base / 'config.json'}: the checkpoint is of another model; export it "
                                  "with the base model it was trained from (--base-model)")
            if tuple(t.shape) != want:
                raise ExportError(f"{source}: {name!r} has shape {tuple(t.shape)}, but {layout.architecture} as "
                                  f"configured in {layout.base / 'config.json'} has {want}: the checkpoint is of "
                                  "another model size; export it with the base model it was trained from "
                                  "(--base-model)")
            if name != target or name in seen:   # a tied weight's second name, or a name given twice
                continue
            seen.add(name)
            # own memory: safetensors refuses tensors that share a storage (a bucket is one buffer)
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        if tensors:
            file = f"shard-{len(shards):05d}.safetensors"
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            shards.append((file, list(tensors), sum(x.numel() * x.element_size() for x in tensors.values())))
            del tensors
    missing = [n for n in layout.shapes if n not in seen]
    if missing:
        raise ExportError(f"{source}: {len(missing)} weight(s) of {layout.architecture} are missing (e.g. "
                          f"{missing[:3]}): the checkpoint is incomplete or of another model; export a complete "
                          "checkpoint of the model it was trained from")
    return shards


def _finish(tmp: Path, layout: ModelLayout, shards: list[tuple[str, list[str], int]], kind: str) -> None:
    """Name the shards as `from_pretrained` looks for them, and add the config, tokenizer and generation config."""
    if len(shards) == 1:
        os.replace(tmp / shards[0][0], tmp / WEIGHTS_NAME)
    else:
        weight_map, total = {}, 0
        for i, (file, names, size) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp / file, tmp / final)
            weight_map.update(dict.fromkeys(names, final))
            total += size
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n")
    layout.config.save_pretrained(str(tmp))
    for name in TOKENIZER_FILES:
        if (layout.base / name).is_file():
            shutil.copyfile(layout.base / name, tmp / name)
    if kind == CAUSAL_LM:
        if (layout.base / "generation_config.json").is_file():
            shutil.copyfile(layout.base / "generation_config.json", tmp / "generation_config.json")
        else:
            from transformers import GenerationConfig
            GenerationConfig.from_model_config(layout.config).save_pretrained(str(tmp))


def link_final(root: str | os.PathLike, target: str | os.PathLike) -> Path:
    """`<root>/final` -> `target` (a sibling directory), replaced atomically: readers of `final` see the old
    export or the new one, never none."""
    root = Path(root)
    link = root / FINAL
    tmp = root / f".{FINAL}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(Path(target).name, tmp)
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)
    os.replace(tmp, link)
    return link
