"""One Ray actor of a worker group: it hosts the engines of its MFCs and runs their stage loops.

Colocated placement puts several MFCs in one actor (like MindSpeed-RL's integrated worker); the
actor is threaded, so in non-blocking mode its stages run at the same time and take micro-batches
as they become ready. Disaggregated placement gives MFCs actors of their own. Either way, the
worker talks to other stages only through the dock, and to other workers only for weight sync
and DDP (torch.distributed groups of its own, beside Ray).
"""
from __future__ import annotations

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
from .stage import StageError, StageReport, run_stage_loop


@dataclass
class WorkerSpec:
    group: str
    rank: int
    dp: int
    mfcs: list[MFCDef]
    config: Config
    dock: Any                                   # TransferDockClient
    model_paths: dict[str, str]                 # model_name -> checkpoint path
    trained_models: dict[str, str]              # model_name -> train MFC name (whole graph)
    same_step_outputs: dict[str, list[str]]     # train MFC -> columns its same-step readers write
    rows_per_step: int = 0
    torch_threads: int = 1
    device: str = "cpu"
    env: dict = field(default_factory=dict)


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.cfg = spec.config
        for k, v in spec.env.items():
            os.environ[k] = str(v)
        spec.dock.worker = f"{spec.group}/{spec.rank}"  # this process's lane in the dock's event log
        torch.set_num_threads(spec.torch_threads)
        self.train: dict[str, Any] = {}     # model -> TorchTrainEngine (with optimizer)
        self.infer: dict[str, Any] = {}     # model -> TorchTrainEngine (no optimizer)
        self.rollout: dict[str, Any] = {}   # model -> HFRolloutEngine
        self.sync_groups: dict[str, Any] = {}
        self.ddp_group = None
        self.tokenizer = None
        self.reward_fn = None
        self._sync_buffer: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ setup
    def ping(self) -> dict:
        import ray
        return {"pid": os.getpid(), "host": ray.util.get_node_ip_address(), "group": self.spec.group,
                "rank": self.spec.rank, "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        from ..engines.weight_sync import free_port
        return free_port()

    def init_ddp(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        """torch's default process group over this group's DP ranks, for DDP (gloo on CPU).

        Weight sync uses groups of its own (`init_sync_group`), so the two never collide.
        """
        from datetime import timedelta

        import torch.distributed as dist

        from ..device import dist_backend, resolve_device
        if self.spec.dp > 1:
            dist.init_process_group(dist_backend(resolve_device(self.spec.device)),
                                    init_method=f"tcp://{host}:{port}", rank=self.spec.rank,
                                    world_size=self.spec.dp, timeout=timedelta(seconds=timeout_s))
            self.ddp_group = dist.group.WORLD

    def setup(self) -> dict:
        """Load the models and engines this worker's MFCs need; returns their checksums."""
        if self.cfg.trainer.simulate_cost_s_per_row:  # simulated stages sleep instead (workers/simulate.py)
            return {}
        from transformers.utils import logging as hf_logging

        from ..data.loader import decode_label
        self._decode_label = decode_label  # imported here so a broken install fails at setup, not mid-step
        from ..device import resolve_device
        from ..engines import HFRolloutEngine, OptimConfig, TorchTrainEngine
        from ..models import load_causal_lm, load_tokenizer, load_value_model

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.manual_seed(self.cfg.trainer.seed)
        device = resolve_device(self.spec.device)
        a, g = self.cfg.actor_config, self.cfg.generate_config
        self.tokenizer = load_tokenizer(self.spec.model_paths["actor"])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        fns = {m.name: C.check_mfc(m) for m in self.spec.mfcs}

        def load(model: str, f: C.ComputeFn):
            loader = load_value_model if f.engine == "value" else load_causal_lm
            return loader(self.spec.model_paths[model], a.dtype)

        for m in self.spec.mfcs:
            f, model = fns[m.name], m.model_name
            if f.interface is InterfaceType.TRAIN_STEP and a.backend != "torch":
                raise StageError(f"stage '{m.name}': actor_config.backend={a.backend!r} is not implemented yet; "
                                 "use torch")
            if f.interface is InterfaceType.TRAIN_STEP and model not in self.train:
                o = self._train_config(f)
                opt = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(a.betas), grad_clip=o.grad_clip)
                self.train[model] = TorchTrainEngine(load(model, f), pad, opt, temperature=g.temperature or 1.0,
                                                     device=device, process_group=self.ddp_group)
        for m in self.spec.mfcs:
            f, model = fns[m.name], m.model_name
            if f.engine == "rollout" and model not in self.rollout:
                if g.backend != "hf":
                    raise StageError(f"stage '{m.name}': generate_config.backend={g.backend!r} is not implemented "
                                     "yet; use hf")
                self.rollout[model] = HFRolloutEngine(load_causal_lm(self.spec.model_paths[model], a.dtype), pad, device)
            elif f.interface is InterfaceType.INFERENCE and model not in self.train and model not in self.infer:
                self.infer[model] = TorchTrainEngine(load(model, f), pad, None, temperature=g.temperature or 1.0,
                                                     device=device)
            elif f.name == "rule_reward" and self.reward_fn is None:
                from ..rewards import get_reward_fn
                self.reward_fn = get_reward_fn(self.cfg.rl_config.reward_fn)
        self._stop_ids = tuple(self._stop_token_ids())
        return self.checksums()

    def _stop_token_ids(self) -> list[int]:
        ids = []
        for tok in self.cfg.generate_config.stop_tokens:
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if tid is None or (tid == self.tokenizer.unk_token_id and tok != self.tokenizer.unk_token):
                raise StageError(f"generate_config.stop_tokens: {tok!r} is not a token of the tokenizer")
            ids.append(int(tid))
        return ids

    def checksums(self) -> dict[str, str]:
        from ..engines.weight_sync import checksum
        out = {}
        for kind, engines in (("train", self.train), ("infer", self.infer), ("rollout", self.rollout)):
            for model, e in engines.items():
                params = e.parameters() if kind != "rollout" else [p for _, p in e.named_parameters_for_sync()]
                out[f"{kind}:{model}"] = checksum(params)
        return out

    # ------------------------------------------------------------------ stages
    def run_stage(self, mfc_name: str, step: int, policy_version: int, kl_coef: float = 0.0) -> dict:
        """Run one MFC's loop for one step; returns its report (rows, times, metric sums)."""
        mfc = next((m for m in self.spec.mfcs if m.name == mfc_name), None)
        if mfc is None:
            raise StageError(f"worker group '{self.spec.group}' does not host stage '{mfc_name}'")
        try:
            kind = InterfaceType(mfc.interface_type)
            if self.cfg.trainer.simulate_cost_s_per_row:  # the cost model: sleep per row (workers/simulate.py)
                from .simulate import run_simulated_stage
                rep = run_simulated_stage(self, mfc, step)
            elif kind is InterfaceType.TRAIN_STEP:
                rep = self._run_train(mfc, step, kl_coef)
            else:
                rep = run_stage_loop(self.spec.dock, stage=mfc.name, rank=self.spec.rank, step=step,
                                     input_keys=mfc.input_keys, count=self._count(mfc),
                                     get_n_samples=mfc.get_n_samples, timeout_s=self.cfg.trainer.stage_timeout_s,
                                     compute=self._compute_fn(mfc, step, policy_version))
        except StageError:
            raise
        except Exception as e:  # name the stage in every failure the driver sees
            import traceback
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise StageError(f"stage '{mfc_name}' (group '{self.spec.group}', rank {self.spec.rank}, step {step}) "
                             f"failed: {type(e).__name__}: {e} (at {os.path.basename(where.filename)}:"
                             f"{where.lineno})") from e
        return rep.as_dict()

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
        if name in ("generate", "generate_greedy"):
            engine = self.rollout[mfc.model_name]
            lag = policy_version - engine.weight_version
            if mfc.model_name == "actor" and lag > rl.max_weight_staleness:
                raise StageError(f"stage '{mfc.name}': rollout weights are version {engine.weight_version}, the "
                                 f"policy is at {policy_version}; rl_config.max_weight_staleness="
                                 f"{rl.max_weight_staleness} forbids serving them")
            from ..engines import SamplingParams
            g = cfg.generate_config
            greedy = name == "generate_greedy" or g.temperature == 0
            params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                                    top_k=g.top_k, stop_token_ids=self._stop_ids, greedy=greedy)
            return lambda batch, rows: C.generate(batch, rows, engine=engine, params=params,
                                                  seed=cfg.trainer.seed, step=step)
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
        """Gradient accumulation over micro-batches; an optimizer step per mini-batch of rows."""
        f = C.FUNCTIONS[C.fn_name(mfc)]
        o = self._train_config(f)
        engine = self.train[mfc.model_name]
        rl = self.cfg.rl_config
        sizes = train_sizes(o.ppo_mini_batch_size, o.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                            rl.n_samples_per_prompt, self.spec.dp)
        per_rank, mini, micro = sizes.rows_per_device, sizes.mini_rows_per_device, sizes.micro_rows
        if f.name == "value_train":
            v_cfg = C.ValueLossConfig(clip_value=o.cliprange_value, agg=o.loss_agg_mode)

            def micro_step(batch, scale, sync):
                return C.value_train_micro_batch(batch, engine=engine, loss_cfg=v_cfg, loss_scale=scale, sync=sync)
        else:
            p_cfg = C.PolicyLossConfig(clip_low=o.clip_ratio_low, clip_high=o.clip_ratio_high, clip_c=o.clip_ratio_c,
                                       agg=o.loss_agg_mode, use_kl_loss=o.use_kl_loss, kl_type=o.kl_loss_type,
                                       entropy_coeff=o.entropy_coeff)

            def micro_step(batch, scale, sync):
                return C.policy_train_micro_batch(batch, engine=engine, loss_cfg=p_cfg, kl_coef=kl_coef,
                                                  loss_scale=scale, sync=sync)
        rep = StageReport(stage=mfc.name, rank=self.spec.rank, step=step)
        waited = False
        for start in range(0, per_rank, mini):
            done_before = rep.rows

            def compute(batch, rows, _done_before=done_before):
                taken = rep.rows - _done_before + len(rows)
                args = {mfc.arg_name(k): v for k, v in batch.items()}
                return C.Output({}, micro_step(args, len(rows) / mini, taken >= mini))

            run_stage_loop(self.spec.dock, stage=mfc.name, rank=self.spec.rank, step=step,
                           input_keys=mfc.input_keys, count=micro, get_n_samples=False,
                           timeout_s=self.cfg.trainer.stage_timeout_s, compute=compute, report=rep,
                           max_rows=min(per_rank, start + mini))
            if rep.rows == done_before:
                break
            if not waited:  # the step's readers of these weights must be done before they change
                self._wait_columns(mfc.name, self.spec.same_step_outputs.get(mfc.name, []), step)
                waited = True
            t0 = time.perf_counter()
            C.merge_metrics(rep.metrics, engine.optimizer_step())
            rep.metrics["updates"] = rep.metrics.get("updates", 0.0) + 1
            rep.compute_s += time.perf_counter() - t0
        rep.metrics["version"] = float(engine.version)
        return rep

    def _wait_columns(self, stage: str, columns: list[str], step: int) -> None:
        if not columns:
            return
        deadline = time.time() + self.cfg.trainer.stage_timeout_s
        while True:
            status = self.spec.dock.get_column_status()
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
        backend = dist_backend(resolve_device(self.spec.device))
        self.sync_groups[model] = stateless_group(host, port, rank, world_size, backend, timeout_s)

    def _readers(self, model: str) -> list[list[torch.Tensor]]:
        out = []
        if model in self.rollout:
            out.append([p for _, p in self.rollout[model].named_parameters_for_sync()])
        if model in self.infer and model not in self.train:
            out.append(self.infer[model].parameters())
        return out

    def sync_weights(self, model: str, version: int) -> dict:
        """Send (train rank 0), receive (remote readers), or copy in-process; returns checksums.

        Every worker that holds the model's trainer copies into its own local readers; the
        trainer's rank 0 also broadcasts to the sync group when there is one.
        """
        from ..engines.weight_sync import broadcast_flat, checksum, flatten, unflatten_into
        t0 = time.perf_counter()
        group = self.sync_groups.get(model)
        out: dict[str, Any] = {}
        if model in self.train:
            params = self.train[model].parameters()
            flat = flatten(params, self._sync_buffer.get(model))
            self._sync_buffer[model] = flat
            if group is not None and self.spec.rank == 0:
                broadcast_flat(group, flat, src=0)
            out["sent"] = checksum(params)
        elif group is not None:
            readers = self._readers(model)
            numel = sum(t.numel() for t in readers[0])
            flat = self._sync_buffer.get(model)
            if flat is None or flat.numel() != numel:
                flat = self._sync_buffer[model] = torch.empty(numel, dtype=torch.float32)
            broadcast_flat(group, flat, src=0)
        else:
            raise StageError(f"worker group '{self.spec.group}' has no way to get weights of '{model}'")
        for tensors in self._readers(model):
            unflatten_into(flat, tensors)
        if model in self.rollout:
            self.rollout[model].weight_version = int(version)
        out["received"] = [checksum(t) for t in self._readers(model)]
        out["seconds"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str) -> list[str]:
        """Rank 0 of a trained model's group writes model, optimizer and RNG states."""
        os.makedirs(directory, exist_ok=True)
        written = []
        if self.spec.rank == 0:
            for model, engine in self.train.items():
                path = os.path.join(directory, f"{model}.pt")
                state = engine.state_dict()
                state["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                "python": random.getstate()}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
                written.append(path)
        return written

    def load_checkpoint(self, directory: str) -> list[str]:
        loaded = []
        for model, engine in self.train.items():
            path = os.path.join(directory, f"{model}.pt")
            state = torch.load(path, map_location="cpu", weights_only=False)
            engine.load_state_dict(state)
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
            loaded.append(path)
        return loaded

    def train_versions(self) -> dict[str, int]:
        return {m: e.version for m, e in self.train.items()}
