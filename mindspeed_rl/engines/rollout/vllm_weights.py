"""How trained weights reach vLLM's model (`VLLMRolloutEngine.update_weights`): whole vLLM modules at
a time, in this process or, with tensor parallelism, through a file the TP workers load.

A reload is `llm.collective_rpc("reload_weights", weights_iterator=[(hf_name, tensor)...],
is_checkpoint_format=True)` then `llm.reset_prefix_cache()` (vLLM's layerwise in-place reload;
10-20 ms for the tiny model). A reload may name a subset of the weights, but only whole vLLM
modules: a fused module (`qkv_proj` from q/k/v_proj, `gate_up_proj` from gate/up_proj, with
their biases) loaded from only some of its HF names gets garbage in the rest, and a tied
`lm_head.weight` left out keeps the old head even when `embed_tokens.weight` changed (both
measured). So each call's tensors are held back per vLLM module until all of that module's HF
names have arrived (the names come from the checkpoint's safetensors keys, plus `lm_head.weight`
when `tie_word_embeddings`, with the embedding and the head as one group; the packing from the
vLLM model's `packed_modules_mapping`), and every call reloads the modules completed so far:
buckets cut anywhere give the same weights as one call. `weight_version` becomes `version` when
nothing is held back (`pending_weight_names()` lists what is). Held-back names of an older
version are dropped (with a warning) when a newer version's first bucket arrives.

With tensor_parallel_size > 1 weights cannot travel as tensors to vLLM's workers (its message queue
fails with `cannot pickle memoryview`), so each reload writes its tensors into one file in /dev/shm
(64-byte aligned, `write_weight_file`) and sends the path and the layout (name, dtype, shape, offset)
to `ShmWeightLoader`, the `worker_extension_cls` mixed into vLLM's workers: each rank maps the file,
takes views, and runs its own `reload_weights` (which shards them); the file is deleted when every
rank has loaded it.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Sequence

import torch

# the packing of Llama-family decoders, used when the vLLM model does not say
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                          "gate_up_proj": ["gate_proj", "up_proj"]}
TIED = "<tied embeddings>"
# vLLM's reload warns once per untouched module on a partial reload: expected here, so muted
RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")
# tensor_parallel_size > 1: weight buckets travel to vLLM's worker processes as files here
SHM_DIR = "/dev/shm"
SHM_PREFIX = "mindspeed_rl-vllm-weights-"
_ALIGN = 64


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def muted(names: Sequence[str], active: bool = True):
    """Drop these loggers' records below ERROR for the duration (warnings expected here). A filter,
    not a level: `LLM()` re-runs vLLM's logging dictConfig, which resets child loggers' levels."""
    flt = _BelowError()
    loggers = [logging.getLogger(n) for n in names] if active else []
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


class ShmWeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`) when tensor_parallel_size > 1: methods
    `collective_rpc` runs in every TP worker process. Names carry a prefix: vLLM refuses an extension
    attribute its worker already has."""

    def mindspeed_reload_from_file(self, path: str, size: int, layout: list) -> int:
        """Load the tensors `layout` [(name, dtype, shape, offset)] describes from the file at `path`
        (`size` bytes, written by `VLLMRolloutEngine._reload`) through this rank's own
        `reload_weights`, which takes the rank's shard of each. Returns the tensors loaded."""
        buf = torch.from_file(path, shared=False, size=int(size), dtype=torch.uint8)  # private map, no copy
        weights = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            weights.append((name, buf[offset:offset + n].view(dt).view(shape)))
        with muted(RELOAD_LOGGERS):
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)

    def mindspeed_packed_modules(self) -> dict:
        """The vLLM model's fused modules: {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}."""
        return dict(getattr(self.model_runner.model, "packed_modules_mapping", {}) or {})


def checkpoint_weight_names(model_path: str | Path) -> set[str] | None:
    """The HF weight names of a checkpoint (safetensors index or files), plus `lm_head.weight` when
    the embeddings are tied (the trainer sends it; vLLM needs it). None when there is no safetensors."""
    path = Path(model_path)
    names: set[str] = set()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                names.update(fh.keys())
    if not names:
        return None
    if tied_embeddings(path):
        names.add("lm_head.weight")
    return names


def tied_embeddings(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))

def write_weight_file(path: str, weights: list[tuple[str, torch.Tensor]]) -> tuple[list, int]:
    """Write the tensors' raw bytes into a new file at `path`, each at a 64-byte-aligned offset;
    returns the layout [(name, dtype, shape, offset)] `ShmWeightLoader` reads and the file's size."""
    layout, offset = [], 0
    with open(path, "wb") as f:
        for name, t in weights:
            t = t.detach().to("cpu").contiguous()
            pad = -offset % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            data = t.reshape(-1).view(torch.uint8).numpy()
            f.write(data.data)
            offset += data.nbytes
    return layout, offset
