"""Rollout with vLLM as a server: one `AsyncLLM` per rollout worker (`generate_config.vllm.serve: true`).

The offline engine (`vllm_rollout.py`) hands vLLM one micro-batch at a time, so a micro-batch waits for its
longest row while the slots its other rows freed idle, and a weight update waits for every row in flight.
Here every row is a request of its own on vLLM's continuous-batching scheduler: `generate` may be called
from several threads at once (micro-batches of one stage, stages of several steps) and their rows share the
engine's slots.

The engine core runs in a process of vLLM's own (AsyncLLM always does); this process keeps a client and an
asyncio loop on a thread of its own, and `generate` waits on it. Weights reach the engine core's worker as
with tensor parallelism, through a file in /dev/shm (`vllm_weights.ShmWeightLoader`), whole vLLM modules at
a time as the offline engine holds them back.

Partial rollouts (`paused`): vLLM's `pause_generation(mode="keep")` freezes the requests in flight with their
KV cache; the weights load; `resume_generation()` lets them go on. Tokens after the update come from the new
weights over the KV cache the old ones wrote, each with the log-prob of the weights that sampled it. Where
each row switched is in `Rollout.version_switches`: {token index: version} for the updates that landed
inside it (the index of the first token the new weights sampled). Once the scheduler is paused no token is
sampled, but tokens sampled before it may still be on their way to this client; the pause waits until every
in-flight row's count stays still (`SETTLE_S`) before it records where the rows stand.

Prefix caching is off unless the options turn it on: a prefix cached under old weights would be reused by
a new request after an update (vLLM cannot drop a cache while paused requests hold blocks of it).

Written against vLLM 0.32's `vllm.v1.engine.async_llm.AsyncLLM`; run here on its CPU build.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..base import WAKE_TAGS, Rollout, RolloutSpec, SamplingParams
from .vllm_rollout import VLLMRolloutEngine, restore_process, engine_setup
from .vllm_weights import SHM_DIR, SHM_PREFIX, muted, write_weight_file

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 300.0   # a pause, a reload or a shutdown on the engine core
IN_FLIGHT = 8            # micro-batches a generate stage keeps in flight on the server
SETTLE_S = 0.005         # a paused engine's rows hold still this long before their counts are read


def serving_refusal(options: dict, tp: int) -> str | None:
    """What the serving engine does not run. Tensor parallelism: its engine core would start the TP ranks as
    processes of its own, which the weight file in /dev/shm, the shared-memory records and the reaper's clean-up
    do not reach yet. Sleep mode: a sleeping server drops the KV cache of the requests it holds in flight."""
    if tp > 1:
        return (f"generate_config.vllm.serve=true with tensor parallelism (tp={tp}) is not built: the engine core's "
                "own TP worker processes are out of reach of the weight loading and clean-up; serve at tp 1, or "
                "set generate_config.vllm.serve=false for a tensor-parallel rollout")
    if options.get("enable_sleep_mode"):
        return ("generate_config.vllm.serve=true with generate_config.vllm.enable_sleep_mode=true is not built: a "
                "sleeping server would drop the KV cache of the requests in flight; set one of them false")
    return None


class VLLMEngineDied(RuntimeError):
    """The serving engine's engine core process died: nothing it had in flight finishes, nothing more runs.
    One line naming the process, since the trainer quotes the last line of a worker's error."""


