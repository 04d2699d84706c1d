"""From the plan to each worker's own part of it: its MFCs' arguments and its engines' declarations.

A worker gets what it runs, resolved here once, not the config: per MFC the arguments of its
implementation (`workers.impls.mfc_args`: sampling, loss and size settings), per model the engine
to build (`EngineDecl`: the backend the group's deployment chose, its options, dtype, optimizer).
"""
from __future__ import annotations

import dataclasses

from ..config import Config
from ..dataflow.mfc import InterfaceType
from ..workers.engine_set import INFER, ROLLOUT, TRAIN, EngineDecl
from ..workers.impls import PlanInfo, mfc_args
from ..workers import compute as C
from ..workers.worker import WorkerSpec
from .model_features import features_of
from .plan import GroupPlan, Plan

# a model's engine kind (compute.FUNCTIONS[...].engine) -> the config section of its training and the
# model kind its engine builds
SECTIONS = {"policy": ("actor_config", "causal_lm"), "value": ("critic_config", "value"),
            "reward": ("reward_model", "reward")}


def _backend_dtype(cfg: Config, kind: str, gp: GroupPlan) -> tuple[str, str]:
    """A model engine's backend and dtype: the group's train backend and the actor's dtype; a reward model's own
    (reward_model.backend, null: the group's; reward_model.dtype)."""
    if kind == "reward" and not cfg.trainer.simulate_cost_s_per_row:
        return cfg.reward_model.backend or gp.train_backend, cfg.reward_model.dtype
    return gp.train_backend, cfg.actor_config.dtype


def group_args(cfg: Config, plan: Plan, gp: GroupPlan) -> dict[str, dict]:
    info = PlanInfo(trained_models=dict(plan.trained), dp=gp.resources.dp, rows_per_step=plan.rows_per_step)
    return {m.name: mfc_args(cfg, m, info) for m in gp.mfcs}


def engine_decls(cfg: Config, plan: Plan, gp: GroupPlan) -> list[EngineDecl]:
    """The engines a group's workers build, in the order the MFCs need them: a trained model's engine (with
    its optimizer), a rollout engine per generating model, an inference engine per model only read here."""
    simulated = bool(cfg.trainer.simulate_cost_s_per_row)
    a, g = cfg.actor_config, cfg.generate_config
    out: dict[tuple[str, str], EngineDecl] = {}

    def path(model: str) -> str:
        return "" if simulated else plan.model_paths[model]

    def costs(model: str) -> dict:
        per_stage = cfg.trainer.simulate_cost_s_per_row
        out_: dict[str, float] = {}
        for m in gp.mfcs:
            f = C.check_mfc(m)
            if f.engine and m.model_name == model:
                key = "train" if f.interface is InterfaceType.TRAIN_STEP else f.name
                out_[key] = float(per_stage.get(m.name, 0.0))
        return out_

    trained_here = {m.model_name for m in gp.mfcs if InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP}
    for m in gp.mfcs:
        f = C.check_mfc(m)
        if f.interface is not InterfaceType.TRAIN_STEP or (m.model_name, TRAIN) in out:
            continue
        section, kind = SECTIONS[f.engine]
        o = getattr(cfg, section)
        optim = {"lr": o.lr, "weight_decay": o.weight_decay, "betas": tuple(a.betas), "grad_clip": o.grad_clip}
        backend, dtype = _backend_dtype(cfg, kind, gp)
        out[(m.model_name, TRAIN)] = EngineDecl(
            model=m.model_name, role=TRAIN, backend=backend, model_path=path(m.model_name), model_kind=kind,
            dtype=dtype, options=({"costs": costs(m.model_name)} if simulated else
                                  dict(gp.train_options) if backend == gp.train_backend else {}),
            optim=optim, temperature=g.temperature or 1.0,
            features={} if simulated else features_of(cfg, m.model_name, trained=True))
    for m in gp.mfcs:
        f = C.check_mfc(m)
        if f.engine == "rollout" and (m.model_name, ROLLOUT) not in out:
            t = cfg.trainer
            options = ({"costs": costs(m.model_name), "slots": t.simulate_generate_slots,
                        "sigma": t.simulate_generate_sigma} if simulated else dict(gp.rollout_options))
            out[(m.model_name, ROLLOUT)] = EngineDecl(model=m.model_name, role=ROLLOUT, backend=gp.rollout_backend,
                                                      model_path=path(m.model_name), dtype=a.dtype, options=options,
                                                      max_seq_len=cfg.data.max_prompt_length
                                                      + max(g.max_new_tokens, g.val.max_new_tokens or 0),
                                                      cuda_graphs=g.cuda_graphs)
        elif (f.interface is InterfaceType.INFERENCE and m.model_name not in trained_here
              and (m.model_name, INFER) not in out):
            _, kind = SECTIONS[f.engine]
            backend, dtype = _backend_dtype(cfg, kind, gp)
            base_of = lora_base_of(cfg, m.model_name, out)
            out[(m.model_name, INFER)] = EngineDecl(
                model=m.model_name, role=INFER, backend=backend, model_path=path(m.model_name),
                model_kind=kind, dtype=dtype,
                options=({} if base_of else {"costs": costs(m.model_name)} if simulated else
                         dict(gp.train_options) if backend == gp.train_backend else {}),
                temperature=g.temperature or 1.0,
                features={} if simulated or base_of else features_of(cfg, m.model_name, trained=False),
                base_of=base_of)
    return list(out.values())


def lora_base_of(cfg: Config, model: str, decls: dict) -> str:
    """The trained model whose engine `model` runs as its base with the LoRA adapters off, or "": the
    reference, when it is the initial policy (ref_config.model_path null) and the actor trains LoRA in this
    same worker group (its engine is declared here). A reference in another group loads the base itself."""
    actor = decls.get(("actor", TRAIN))
    if (model != "ref" or cfg.ref_config.model_path is not None or actor is None
            or not actor.features.get("lora")):
        return ""
    return "actor"


def worker_specs(cfg: Config, plan: Plan, gp: GroupPlan, docks: list, env_of) -> list[WorkerSpec]:
    """One WorkerSpec per actor of the group's deployment (`env_of(k)`: actor k's environment)."""
    dep = gp.deployment
    args, decls = group_args(cfg, plan, gp), engine_decls(cfg, plan, gp)
    r, t = gp.resources, cfg.trainer
    return [WorkerSpec(group=gp.name, rank=k, dp=r.dp, tp=dep.actor_tp, pp=dep.actor_pp, mfcs=gp.mfcs, args=args,
                       engines=decls, docks=docks, tokenizer_path=plan.model_paths[plan.tokenizer_model],
                       stop_tokens=list(cfg.generate_config.stop_tokens), seed=t.seed,
                       stage_timeout_s=t.stage_timeout_s, weight_sync=dataclasses.replace(cfg.weight_sync),
                       same_step_outputs=plan.same_step_outputs, rows_per_step=plan.rows_per_step,
                       simulated=bool(t.simulate_cost_s_per_row), plugins=list(t.plugins),
                       torch_threads=r.torch_threads, device=r.device, env=env_of(k))
            for k in range(dep.actors)]
