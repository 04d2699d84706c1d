"""One Ray actor of a worker group: it hosts the engines of its MFCs and runs their stage loops.

Colocated placement puts several MFCs in one actor (like MindSpeed-RL's integrated worker); the
actor is threaded, so in non-blocking mode its stages run at the same time and take micro-batches
as they become ready. Disaggregated placement gives MFCs actors of their own. Either way, the
worker talks to other stages only through the dock, and to other workers only for weight sync
and its group's collectives (torch.distributed groups of its own, beside Ray).

A worker's one job is to be that actor: it receives its own part of the plan (`WorkerSpec`: its
MFCs with their implementations' arguments, its engines' declarations, its timeouts, never the
whole config) and hands the work to parts named for it:
- `EngineSet` (engine_set.py) builds and holds the engines;
- `run_stage` (stage.py) is the one loop every MFC runs, with this rank's role in the group's
  deployment (`WorkerSpec.role`, engines/deployment.py; `LoopRoles.of`: read if reader, share in
  the replica, call, write if writer); the engines get the same role and compute none;
- `build_impl` (impls.py) gives the MFC's implementation;
- `CollectiveTurns` (turns.py) orders the MFCs whose calls are collective over the group;
- `WeightHost` (weights.py) publishes and receives weights.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from ..device.host_memory import bound_kernel_caches, release_free_memory, resident_bytes
from . import compute as C
from .cores import CoreShare, bind_process
from .engine_set import EngineDecl, EngineSet
from ..engines.deployment import RankRole
from .impls import OPTIMIZER_STEP, StageContext, build_impl
from .stage import LoopRoles, StageError, run_stage
from .turns import CollectiveTurns
from .weights import WeightHost


@dataclass
class WorkerSpec:
    group: str
    rank: int
    dp: int
    mfcs: list[MFCDef]
    args: dict[str, dict]                       # MFC -> its implementation's arguments (impls.mfc_args)
    engines: list[EngineDecl]                   # what this worker's engines are (the driver resolved them)
    docks: list                                 # TransferDockClient per step in flight (step % len)
    role: RankRole                              # this actor's role in the group's deployment (engines/deployment.py)
    tokenizer_path: str = ""
    stop_tokens: list = field(default_factory=list)
    seed: int = 0
    stage_timeout_s: float = 120.0
    weight_sync: Any = None                     # WeightSyncConfig
    partial_rollout: bool = False               # rl_config.partial_rollout: a sync pauses generation, never drains it
    same_step_outputs: dict[str, list[str]] = field(default_factory=dict)  # train MFC -> same-step readers' columns
    rows_per_step: int = 0
    plugins: list = field(default_factory=list)  # trainer.plugins, imported before any engine is built
    torch_threads: int = 1
    cpu_affinity: list | None = None            # cores every thread of this process is bound to (null: not bound)
    device: str = "cpu"
    env: dict = field(default_factory=dict)
    tp: int = 1                                 # the tensor- and pipeline-parallel sizes over the group's actors
    pp: int = 1                                 # (its deployment); the group has dp * tp * pp ranks

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        bound_kernel_caches()   # before any kernel is built (device/host_memory.py); spec.env may set its own
        for k, v in spec.env.items():
            os.environ[k] = str(v)
        for dock in spec.docks:
            dock.worker = f"{spec.group}/{spec.rank}"  # this process's lane in the dock's event log
        if spec.cpu_affinity:
            bind_process(spec.cpu_affinity)
        torch.set_num_threads(spec.torch_threads)
        self.cores = CoreShare(spec.torch_threads)
        from ..engines.registry import import_plugins
        import_plugins(spec.plugins)
        self.process_group = None
        self.engines: EngineSet | None = None
        self.weights: WeightHost | None = None
        self.turns = CollectiveTurns()
        self._by_name = {m.name: m for m in spec.mfcs}
        self._collective_names: list[str] | None = None
        self._val: tuple | None = None   # (validation dock, MFC -> arguments, rows): attach_validation

    def ping(self) -> dict:
        import ray
        ctx = ray.get_runtime_context()
        accelerators = sorted(f"{kind}:{i}" for kind, ids in ctx.get_accelerator_ids().items() for i in ids)
        return {"pid": os.getpid(), "host": ray.util.get_node_ip_address(), "group": self.spec.group,
                "rank": self.spec.rank, "node_id": ctx.get_node_id(), "accelerators": accelerators}

    def sees_output_dir(self, output_dir: str, token: str) -> bool:
        """Whether this worker's node reads the driver's token in the run's directory (trainer/shared_dir.py)."""
        from ..trainer.shared_dir import sees_token
        return sees_token(output_dir, token)

    def free_port(self) -> int:
        from ..engines.sync.weight_sync import free_port
        return free_port()

    def init_process_group(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        """torch's default process group over this group's ranks (gloo on CPU): the DP ranks for DDP and
        FSDP, all dp * tp * pp ranks of a model-parallel group (the mesh backend's device mesh).

        Weight sync uses groups of its own (`init_sync_group`), so the two never collide.
        """
        from datetime import timedelta

        import torch.distributed as dist

        from ..device import dist_backend, resolve_device
        if self.spec.world > 1:
            dist.init_process_group(dist_backend(resolve_device(self.spec.device)),
                                    init_method=f"tcp://{host}:{port}", rank=self.spec.rank,
                                    world_size=self.spec.world, timeout=timedelta(seconds=timeout_s))
            self.process_group = dist.group.WORLD

    def setup(self) -> dict:
        """Build the engines this worker's MFCs need (from the registry)."""
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        s = self.spec
        self.engines = EngineSet(s.engines, seed=s.seed, device=s.device, process_group=self.process_group,
                                 tokenizer_path=s.tokenizer_path, stop_tokens=s.stop_tokens, role=s.role)
        self.engines.build()
        for args in s.args.values():  # a reward function's module that fails to import fails here, not mid-step
            if "reward_fn" in args:
                self.engines.reward_fn(args["reward_fn"])
        self.weights = WeightHost(self.engines, rank=s.rank, group=s.group, device=s.device, sync_cfg=s.weight_sync,
                                  stage_timeout_s=s.stage_timeout_s, partial_rollout=s.partial_rollout)
        return {}

    # ------------------------------------------------------------------ stages
    def run_stage(self, mfc_name: str, step: int, policy_version: int, kl_coef: float = 0.0,
                  validation: bool = False) -> dict:
        """Run one MFC's loop for one step (or, with `validation`, over the validation dock's rows at weights
        `policy_version`); returns its report (rows, times, metric sums)."""
        mfc = self._by_name.get(mfc_name)
        if mfc is None:
            raise StageError(f"worker group '{self.spec.group}' does not host stage '{mfc_name}'")
        # Ray runs each call on a thread of its pool, and torch.set_num_threads in __init__ reaches only the thread
        # that ran it: each call sets it on its own (measured: a 2-thread worker's matmuls ran at one thread's
        # speed, SmolLM2's GRPO update 13.8 s where it takes 8 s), and each micro-batch its share of them while
        # other stages compute beside it (workers/cores.py)
        torch.set_num_threads(self.spec.torch_threads)
        try:
            names = self._collective()
            # validation runs while no step's stage does (trainer/validation.py): no turn to wait for
            turn = (self.turns.turn(names, mfc.name, step) if mfc.name in names and not validation
                    else contextlib.nullcontext())
            with turn:
                rep = self._run(mfc, step, policy_version, kl_coef, validation)
            release_free_memory()   # what the stage freed goes back to the kernel (device/host_memory.py)
            rep.rss_bytes = resident_bytes()
        except StageError:
            raise
        except Exception as e:  # name the stage in every failure the driver sees
            import traceback
            where = traceback.extract_tb(e.__traceback__)[-1]
            when = f"validation at weight version {policy_version}" if validation else f"step {step}"
            raise StageError(f"stage '{mfc_name}' (group '{self.spec.group}', rank {self.spec.rank}, {when}) "
                             f"failed: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:"
                             f"{where.lineno})") from e
        return rep.as_dict()

    def _run(self, mfc: MFCDef, step: int, policy_version: int, kl_coef: float, validation: bool = False):
        if validation and self._val is None:
            raise StageError(f"stage '{mfc.name}': validation was not attached to worker group '{self.spec.group}'")
        dock, args, rows = self._val if validation else (self.dock_of(step), self.spec.args, self.spec.rows_per_step)
        ctx = StageContext(mfc=mfc, step=step, policy_version=policy_version, kl_coef=kl_coef,
                           args=args[mfc.name], host=self.engines)
        impl = build_impl(ctx)
        engine = self._engine(mfc)
        if validation and InterfaceType(mfc.interface_type) is InterfaceType.GENERATE \
                and engine.weight_version != policy_version:
            raise StageError(f"stage '{mfc.name}' (validation): the rollout engine holds weight version "
                             f"{engine.weight_version}, not the pinned version {policy_version}")
        with impl.session():
            roles = LoopRoles.of(self.spec.role, InterfaceType(mfc.interface_type), engine, rows)
            rep = run_stage(dock, impl, roles, stage=mfc.name, rank=self.spec.rank, step=step,
                            input_keys=mfc.input_keys, get_n_samples=mfc.get_n_samples,
                            timeout_s=self.spec.stage_timeout_s,
                            before_optimizer_step=lambda: self._wait_columns(mfc.name, step), cores=self.cores)
        if impl.kind == OPTIMIZER_STEP:
            rep.metrics["version"] = float(engine.version)
        return rep

    def _engine(self, mfc: MFCDef):
        kind = C.check_mfc(mfc).engine
        return self.engines.engine_for(mfc.model_name, kind) if kind else None

    def _split(self, mfc: MFCDef) -> bool:
        """Does `mfc` call a model whose replica spans several of this group's ranks (its deployment's roles)?"""
        return self.spec.role.split and bool(C.check_mfc(mfc).engine)

    def _collective(self) -> list[str]:
        """This group's MFCs whose engine calls are collective over its ranks, in the graph's order: every MFC
        of a split model; with dp > 1 a model trained here: its train step and, when its forwards are collective
        (sharded weights), its inference. A model only read here (a frozen reference) has an engine of its own,
        on no group of the DP ranks, unless it is the LoRA base of a model trained here (that model's engine)."""
        if self._collective_names is None:
            names = []
            for m in self.spec.mfcs:
                kind = InterfaceType(m.interface_type)
                if self.spec.role.split:
                    if self._split(m):
                        names.append(m.name)
                    continue
                if self.spec.role.dp == 1 or not self.engines.on_dp_group(m.model_name):
                    continue
                if kind is InterfaceType.TRAIN_STEP or (kind is InterfaceType.INFERENCE
                                                         and self._engine(m).collective_forward):
                    names.append(m.name)
            self._collective_names = names
        return self._collective_names

    def _wait_columns(self, stage: str, step: int) -> None:
        """Before a train MFC's first optimizer step: the step's other readers of these weights are done."""
        import time
        columns = self.spec.same_step_outputs.get(stage, [])
        if not columns:
            return
        deadline = time.time() + self.spec.stage_timeout_s
        while True:
            status = self.dock_of(step).get_column_status()
            missing = {c: status[c]["total"] - status[c]["written"] for c in columns
                       if status[c]["written"] < status[c]["total"]}
            if not missing:
                return
            if time.time() > deadline:
                raise StageError(f"stage '{stage}' (step {step}) timed out waiting for the step's readers of its "
                                 f"weights to finish before the optimizer step; rows still unwritten: {missing}")
            time.sleep(0.002)

    def dock_of(self, step: int):
        """The dock of `step`'s rows (one per step in flight: rl_config.max_weight_staleness + 1)."""
        return self.spec.docks[step % len(self.spec.docks)]

    def attach_validation(self, dock, args: dict[str, dict], rows: int) -> None:
        """The validation dock, its MFCs' arguments (generate_config.val's sampling, validation's own seed) and
        its rows: `run_stage(..., validation=True)` runs there (trainer/validation.py)."""
        dock.worker = f"{self.spec.group}/{self.spec.rank}"
        self._val = (dock, args, rows)

    # ------------------------------------------------------------------ weight sync (weights.py)
    def init_sync_group(self, model: str, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float = 60.0) -> None:
        self.weights.init_sync_group(model, host, port, rank, world_size, timeout_s)

    def device_key(self) -> str:
        return self.weights.device_key()

    def init_ipc_sync(self, model: str, role: str, peers=()) -> None:
        self.weights.init_ipc_sync(model, role, peers)

    def ipc_deliver(self, model: str, handles) -> Any:
        return self.weights.ipc_deliver(model, handles)

    def close_ipc_sync(self) -> None:
        if self.weights is not None:
            self.weights.close_ipc_sync()

    def sync_weights(self, model: str, version: int) -> dict:
        return self.weights.sync_weights(model, version)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, run_id: str) -> list[dict]:
        """This rank's part of the checkpoint, as its manifest entry (trainer/checkpoint.py)."""
        from ..trainer.checkpoint import part_records
        return part_records(directory, self.engines.save_checkpoint(directory, self.spec.rank, run_id))

    def load_checkpoint(self, directory: str, run_id: str) -> list[str]:
        return self.engines.load_checkpoint(directory, self.spec.rank, run_id)

    def save_hf(self, model: str, directory: str) -> str | None:
        """`model`'s trained weights as a Hugging Face checkpoint in `directory` (trainer.save_hf). Every rank
        draws the engine's export to its end (a sharded engine's gathers are collective); rank 0 writes each
        bucket as a safetensors shard as it comes, so no rank holds more than one bucket beyond its model."""
        from ..models.hf_export import SHARD_BYTES, VALUE, CAUSAL_LM, write_hf_checkpoint
        from .engine_set import TRAIN_ROLE
        engine = self.engines.train[model]
        decl = next(d for d in self.spec.engines if d.model == model and d.role == TRAIN_ROLE)
        if not decl.model_path:   # an engine without a model (the simulate backend's): no weights to write
            return None
        with engine.holding(False, "export"):
            buckets = engine.export_weights(SHARD_BYTES)
            if self.spec.rank != 0:
                for _ in buckets:
                    pass
                return None
            return str(write_hf_checkpoint(buckets, directory, decl.model_path,
                                           kind=VALUE if decl.model_kind == VALUE else CAUSAL_LM, dtype=decl.dtype,
                                           source=f"{model}'s {decl.backend.name} engine"))

    # ------------------------------------------------------------------ a reward model between steps
    def score_pairs(self, model: str, columns: dict, micro_batch_size: int) -> dict:
        """Scores of held-out preference pairs by `model`'s engine (reward modeling's evaluation)."""
        from .steps.reward_train import score_pairs
        return score_pairs(self.engines.engine_for(model, "reward"), columns, micro_batch_size)

    def save_pretrained(self, model: str, directory: str) -> str | None:
        """`model` as a plain HF checkpoint in `directory` (every rank takes part; rank 0 writes)."""
        from .steps.reward_train import save_pretrained
        decl = next(d for d in self.spec.engines if d.model == model and d.role != "rollout")
        return save_pretrained(self.engines.engine_for(model, "reward"), decl.model_path, self.engines.tokenizer,
                               directory, self.spec.rank)

    def close_rollout(self) -> None:
        """Shut this actor's rollout engines down before the driver kills it: vLLM with
        tensor_parallel_size > 1 ends its worker processes and removes its shared-memory queues, which
        a killed actor leaves in /dev/shm (its workers still exit: vLLM's death pipe)."""
        if self.engines is not None:
            self.engines.close_rollout()