class VLLMServingEngine(VLLMRolloutEngine):
    """`AsyncLLM` behind the rollout engine's interface; see the module docstring."""

    concurrent_generate = True
    partial_rollout = True
    # a stage's micro-batches in flight together: their rows share the scheduler's slots, so a micro-batch's
    # long row no longer holds back the next micro-batch's start
    micro_batches_in_flight = IN_FLIGHT

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread, spec: RolloutSpec,
                 restore: dict | None = None):
        self._loop, self._thread = loop, thread
        self._ids = itertools.count()
        self._rows: dict[str, list[int]] = {}           # request id -> its tokens so far (rows in flight)
        self._switches: dict[str, dict[int, int]] = {}  # request id -> {token index: version}
        self._rows_lock = threading.Lock()
        self._paused_at: dict[str, int] | None = None    # request id -> tokens, while paused
        super().__init__(llm, spec, restore=restore, tensor_parallel_size=1)
        self._workers_elsewhere = True   # the engine core's worker: weights through /dev/shm
        self._engine_pid = (self.engine_pids() or [None])[0]

    # ---- construction
    @classmethod
    def refusal(cls, options: dict, tp: int) -> str | None:
        return serving_refusal(options, tp)

    @classmethod
    def build(cls, spec: RolloutSpec) -> "VLLMServingEngine":
        kwargs, opts, restore, tp, sleep_mode = engine_setup(spec, workers_elsewhere=True)
        refused = serving_refusal({**opts, "enable_sleep_mode": sleep_mode}, tp)
        if refused:
            raise ValueError(refused)
        kwargs.setdefault("enable_prefix_caching", bool(opts.get("enable_prefix_caching", False)))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"   # the engine core in a process of its own
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="vllm-serving-loop", daemon=True)
        thread.start()

        async def make():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        try:
            with muted(("vllm.renderers.base",)):
                llm = asyncio.run_coroutine_threadsafe(make(), loop).result(CALL_TIMEOUT_S)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            restore_process(restore)
            raise
        return cls(llm, loop, thread, spec, restore=restore)

    def _call(self, coro, what: str, timeout_s: float | None = CALL_TIMEOUT_S):
        """Run `coro` on the engine's loop and wait for it (`what` names it in a timeout)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"vllm serving rollout: {what} took over {timeout_s:.0f} s") from None

    def _packed_leaf_map(self) -> dict[str, str]:
        from .vllm_weights import DEFAULT_PACKED_MODULES
        try:
            packed = self._call(self.llm.collective_rpc("mindspeed_packed_modules"), "reading the packed modules")[0]
        except Exception:  # noqa: BLE001 - a runner without that attribute: the Llama-family packing
            packed = {}
        packed = packed or DEFAULT_PACKED_MODULES
        return {leaf: fused for fused, leaves in packed.items() for leaf in leaves}

    # ---- generation
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: Sequence[int]) -> Rollout:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return Rollout(responses=[], log_probs=[])
        self._awake_for("generate", WAKE_TAGS)
        requests = []
        for i, (p, seed) in enumerate(zip(prompts, seeds)):
            sp = self._sampling_params(params, seed)
            sp.output_kind = RequestOutputKind.DELTA
            requests.append((f"{os.getpid()}-{next(self._ids)}", i,
                             TokensPrompt(prompt_token_ids=[int(t) for t in torch.as_tensor(p).tolist()]), sp))

        async def row(rid: str, index: int, prompt, sp):
            tokens, lps = [], []
            with self._rows_lock:
                self._rows[rid] = tokens
            try:
                async for out in self.llm.generate(prompt, sp, request_id=rid):
                    c = out.outputs[0]
                    new = list(c.token_ids)
                    if c.logprobs is not None:
                        lps.extend(c.logprobs[j][tok].logprob for j, tok in enumerate(new))
                    tokens.extend(new)
            except Exception as e:
                from vllm.v1.engine.exceptions import EngineDeadError
                if isinstance(e, EngineDeadError):
                    raise VLLMEngineDied(f"the vLLM engine core process of this rollout worker (pid "
                                         f"{self._engine_pid}) died: its rows cannot finish and the engine cannot be "
                                         f"used any more") from e
                raise RuntimeError(f"vllm serving rollout: row {index} of this generate call (prompt of "
                                   f"{len(prompt['prompt_token_ids'])} tokens) failed: "
                                   f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}") from e
            finally:
                with self._rows_lock:
                    self._rows.pop(rid, None)
            return tokens, lps, self._switches.pop(rid, {})

        async def rows():
            return await asyncio.gather(*(row(*r) for r in requests))

        outs = self._call(rows(), f"generating {len(requests)} rows", timeout_s=None)
        return Rollout(responses=[torch.tensor(t, dtype=torch.long) for t, _, _ in outs],
                       log_probs=[torch.tensor(lp, dtype=torch.float32) for _, lp, _ in outs],
                       version_switches=[s for _, _, s in outs])

    # ---- weights
    @contextlib.contextmanager
    def paused(self):
        """The requests in flight frozen with their KV cache while the weights load (`RolloutEngine.paused`)."""
        self._call(self.llm.pause_generation(mode="keep", clear_cache=False), "pausing generation")
        before = self.weight_version
        try:
            self._paused_at = self._settled_counts()
            yield
        finally:
            at, self._paused_at = self._paused_at, None
            if at is not None and self.weight_version != before:
                with self._rows_lock:
                    for rid, n in at.items():
                        if rid in self._rows:
                            self._switches.setdefault(rid, {})[n] = self.weight_version
            self._call(self.llm.resume_generation(), "resuming generation")

    def rows_in_flight(self) -> dict[str, int]:
        """Request id -> tokens received so far, for every row being generated now."""
        with self._rows_lock:
            return {rid: len(tokens) for rid, tokens in self._rows.items()}

    def _settled_counts(self) -> dict[str, int]:
        """Each row in flight's token count once none has changed for SETTLE_S (the scheduler is paused:
        only tokens already sampled can still arrive)."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            now = self.rows_in_flight()
            if now == last:
                return now
            last = now
            time.sleep(SETTLE_S)
        raise TimeoutError(f"vllm serving rollout: the paused rows' counts still moved after {CALL_TIMEOUT_S:.0f} s")

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors into one /dev/shm file, have the engine core's worker load it, delete it."""
        self._files += 1
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{id(self):x}-{self._files}")
        try:
            layout, size = write_weight_file(path, weights)
            loaded = self._call(self.llm.collective_rpc("mindspeed_reload_from_file", args=(path, size, layout)),
                                f"loading {len(layout)} tensors")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if any(n != len(layout) for n in loaded):
            raise RuntimeError(f"vllm serving rollout: the engine loaded {loaded} of {len(layout)} tensors from {path}")
        if self._paused_at is None:   # nothing in flight holds cached blocks of the old weights
            self._call(self.llm.reset_prefix_cache(), "resetting the prefix cache")

    # ---- the engine core process
    def engine_pids(self) -> list[int]:
        """The engine core process (and what vLLM started under it is its children)."""
        manager = getattr(getattr(self.llm, "engine_core", None), "resources", None)
        manager = getattr(manager, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", []) or [] if getattr(p, "pid", None)]

    def tp_workers(self) -> list[dict]:
        return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, self.llm = self.llm, None

        async def shutdown():   # on the loop: it cancels the client's output task there
            llm.shutdown()
        with contextlib.suppress(Exception):
            self._call(shutdown(), "shutting down")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        for f in Path(SHM_DIR).glob(f"{SHM_PREFIX}{os.getpid()}-{id(self):x}-*"):
            with contextlib.suppress(OSError):
                f.unlink()
        restore_process(self._restore)
        # shut down once: AsyncLLM.__del__ would do it again whenever the object goes, at interpreter exit too,
        # where vLLM's module globals are gone and it raises
        llm.shutdown = lambda *args, **kwargs: None
