"""The engines one worker hosts: built from the declarations the driver resolved, looked up by model.

The driver decides, from the plan, which backend runs each model of a worker group, with which options
and dtype (`EngineDecl`); this class builds them through the registry and hands them out. It knows no
backend by name.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engines.rw_lock import ReadWriteLock

# An engine's role in a worker (`EngineDecl.role`).
ROLLOUT_ROLE, TRAIN_ROLE, INFER_ROLE = "rollout", "train", "infer"


@dataclass(frozen=True)
class EngineDecl:
    """One engine of a worker: which model, in which role (generating, trained, inferring), on which backend."""
    model: str
    role: str                            # ROLLOUT_ROLE, TRAIN_ROLE (with an optimizer) or INFER_ROLE (forward only)
    backend: Any                         # the registry's row the plan resolved (engines/registry.py Backend)
    model_path: str = ""                 # "": an engine without a model (the simulate backend's)
    model_kind: str = "causal_lm"        # causal_lm, value or reward
    dtype: str = "float32"
    options: dict = field(default_factory=dict)
    optim: Any = None                    # OptimConfig of a trained model
    temperature: float = 1.0             # log-probs of the sampling distribution
    max_seq_len: int = 0                 # the longest prompt + response of the run (RolloutSpec.max_seq_len)
    cuda_graphs: bool | None = None      # generate_config.cuda_graphs (RolloutSpec.cuda_graphs)
    features: dict = field(default_factory=dict)  # TrainSpec's model features (engines.base.MODEL_FEATURES) set
    base_of: str = ""                    # INFER_ROLE only: the model trained here with LoRA whose base (adapters off)
                                         # this engine is; no weights of its own are loaded (engines/train/lora.py)


class EngineSet:
    def __init__(self, decls: list[EngineDecl], *, seed: int, device: str, process_group, tokenizer_path: str,
                 stop_tokens: list[str], role: Any = None):
        """`tokenizer_path` "": no tokenizer (engines without a model); `role`: this rank's deployment.RankRole,
        handed to every engine it builds."""
        self.decls, self.seed, self.device_name = decls, seed, device
        self.process_group, self.tokenizer_path, self.role = process_group, tokenizer_path, role
        self.stop_tokens = list(stop_tokens)
        self.train: dict[str, Any] = {}     # model -> TrainEngine (with optimizer)
        self.infer: dict[str, Any] = {}     # model -> TrainEngine (no optimizer): a reader of another's model
        self.rollout: dict[str, Any] = {}   # model -> RolloutEngine
        self.tokenizer = None
        self.stop_ids: tuple[int, ...] = ()
        self._rewards: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._awake: dict[str, int] = {}
        self._weights: dict[str, Any] = {}

    def build(self) -> None:
        from ..device import resolve_device
        from ..engines import OptimConfig, RolloutSpec, TrainSpec
        torch.manual_seed(self.seed)
        device = str(resolve_device(self.device_name))
        pad = 0
        if self.tokenizer_path:
            from ..models import load_tokenizer
            self.tokenizer = load_tokenizer(self.tokenizer_path)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        for d in sorted(self.decls, key=lambda d: (d.role != TRAIN_ROLE,)):   # trained models first
            path = d.model_path
            if path:
                from ..models import resolve_model_path
                path = str(resolve_model_path(path))
            if d.role == ROLLOUT_ROLE:
                self.rollout[d.model] = d.backend.load().build(RolloutSpec(
                    model_path=path, dtype=d.dtype, device=device, pad_token_id=pad, seed=self.seed, options=d.options,
                    max_seq_len=d.max_seq_len, cuda_graphs=d.cuda_graphs, role=self.role))
                continue
            if d.base_of:   # the LoRA policy's own engine with its adapters off: no second copy of the weights
                from ..engines.train.lora import BaseReference
                self.infer[d.model] = BaseReference(self.train[d.base_of])
                continue
            optim = OptimConfig(**d.optim) if isinstance(d.optim, dict) else d.optim
            engine = d.backend.load().build(TrainSpec(
                model_path=path, model_kind=d.model_kind, dtype=d.dtype, device=device,
                pad_token_id=self._pad_of(d, path, pad),
                temperature=d.temperature, optim=optim if d.role == TRAIN_ROLE else None,
                process_group=self.process_group if self._on_group(d) else None, seed=self.seed, options=d.options,
                role=self.role, **d.features))
            (self.train if d.role == TRAIN_ROLE else self.infer)[d.model] = engine
        self.stop_ids = tuple(self._stop_token_ids()) if self.tokenizer is not None else ()

    def _on_group(self, decl: EngineDecl) -> bool:
        """Is this engine built over the worker group's DP ranks: a trained model, or an inference copy (a frozen
        reference) on a backend that shards its weights, whose forwards are then collective like the trained
        model's (each rank holds 1 / dp of it, not the whole)."""
        from ..engines import memory_model as MM
        return decl.role == TRAIN_ROLE or (decl.role != ROLLOUT_ROLE and not decl.base_of
                                           and getattr(decl.backend, "memory", None) == MM.SHARDED)

    def _pad_of(self, decl: EngineDecl, path: str, pad: int) -> int:
        """The pad id an engine pads with: the run's tokenizer's, but a reward model's own (it may read other
        token ids than the policy's: workers/steps/reward_model_score.py re-tokenizes for it)."""
        if decl.model_kind != "reward" or not path:
            return pad
        from ..models import load_tokenizer
        tok = load_tokenizer(path)
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _stop_token_ids(self) -> list[int]:
        from ..models.checkpoint import stop_token_ids
        from .stage import StageError
        try:
            return stop_token_ids(self.tokenizer, self.stop_tokens)
        except ValueError as e:
            raise StageError(str(e)) from None

    # ------------------------------------------------------------------ lookups
    def engine_for(self, model: str, kind: str):
        """The engine an MFC of `model` calls: its rollout engine for kind "rollout", else the trained engine
        (its own log-probs, values) or an inference copy (a frozen reference, a reader of a remote trainer)."""
        if kind == ROLLOUT_ROLE:
            return self.rollout[model]
        return self.train.get(model) or self.infer[model]

    def trains(self, model: str) -> bool:
        return model in self.train

    def on_dp_group(self, model: str) -> bool:
        """Does `model`'s engine here run over the worker group's DP ranks (their process group): trained here,
        the LoRA base (adapters off) of a model trained here, whose engine it is, or sharded over them."""
        return self.process_group is not None and (model in self.train or any(
            d.model == model and (d.base_of or self._on_group(d)) for d in self.decls))

    def readers(self, model: str) -> list[Any]:
        """The engines here that read `model` without training it: its rollout, an inference copy."""
        out = [self.rollout[model]] if model in self.rollout else []
        if model in self.infer and model not in self.train:
            out.append(self.infer[model])
        return out

    def reward_fn(self, name: str):
        with self._lock:
            if name not in self._rewards:
                from ..rewards import get_reward_fn
                self._rewards[name] = get_reward_fn(name)
            return self._rewards[name]

    def weights_lock(self, model: str) -> ReadWriteLock:
        with self._lock:
            return self._weights.setdefault(model, ReadWriteLock())

    @contextlib.contextmanager
    def awake(self, model: str):
        """The rollout engine holds its device memory while a generate stage runs and gives it back when
        the last one ends (vLLM's sleep mode, `generate_config.vllm.enable_sleep_mode`; a no-op otherwise),
        so a trainer sharing the device gets the memory between rollouts. Counted: ReMax runs two
        generate stages on one engine at once, and with max_weight_staleness k the stages of k + 1 steps.

        Falling asleep and waking hold the model's weights lock for writing: the engine never does either
        while a sync writes its weights (`wake_weights`) or a micro-batch generates. A stage that finds
        the engine awake (another stage holds it) only counts itself in and out, so the stages of steps
        in flight start and end without waiting for each other's micro-batches. Waking wakes what is still
        asleep (after a sync, only the KV cache), after this process's trainer gave its cached device
        memory back."""
        engine = self.rollout[model]
        lock = self.weights_lock(model)
        with self._lock:
            joined = self._awake.get(model, 0) > 0
            if joined:
                self._awake[model] += 1
        if not joined:
            with lock.writing():
                with self._lock:
                    self._awake[model] = self._awake.get(model, 0) + 1
                    first = self._awake[model] == 1
                if first:
                    self.release_cache()
                    engine.wake_up()
        try:
            yield
        finally:
            with self._lock:
                others = self._awake[model] > 1
                if others:
                    self._awake[model] -= 1
            if not others:
                with lock.writing():
                    with self._lock:
                        self._awake[model] -= 1
                        last = self._awake[model] == 0
                    if last:
                        engine.sleep()

    def wake_weights(self, model: str) -> None:
        """A sleeping rollout engine's weights back before a sync writes them, its KV cache left asleep
        until a generate stage wakes it (vLLM's colocation order: wake_up(tags=["weights"]), load,
        wake_up(tags=["kv_cache"])). The caller holds the model's weights lock for writing."""
        if model in self.rollout:
            self.release_cache()
            self.rollout[model].wake_up(tags=("weights",))

    @contextlib.contextmanager
    def holding(self, mfc, training: bool):
        """The state an MFC's train or inference engine needs on the device while its stage runs
        (`TrainEngine.holding`: what offload put on the host comes back, and leaves after the stage;
        engines/train/offload.py). After a train stage the cached device memory goes back to the driver, so a
        rollout sharing the device in another process (vLLM waking from sleep) finds it free."""
        from .compute import check_mfc
        kind = check_mfc(mfc).engine
        if not kind or kind == ROLLOUT_ROLE:
            yield
            return
        with self.engine_for(mfc.model_name, kind).holding(training, mfc.name):
            yield
        if training:
            self.release_cache()

    def release_cache(self) -> None:
        """This process's cached device memory back to the driver (nothing on the CPU)."""
        from ..device import empty_cache, resolve_device
        empty_cache(resolve_device(self.device_name))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, rank: int, run_id: str) -> list[str]:
        """Each trained model's engine writes its state under `directory/<model>/` (every rank calls it: a
        sharded engine writes its shards), and this rank its RNG states with the run's id (`rng_file`): each
        rank's part names the run that wrote it, so a resume can tell another run's file at that path."""
        from ..models.files import save_file
        from ..trainer.checkpoint import rng_file
        written = []
        for model, engine in self.train.items():
            where = os.path.join(directory, model)
            with engine.holding(True, "checkpoint"):
                written += engine.save_checkpoint(where)
            os.makedirs(where, exist_ok=True)   # a DDP rank > 0 writes no engine state, only its RNG states
            written.append(save_file({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                      "python": random.getstate(), "run_id": run_id, "rank": rank},
                                     os.path.join(where, rng_file(rank))))
        return written

    def load_checkpoint(self, directory: str, rank: int, run_id: str) -> list[str]:
        """This rank's part of the checkpoint: the engines' state and its own RNG states, refused
        (CheckpointFileError naming the file) where the RNG file is not of run `run_id` (the manifest's)."""
        from ..models.files import CheckpointFileError, load_file
        from ..trainer.checkpoint import rng_file
        loaded = []
        for model, engine in self.train.items():
            where = os.path.join(directory, model)
            path = os.path.join(where, rng_file(rank))
            rng = load_file(path, what="RNG state")
            if rng.get("run_id") != run_id:
                raise CheckpointFileError(f"{path} was written by run {rng.get('run_id')}, not by run {run_id} whose "
                                          "manifest lists it: another run's file; delete that checkpoint directory to "
                                          "resume from the previous one")
            with engine.holding(True, "checkpoint"):
                engine.load_checkpoint(where)
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            loaded.append(where)
        return loaded

    def close_rollout(self) -> None:
        for engine in self.rollout.values():
            with contextlib.suppress(Exception):
                engine.close()
        self.rollout = {}
