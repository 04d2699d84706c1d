"""One Ray actor of a worker group: it hosts the engines of its MFCs and runs their stage loops.

Colocated placement puts several MFCs in one actor (like MindSpeed-RL's integrated worker); the
actor is threaded, so in non-blocking mode its stages run at the same time and take micro-batches
as they become ready. Disaggregated placement gives MFCs actors of their own. Either way, the
worker talks to other stages only through the dock, and to other workers only for weight sync
and DDP (torch.distributed groups of its own, beside Ray). The exception to "at the same time": the
MFCs whose engine calls are collective over the group's DP ranks (a trained model's training, and with
FSDP or another sharded backend its log-probs or values) take turns in the graph's order, the same on
every rank, since two collective streams in two threads pair up differently on different ranks
(`Worker._turn`).

A model-parallel group (placement.mode: mesh with tp or pp > 1) has dp * tp * pp ranks, rank k the
topology's sub-rank k, and runs its models on the mesh train backend (a generating group on the mesh
rollout backend, when the rollout backend splits that way). MindSpeed-RL's rule: only a
replica's reader (pp 0, tp 0) pulls micro-batches from the dock, so each replica takes its rows
exactly once; every rank calls the engine as many times, in the same order (the readers tell their
peers when a stage is done); only a replica's writer (tp 0 of the last stage) pushes outputs. Its
MFCs take turns within a step (log-probs, then training), since every one of them is collective over
the same ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import Config
from ..config.sizes import group_rows, train_sizes
from ..dataflow import MFCDef
from ..dataflow.mfc import InterfaceType
from . import compute as C
from .stage import StageError, StageReport, add_metrics, micro_batches, run_stage_loop


@dataclass
class WorkerSpec:
    group: str
    rank: int
    dp: int
    mfcs: list[MFCDef]
    config: Config
    docks: list                                 # TransferDockClient per step in flight (step % len)
    model_paths: dict[str, str]                 # model_name -> checkpoint path
    trained_models: dict[str, str]              # model_name -> train MFC name (whole graph)
    same_step_outputs: dict[str, list[str]]     # train MFC -> columns its same-step readers write
    rows_per_step: int = 0
    torch_threads: int = 1
    device: str = "cpu"
    env: dict = field(default_factory=dict)
    tp: int = 1                                 # placement.mode=mesh: the group's tensor- and pipeline-parallel
    pp: int = 1                                 # sizes; the group has dp * tp * pp ranks, `rank` its sub-rank
    engine_tp: int = 1                          # an engine-split rollout group (GroupPlan.engine_rollout): this
                                                # actor is one DP replica whose rollout engine (vLLM) starts this
                                                # many tensor-parallel ranks of its own (tp, pp above stay 1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def model_parallel(self) -> bool:
        return self.tp * self.pp > 1


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.cfg = spec.config
        for k, v in spec.env.items():
            os.environ[k] = str(v)
        for dock in spec.docks:
            dock.worker = f"{spec.group}/{spec.rank}"  # this process's lane in the dock's event log
        torch.set_num_threads(spec.torch_threads)
        self.train: dict[str, Any] = {}     # model -> TrainEngine (with optimizer)
        self.infer: dict[str, Any] = {}     # model -> TrainEngine (no optimizer): a reader of another's model
        self.rollout: dict[str, Any] = {}   # model -> RolloutEngine
        self.sync_groups: dict[str, Any] = {}
        self.ipc_senders: dict[str, Any] = {}      # model -> IPCSender (the trainer's rank 0, weight_sync ipc)
        self.ipc_peers: dict[str, list] = {}       # model -> the reader actors it hands handles to
        self.ipc_mailboxes: dict[str, Any] = {}    # model -> Mailbox (a reader): handles arrive on other threads
        self.ipc_attach: dict[str, Any] = {}       # model -> IPCAttachments (a reader's mappings, kept across syncs)
        self.ddp_group = None
        self.tokenizer = None
        self.reward_fn = None
        self.simulated = False
        self._awake_lock = threading.Lock()
        self._awake_count: dict[str, int] = {}
        self._locks: dict[str, ReadWriteLock] = {}  # model -> generate (read) vs weight update (write)
        self._turns = threading.Condition()         # the collective MFCs take turns (`_turn`)
        self._turn_next: tuple[int, int] | None = None  # (step, index of the collective MFC) whose turn it is

    # ------------------------------------------------------------------ setup
    def ping(self) -> dict:
        import ray
        return {"pid": os.getpid(), "host": ray.util.get_node_ip_address(), "group": self.spec.group,
                "rank": self.spec.rank, "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        from ..engines.weight_sync import free_port
        return free_port()

    def init_ddp(self, host: str, port: int, timeout_s: float = 60.0) -> None:
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
            self.ddp_group = dist.group.WORLD

    def setup(self) -> dict:
        """Build the engines this worker's MFCs need (from the registry); returns their checksums."""
        from transformers.utils import logging as hf_logging

        from ..data.loader import decode_label
        self._decode_label = decode_label  # imported here so a broken install fails at setup, not mid-step
        from ..device import resolve_device
        from ..engines import OptimConfig, RolloutSpec, TrainSpec, make_rollout_engine, make_train_engine
        from ..engines.registry import MESH, SIMULATE, chosen_backends

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.manual_seed(self.cfg.trainer.seed)
        rollout_backend, train_backend = chosen_backends(self.cfg)
        self.simulated = rollout_backend == SIMULATE
        split = self.spec.model_parallel and not self.simulated
        if split:  # a model-parallel group: every model engine here is split over the group's mesh
            train_backend = MESH
            if self._mesh_rollout:  # generation on the mesh's stages (Backend.split == "mesh")
                rollout_backend = MESH
        device = str(resolve_device(self.spec.device))
        a, g = self.cfg.actor_config, self.cfg.generate_config
        fns = {m.name: C.check_mfc(m) for m in self.spec.mfcs}
        pad = 0
        if not self.simulated:
            from ..models import load_tokenizer
            self.tokenizer = load_tokenizer(self.spec.model_paths["actor"])
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        costs = self._simulated_costs(fns) if self.simulated else {}

        def model_path(model: str) -> str:
            from ..models import resolve_model_path
            return str(resolve_model_path(self.spec.model_paths[model])) if not self.simulated else ""

        def train_spec(model: str, f: C.ComputeFn, optim) -> TrainSpec:
            if self.simulated:
                options = {"costs": costs.get(model, {})}
            elif split:
                options = {"tp": self.spec.tp, "pp": self.spec.pp, "dp": self.spec.dp}
            else:  # config-driven engine options (the plan checked that the backend reads them)
                options = ({"max_tokens_per_micro_batch": a.max_tokens_per_micro_batch}
                           if a.max_tokens_per_micro_batch else {})
            return TrainSpec(model_path=model_path(model), model_kind="value" if f.engine == "value" else "causal_lm",
                             dtype=a.dtype, device=device, pad_token_id=pad, temperature=g.temperature or 1.0,
                             optim=optim, process_group=self.ddp_group if optim is not None else None,
                             seed=self.cfg.trainer.seed, options=options)

        for m in self.spec.mfcs:
            f, model = fns[m.name], m.model_name
            if f.interface is InterfaceType.TRAIN_STEP and model not in self.train:
                o = self._train_config(f)
                opt = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(a.betas), grad_clip=o.grad_clip)
                self.train[model] = make_train_engine(train_backend, train_spec(model, f, opt))
        for m in self.spec.mfcs:
            f, model = fns[m.name], m.model_name
            if f.engine == "rollout" and model not in self.rollout:
                t = self.cfg.trainer
                options = ({"costs": costs.get(model, {}), "slots": t.simulate_generate_slots,
                            "sigma": t.simulate_generate_sigma} if self.simulated else
                           {"tp": self.spec.tp, "pp": self.spec.pp, "dp": self.spec.dp} if rollout_backend == MESH else
                           {**dataclasses.asdict(g.vllm), "tensor_parallel_size": self.spec.engine_tp,
                            "max_model_len": g.vllm.max_model_len or self.cfg.data.max_prompt_length + g.max_new_tokens})
                self.rollout[model] = make_rollout_engine(rollout_backend, RolloutSpec(
                    model_path=model_path(model), dtype=a.dtype, device=device, pad_token_id=pad,
                    seed=self.cfg.trainer.seed, options=options))
            elif f.interface is InterfaceType.INFERENCE and model not in self.train and model not in self.infer:
                self.infer[model] = make_train_engine(train_backend, train_spec(model, f, None))
            elif f.name == "rule_reward" and self.reward_fn is None and not self.simulated:
                from ..rewards import get_reward_fn
                self.reward_fn = get_reward_fn(self.cfg.rl_config.reward_fn)
        self._stop_ids = tuple(self._stop_token_ids()) if not self.simulated else ()
        return {}

    def _simulated_costs(self, fns: dict[str, C.ComputeFn]) -> dict[str, dict[str, float]]:
        """model -> {what its engine is asked to do: seconds per row}, from trainer.simulate_cost_s_per_row
        (keyed by stage): the simulate backend's cost model (engines/simulate.py)."""
        per_stage = self.cfg.trainer.simulate_cost_s_per_row
        out: dict[str, dict[str, float]] = {}
        for m in self.spec.mfcs:
            f = fns[m.name]
            if f.engine:
                key = "train" if f.interface is InterfaceType.TRAIN_STEP else f.name
                out.setdefault(m.model_name, {})[key] = float(per_stage.get(m.name, 0.0))
        return out

    def _stop_token_ids(self) -> list[int]:
        ids = []
        for tok in self.cfg.generate_config.stop_tokens:
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if tid is None or (tid == self.tokenizer.unk_token_id and tok != self.tokenizer.unk_token):
                raise StageError(f"generate_config.stop_tokens: {tok!r} is not a token of the tokenizer")
            ids.append(int(tid))
        return ids

    # ------------------------------------------------------------------ stages
    def run_stage(self, mfc_name: str, step: int, policy_version: int, kl_coef: float = 0.0) -> dict:
        """Run one MFC's loop for one step; returns its report (rows, times, metric sums)."""
        mfc = next((m for m in self.spec.mfcs if m.name == mfc_name), None)
        if mfc is None:
            raise StageError(f"worker group '{self.spec.group}' does not host stage '{mfc_name}'")
        try:
            kind = InterfaceType(mfc.interface_type)
            with self._turn(mfc, step) if self._collective(mfc) else contextlib.nullcontext():
                rep = self._run(mfc, kind, step, policy_version, kl_coef)
        except StageError:
            raise
        except Exception as e:  # name the stage in every failure the driver sees
            import traceback
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise StageError(f"stage '{mfc_name}' (group '{self.spec.group}', rank {self.spec.rank}, step {step}) "
                             f"failed: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:"
                             f"{where.lineno})") from e
        return rep.as_dict()

    def _run(self, mfc: MFCDef, kind: InterfaceType, step: int, policy_version: int, kl_coef: float) -> StageReport:
        if self._split(mfc):
            return (self._run_train(mfc, step, kl_coef) if kind is InterfaceType.TRAIN_STEP else
                    self._run_replica_forward(mfc, step, policy_version))
        if kind is InterfaceType.TRAIN_STEP:
            return self._run_train(mfc, step, kl_coef)
        if kind is InterfaceType.GENERATE:
            with self._awake(mfc.model_name):
                return run_stage_loop(self.dock_of(step), stage=mfc.name, rank=self.spec.rank, step=step,
                                      input_keys=mfc.input_keys, count=self._count(mfc),
                                      get_n_samples=mfc.get_n_samples, timeout_s=self.cfg.trainer.stage_timeout_s,
                                      compute=self._compute_fn(mfc, step, policy_version))
        return run_stage_loop(self.dock_of(step), stage=mfc.name, rank=self.spec.rank, step=step,
                              input_keys=mfc.input_keys, count=self._count(mfc),
                              get_n_samples=mfc.get_n_samples, timeout_s=self.cfg.trainer.stage_timeout_s,
                              compute=self._compute_fn(mfc, step, policy_version),
                              max_rows=self._share(mfc, kind))

    # ------------------------------------------------------------------ collective MFCs take turns
    def _collective(self, mfc: MFCDef) -> bool:
        """Are `mfc`'s engine calls collective over this group's ranks, so that it must take its turn (`_turn`)?

        In a model-parallel group, the split MFCs. Otherwise, with dp > 1, the MFCs of a model trained here,
        whose engine is on the group's default process group: its train step (DDP's all-reduces; FSDP's
        gathers, reduce-scatters and grad-norm all-reduce) and, when the backend's forwards are collective
        (`Backend.lockstep`: sharded weights), its inference (old log-probs, a critic's values). A model only
        read here (a frozen reference) has an engine of its own, on no group of the DP ranks."""
        if self.spec.model_parallel:
            return self._split(mfc)
        if self.spec.dp == 1 or self.simulated or mfc.model_name not in self.train:
            return False
        kind = InterfaceType(mfc.interface_type)
        return kind is InterfaceType.TRAIN_STEP or (kind is InterfaceType.INFERENCE and self._lockstep)

    @property
    def _lockstep(self) -> bool:
        """Are the train backend's forwards collective across the DP ranks (`Backend.lockstep`)?"""
        from ..engines.registry import TRAIN_BACKENDS, chosen_backends
        return TRAIN_BACKENDS[chosen_backends(self.cfg)[1]].lockstep

    # ------------------------------------------------------------------ model-parallel groups
    @property
    def _mesh_rollout(self) -> bool:
        """Does this group generate on the mesh rollout backend (the configured rollout backend splits
        by running on the mesh, `Backend.split == "mesh"`, and the group has tp or pp > 1)?"""
        from ..engines.registry import ROLLOUT_BACKENDS, chosen_backends
        backend = ROLLOUT_BACKENDS.get(chosen_backends(self.cfg)[0])
        return self.spec.model_parallel and backend is not None and backend.split == "mesh"

    def _split(self, mfc: MFCDef) -> bool:
        """Does `mfc` run on a model split over this group's ranks (tp or pp > 1)?"""
        kind = InterfaceType(mfc.interface_type)
        return (self.spec.model_parallel and not self.simulated
                and (kind in (InterfaceType.TRAIN_STEP, InterfaceType.INFERENCE)
                     or (kind is InterfaceType.GENERATE and self._mesh_rollout)))

    @contextlib.contextmanager
    def _turn(self, mfc: MFCDef, step: int):
        """The collective MFCs (`_collective`) run one at a time, in (step, the graph's order) order: each is
        collective over the group's ranks, and two of them at once in two threads could issue their collectives
        in different orders on different ranks and wait on each other crosswise (and, on one FSDP module,
        reshard the parameters the other's forward is using). Every rank keeps the same order. Without it an
        FSDP group with dp=2 died every few dozen steps (issue 24): a rank's actor_train took rows its peer's
        actor_log_prob had just written, and its forward's all-gathers started while its own actor_log_prob
        was still in its last forward; gloo aborted on a message of another size, or a forward met a resharded
        parameter (`aten.mm got mixed torch.Tensor and DTensor`).

        The trainer starts every collective MFC of a group for each step it runs, in that order
        (`actor_log_prob` then `actor_train`; a critic's values and training; a split reference's one MFC): so
        the turn after (s, last) is (s + 1, first). They all run at their step's turn (train-time MFCs,
        `dataflow.train_time_mfcs`), except a split frozen reference: with max_weight_staleness > 0 its MFC of
        step s + 1 may be called while step s's still runs; it then waits for it. A trained model's log-probs
        are needed by its training anyway, so taking turns costs only the overlap of a rank's first training
        forwards with its peers' last log-prob forwards."""
        names = [m.name for m in self.spec.mfcs if self._collective(m)]
        mine = (step, names.index(mfc.name))
        with self._turns:
            if self._turn_next is None:  # the first step this process runs (0, or a resumed run's)
                self._turn_next = (step, 0)
            while self._turn_next < mine:
                self._turns.wait(1.0)
        try:
            yield
        finally:
            with self._turns:
                if self._turn_next <= mine:
                    s, i = mine
                    self._turn_next = (s, i + 1) if i + 1 < len(names) else (s + 1, 0)
                self._turns.notify_all()

    def _run_replica_forward(self, mfc: MFCDef, step: int, policy_version: int) -> StageReport:
        """An inference or generate MFC on a split model: the replica's reader pulls micro-batches from the
        dock (all it can get: the dock hands each row to one reader), every rank calls the engine once per
        micro-batch, the writer computes the outputs and pushes them.

        Before each engine call the readers say, by a MAX all-reduce, whether any of them has a
        micro-batch; all stop together when none has. For inference that is over the group's ranks, since
        an FSDP-sharded forward is collective over the replicas: a replica that has run out while another
        has not calls the engine with no rows (the engine pads FSDP's forwards). Generation replicas hold
        whole copies and run independently, so each replica asks only its own ranks. With pp > 1 (and for
        generation, tp > 1) the reader broadcasts each micro-batch (rows and columns) to its replica
        (`parallel.broadcast_micro_batch`), so the writer knows which rows it writes and every rank samples
        with the same per-row seeds."""
        import torch.distributed as dist

        from ..parallel import broadcast_micro_batch
        generate = InterfaceType(mfc.interface_type) is InterfaceType.GENERATE
        engine = (self.rollout[mfc.model_name] if generate else
                  self.train.get(mfc.model_name) or self.infer[mfc.model_name])
        rep = StageReport(stage=mfc.name, rank=self.spec.rank, step=step)
        rep.t_start = time.time()
        dock = self.dock_of(step)
        count = self._count(mfc)
        reader, writer = engine.is_reader, engine.is_writer
        batches = (micro_batches(dock, stage=mfc.name, rank=self.spec.rank, step=step, input_keys=mfc.input_keys,
                                 count=count, get_n_samples=mfc.get_n_samples,
                                 timeout_s=self.cfg.trainer.stage_timeout_s, report=rep) if reader else None)
        compute = self._compute_fn(mfc, step, policy_version) if writer or generate else None
        call = None if generate else getattr(engine, C.fn_name(mfc))   # log_probs or values
        device = engine.device if engine.device.type != "cpu" else None
        bcast = engine.replica_group is not None and (generate or engine.reader != engine.last_tp0)
        more = torch.zeros(1, dtype=torch.long, device=engine.device)
        ask = engine.replica_group if generate else None
        while True:
            item = next(batches, None) if reader else None
            more.fill_(int(item is not None))
            if not generate or ask is not None:
                dist.all_reduce(more, op=dist.ReduceOp.MAX, group=ask)
            if not int(more.item()):
                break
            batch, rows = item if item is not None else ({}, [])
            t1 = time.perf_counter()
            if bcast:
                batch, rows = broadcast_micro_batch(batch if reader else None, rows if reader else None,
                                                    src=engine.reader, group=engine.replica_group, device=device)
            if generate or (writer and rows):
                out = compute(batch, rows)
                t2 = time.perf_counter()
                if writer and out.columns:
                    dock.put_experience(out.columns, rows, producer=mfc.name, wait=False)
                if writer:
                    add_metrics(rep.metrics, out.metrics)
                rep.put_s += time.perf_counter() - t2
                rep.compute_s += t2 - t1
            else:
                args = {mfc.arg_name(k): v for k, v in batch.items()}
                call(args.get("prompts", []) if reader else None, args.get("responses", []) if reader else None,
                     count)
                rep.compute_s += time.perf_counter() - t1
        if reader or writer:
            dock.flush()
        rep.t_end = time.time()
        return rep

    def dock_of(self, step: int):
        """The dock of `step`'s rows (one per step in flight: rl_config.max_weight_staleness + 1)."""
        return self.spec.docks[step % len(self.spec.docks)]

    @contextlib.contextmanager
    def _awake(self, model: str):
        """The rollout engine holds its device memory while a generate stage runs and gives it back when
        the last one ends (vLLM's sleep mode, `generate_config.vllm.enable_sleep_mode`; a no-op otherwise),
        so a trainer sharing the device gets the memory between rollouts. Counted: ReMax runs two
        generate stages on one engine at once."""
        engine = self.rollout[model]
        with self._awake_lock:
            self._awake_count[model] = self._awake_count.get(model, 0) + 1
            if self._awake_count[model] == 1:
                engine.wake_up()
        try:
            yield
        finally:
            with self._awake_lock:
                self._awake_count[model] -= 1
                if self._awake_count[model] == 0:
                    engine.sleep()

    def _share(self, mfc: MFCDef, kind: InterfaceType) -> int | None:
        """Rows this rank takes of an inference MFC: all it can get, except when its engine's forwards are
        collective across the DP ranks (sharded weights, `Backend.lockstep`): then an equal share, so every
        rank makes as many forwards and none waits on a peer that ran out of rows."""
        if kind is not InterfaceType.INFERENCE or self.spec.dp == 1 or not self._lockstep:
            return None
        return self.spec.rows_per_step // self.spec.dp

    def _train_config(self, f: C.ComputeFn):
        """The config section of a trained model: critic_config for a value model, else actor_config."""
        return self.cfg.critic_config if f.engine == "value" else self.cfg.actor_config

    def _count(self, mfc: MFCDef) -> int:
        """Rows per dock get of a non-train MFC, rounded down to whole prompt groups where it needs them
        (the same rounding the plan prints: config/sizes.py)."""
        n = self.cfg.rl_config.n_samples_per_prompt
        f = C.FUNCTIONS[C.fn_name(mfc)]
        if mfc.micro_batch_size:
            count = mfc.micro_batch_size
        elif f.interface is InterfaceType.GENERATE:
            return group_rows(self.cfg.generate_config.micro_batch_size_per_device, n)
        elif f.interface is InterfaceType.INFERENCE:
            if f.engine == "value":
                return self.cfg.critic_config.forward_micro_batch_size_per_device
            return (self.cfg.ref_config.log_prob_micro_batch_size_per_device
                    if mfc.model_name not in self.spec.trained_models
                    else self.cfg.actor_config.log_prob_micro_batch_size_per_device)
        else:
            count = self.cfg.rl_config.dock_micro_batch_size
        return group_rows(count, n) if mfc.get_n_samples else count

    def _compute_fn(self, mfc: MFCDef, step: int, policy_version: int):
        """The MFC's function on a micro-batch, with the MFC's key remaps applied on both sides."""
        fn = self._function(mfc, C.fn_name(mfc), step, policy_version)

        def run(batch, rows):
            out = fn({mfc.arg_name(k): v for k, v in batch.items()}, rows)
            columns = {mfc.column_of(k): v for k, v in out.columns.items()}
            out.columns = {k: v for k, v in columns.items() if k in mfc.output_keys}
            return out
        return run

    def _function(self, mfc: MFCDef, name: str, step: int, policy_version: int):
        cfg = self.cfg
        rl = cfg.rl_config
        if self.simulated and not C.FUNCTIONS[name].engine:  # engines simulate themselves; these sleep here
            from .simulate import simulated_compute
            return simulated_compute(mfc, float(cfg.trainer.simulate_cost_s_per_row.get(mfc.name, 0.0)))
        if name in ("generate", "generate_greedy"):
            engine = self.rollout[mfc.model_name]
            lock = self._weights_lock(mfc.model_name)
            lag = step - engine.weight_version  # rows of step s may come from weights of version >= s - k
            if mfc.model_name in self.spec.trained_models and lag > rl.max_weight_staleness:
                raise StageError(f"stage '{mfc.name}': step {step} would be generated with weights of version "
                                 f"{engine.weight_version}, {lag} versions old; rl_config.max_weight_staleness="
                                 f"{rl.max_weight_staleness} forbids it")
            from ..engines import SamplingParams
            g = cfg.generate_config
            greedy = name == "generate_greedy" or g.temperature == 0
            params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                    top_k=g.top_k, stop_token_ids=self._stop_ids, greedy=greedy)

            def generate(batch, rows):
                with lock.reading() if engine.concurrent_generate else lock.writing():
                    return C.generate(batch, rows, engine=engine, params=params, seed=cfg.trainer.seed, step=step)
            return generate
        if name in ("log_probs", "values"):
            engine = self.train.get(mfc.model_name) or self.infer[mfc.model_name]
            mb = self._count(mfc)
            f = C.log_probs if name == "log_probs" else C.values
            return lambda batch, rows: f(batch, rows, engine=engine, micro_batch_size=mb)
        if name == "rule_reward":
            return lambda batch, rows: C.rule_reward(batch, rows, reward_fn=self.reward_fn,
                                                     tokenizer=self.tokenizer, decode_label=self._decode_label)
        if name == "grpo_advantage":
            return lambda batch, rows: C.grpo_advantage(batch, rows, n_samples_per_prompt=rl.n_samples_per_prompt,
                                                        eps=rl.adv_eps, norm_by_std=rl.norm_adv_by_std)
        if name == "gae_advantage":
            return lambda batch, rows: C.gae_advantage(batch, rows, gamma=rl.gamma, lam=rl.lam)
        if name == "remax_advantage":
            return C.remax_advantage
        raise StageError(f"stage '{mfc.name}': fn={name!r} has no runner in the worker; known: {sorted(C.FUNCTIONS)}")

    def _run_train(self, mfc: MFCDef, step: int, kl_coef: float) -> StageReport:
        """An optimizer step per mini-batch of rows: the engine's `train_step` consumes the micro-batches
        straight from the dock as they become ready (forward/backward/accumulation are the engine's)."""
        from ..engines import MicroBatch
        f = C.FUNCTIONS[C.fn_name(mfc)]
        o = self._train_config(f)
        engine = self.train[mfc.model_name]
        rl = self.cfg.rl_config
        sizes = train_sizes(o.ppo_mini_batch_size, o.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                            rl.n_samples_per_prompt, self.spec.dp)   # dp replicas: tp/pp ranks share their rows
        per_rank, mini, micro = sizes.rows_per_device, sizes.mini_rows_per_device, sizes.micro_rows
        if f.name == "value_train":
            loss_fn = C.value_loss_fn(C.ValueLossConfig(clip_value=o.cliprange_value, agg=o.loss_agg_mode))
        else:
            loss_fn = C.policy_loss_fn(C.PolicyLossConfig(
                clip_low=o.clip_ratio_low, clip_high=o.clip_ratio_high, clip_c=o.clip_ratio_c, agg=o.loss_agg_mode,
                use_kl_loss=o.use_kl_loss, kl_type=o.kl_loss_type, entropy_coeff=o.entropy_coeff,
                off_policy_correction=o.off_policy_correction, tis_cap=o.tis_cap), kl_coef)
        rep = StageReport(stage=mfc.name, rank=self.spec.rank, step=step)
        waited = [False]

        def mini_batch(end: int):
            """This mini-batch's micro-batches as the dock hands them out; after the last one (before the
            engine steps) the step's other readers of these weights must be done."""
            taken = 0
            for batch, rows in micro_batches(self.dock_of(step), stage=mfc.name, rank=self.spec.rank, step=step,
                                             input_keys=mfc.input_keys, count=micro, get_n_samples=False,
                                             timeout_s=self.cfg.trainer.stage_timeout_s, report=rep, max_rows=end):
                taken += len(rows)
                yield MicroBatch({mfc.arg_name(k): v for k, v in batch.items()}, len(rows) / mini, last=taken >= mini)
            if taken and not waited[0]:
                self._wait_columns(mfc.name, self.spec.same_step_outputs.get(mfc.name, []), step)
                waited[0] = True

        if self._split(mfc):
            # a split model: every rank takes each optimizer step (their count is fixed by the sizes); only the
            # replica's reader iterates the dock's micro-batches (the engine broadcasts them), and reports
            # the replica's metrics (every rank of the replica gets them)
            reader = engine.is_reader
            rep.t_start = time.time()
            for start in range(0, per_rank, mini):
                t0, get_before = time.perf_counter(), rep.get_s
                metrics = engine.train_step(mini_batch(min(per_rank, start + mini)) if reader else None, loss_fn)
                if reader:
                    add_metrics(rep.metrics, metrics)
                    rep.metrics["updates"] = rep.metrics.get("updates", 0.0) + 1
                rep.compute_s += time.perf_counter() - t0 - (rep.get_s - get_before)
        else:
            for start in range(0, per_rank, mini):
                it = mini_batch(min(per_rank, start + mini))
                t0, get_before = time.perf_counter(), rep.get_s
                first = next(it, None)
                if first is None:  # the step's rows are all taken (by other DP ranks)
                    break
                add_metrics(rep.metrics, engine.train_step(itertools.chain([first], it), loss_fn))
                rep.metrics["updates"] = rep.metrics.get("updates", 0.0) + 1
                rep.compute_s += time.perf_counter() - t0 - (rep.get_s - get_before)
        self.dock_of(step).flush()
        rep.t_end = time.time()
        rep.metrics["version"] = float(engine.version)
        return rep

    def _wait_columns(self, stage: str, columns: list[str], step: int) -> None:
        if not columns:
            return
        deadline = time.time() + self.cfg.trainer.stage_timeout_s
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

    # ------------------------------------------------------------------ weight sync
    def init_sync_group(self, model: str, host: str, port: int, rank: int, world_size: int,
                        timeout_s: float = 60.0) -> None:
        from ..device import dist_backend, resolve_device
        from ..engines.weight_sync import stateless_group
        backend = self.cfg.weight_sync.backend
        device = resolve_device(self.spec.device) if backend == "auto" else torch.device("cpu")
        self.sync_groups[model] = stateless_group(host, port, rank, world_size, dist_backend(device), timeout_s,
                                                  device=device)

    def device_key(self) -> str:
        """Which device this actor computes on, comparable across processes: "cuda:<uuid>" (two processes
        with different CUDA_VISIBLE_DEVICES see one GPU under different indexes, never under different
        uuids), or "cpu:<node id>" (one host's /dev/shm). The driver picks IPC weight sync when a
        trainer and all its readers share one key that starts with "cuda:"."""
        from ..device import resolve_device
        dev = resolve_device(self.spec.device)
        if dev.type == "cuda":
            return "cuda:" + str(torch.cuda.get_device_properties(dev).uuid)
        import ray
        return f"{dev.type}:" + ray.get_runtime_context().get_node_id()

    def init_ipc_sync(self, model: str, role: str, peers=()) -> None:
        """weight_sync.backend ipc (engines/ipc_sync.py): "send" on the trainer's rank 0 (one staging
        sender, kept for the job; `peers`: the reader actors), "read" on a worker hosting readers."""
        from ..device import resolve_device
        from ..engines.ipc_sync import IPCAttachments, IPCSender, Mailbox
        dev = resolve_device(self.spec.device)
        if role == "send":
            sender = IPCSender(self.cfg.weight_sync.bucket_mb << 20, dev)
            # zero copy: an engine whose exported tensors are its own, unsharded parameters declares
            # the module holding them (`ipc_shareable_module`); sharded engines gather into transients
            shareable = getattr(self.train[model], "ipc_shareable_module", None)
            module = shareable() if callable(shareable) else None
            if module is not None:
                sender.adopt(module)
            self.ipc_senders[model], self.ipc_peers[model] = sender, list(peers)
        elif role == "read":
            self.ipc_mailboxes[model] = Mailbox()
            self.ipc_attach[model] = IPCAttachments(dev)
        else:
            raise ValueError(f"init_ipc_sync: role {role!r}: 'send' or 'read'")

    def ipc_deliver(self, model: str, handles) -> Any:
        """A batch of handles (None at the end) from the trainer, for the thread running this worker's
        `sync_weights` (another actor thread); returns its ack, or at the end its stats."""
        return self.ipc_mailboxes[model].deliver(handles, self._ipc_timeout())

    def _ipc_timeout(self) -> float:
        return max(60.0, 2 * self.cfg.trainer.stage_timeout_s + 60.0)

    def close_ipc_sync(self) -> None:
        """Unlink the senders' segments and drop the readers' mappings (a killed actor's are removed
        by the sender's reaper process and with the process, respectively)."""
        for s in self.ipc_senders.values():
            with contextlib.suppress(Exception):
                s.close()
        for a in self.ipc_attach.values():
            with contextlib.suppress(Exception):
                a.close()
        self.ipc_senders, self.ipc_attach, self.ipc_mailboxes, self.ipc_peers = {}, {}, {}, {}

    def _readers(self, model: str) -> list[Any]:
        """This worker's engines that read `model` without training it: its rollout, an inference copy."""
        out = []
        if model in self.rollout:
            out.append(self.rollout[model])
        if model in self.infer and model not in self.train:
            out.append(self.infer[model])
        return out

    def sync_weights(self, model: str, version: int) -> dict:
        """Publish `model`'s weights as `version` to its readers, a bucket at a time.

        The trainer's ranks export (a sharded engine gathers each bucket: every rank iterates) and
        hand each bucket to their own local readers (a copy in one process); rank 0 also broadcasts it
        to the sync group when readers live elsewhere, whose members load each bucket as it arrives
        (`weight_sync.receive_weights`: big tensors straight into a reader's own where it offers
        them). Nobody holds the whole model twice. With `weight_sync.verify` every side reports a checksum
        of what it sent, received and now serves.
        """
        from ..engines.weight_sync import Checksum
        t0 = time.perf_counter()
        readers = self._readers(model)
        digest = Checksum() if self.cfg.weight_sync.verify else None
        out: dict[str, Any] = {"received": [], "readers": len(readers)}
        with self._weights_lock(model).writing():  # between the rollout's micro-batches, never inside one
            self._sync(model, version, readers, digest, out)
        if digest is not None:
            out["received"] += [c for c in (r.state_checksum() for r in readers) if c is not None]
        out["seconds"] = time.perf_counter() - t0
        return out

    def _sync(self, model: str, version: int, readers: list, digest, out: dict) -> None:
        from ..engines.weight_sync import receive_weights, send_buckets, tee_buckets
        group = self.sync_groups.get(model)
        if model in self.train:
            stream = tee_buckets(self.train[model].export_weights(self.cfg.weight_sync.bucket_mb << 20),
                                 readers, version, digest)
            if model in self.ipc_senders and self.spec.rank == 0:
                import ray

                from ..engines.ipc_sync import CallChannel, send_ipc
                chans = [CallChannel(lambda x, p=p: p.ipc_deliver.remote(model, x),
                                     lambda ref, t: ray.get(ref, timeout=t)) for p in self.ipc_peers[model]]
                out["transfer"] = send_ipc(self.ipc_senders[model], stream, chans, self._ipc_timeout())
            elif group is not None and self.spec.rank == 0:
                out["transfer"] = send_buckets(group, stream)
            else:
                for _ in stream:  # a sharded engine's other ranks take part in each bucket's gather
                    pass
            if digest is not None and self.spec.rank == 0:
                out["sent"] = digest.hexdigest()
        elif model in self.ipc_mailboxes:  # mapped from the trainer's memory into a reader's own
            from ..engines.ipc_sync import IPCReceiver, serve_ipc
            rx = IPCReceiver.for_readers(readers, version, digest, self.ipc_attach[model])
            info = serve_ipc(rx, self.ipc_mailboxes[model], self._ipc_timeout(), finish=rx.finish_readers)
            out["bytes_into_targets"] = info["bytes_into_targets"]
            if digest is not None:
                out["received"].append(digest.hexdigest())
        elif group is not None:  # big tensors straight into a reader's own (`receive_targets`)
            out["bytes_into_targets"] = receive_weights(group, readers, version, digest)["bytes_into_targets"]
            if digest is not None:
                out["received"].append(digest.hexdigest())
        else:
            raise StageError(f"worker group '{self.spec.group}' has no way to get weights of '{model}'")

    def _weights_lock(self, model: str) -> "ReadWriteLock":
        with self._awake_lock:
            return self._locks.setdefault(model, ReadWriteLock())

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str) -> list[str]:
        """Each trained model's engine writes its state under `directory/<model>/` (every rank calls
        it: a sharded engine writes its shards); rank 0 adds this process's RNG states."""
        written = []
        for model, engine in self.train.items():
            where = os.path.join(directory, model)
            written += engine.save_checkpoint(where)
            if self.spec.rank == 0:
                from ..models.files import save_file
                written.append(save_file({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                          "python": random.getstate()}, os.path.join(where, "rng.pt")))
        return written

    def load_checkpoint(self, directory: str) -> list[str]:
        loaded = []
        for model, engine in self.train.items():
            where = os.path.join(directory, model)
            engine.load_checkpoint(where)
            from ..models.files import load_file
            rng = load_file(os.path.join(where, "rng.pt"), what="RNG state")
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            loaded.append(where)
        return loaded

    def train_versions(self) -> dict[str, int]:
        return {m: e.version for m, e in self.train.items()}

    def close_rollout(self) -> None:
        """Shut this actor's rollout engines down before the driver kills it: vLLM with
        tensor_parallel_size > 1 ends its worker processes and removes its shared-memory queues, which
        a killed actor leaves in /dev/shm (its workers still exit: vLLM's death pipe)."""
        for engine in self.rollout.values():
            with contextlib.suppress(Exception):
                engine.close()
        self.rollout = {}


class ReadWriteLock:
    """Generate calls read a rollout engine's weights (several at once where the engine allows it), a
    weight update writes them: it waits for the micro-batches in progress and holds new ones back, so
    no micro-batch is generated by half-old, half-new weights (writers first: an update is never
    starved by a stream of micro-batches)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def reading(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
