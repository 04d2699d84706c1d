"""Each worker's own part of the plan, built when the workers launch: its MFCs' arguments and its engines'
declarations.

A worker gets what it runs, resolved here once, not the config: per MFC the arguments of its
implementation (`workers.impls.mfc_args`: sampling, loss and size settings), per model the engine
to build (`EngineDecl`: the backend the group's deployment chose, its options, dtype, optimizer),
and its actor's role in the deployment (`RankRole`: whether it reads the dock, writes, and its
replica). Where the config's backends run no model (the simulate backend), their stand-in
(`registry.stand_in`) declares the engines and replaces the compute MFCs' functions. An MFC's
implementation, and a stand-in, read what they need of the whole config (a plugin's may read any section),
so this launch step takes the config whole; the plan's own stages (planning/) take only their sections.
"""
from __future__ import annotations

import dataclasses

from ..config import Config, RefConfig
from ..engines.registry import Backend, stand_in, train_backend
from ..dataflow.mfc import InterfaceType
from ..workers.engine_set import INFER_ROLE, ROLLOUT_ROLE, TRAIN_ROLE, EngineDecl
from ..workers.impls import PlanInfo, mfc_args
from ..workers import compute as C
from ..workers.worker import WorkerSpec
from ..planning.features import features_of
from ..planning.groups import GroupPlan
from ..planning.models import ModelSections
from ..planning.plan import Plan, model_sections

# a model's engine kind (compute.FUNCTIONS[...].engine) -> the config section of its training and the
# model kind its engine builds
SECTIONS = {"policy": ("actor_config", "causal_lm"), "value": ("critic_config", "value"),
            "reward": ("reward_model", "reward")}


def _backend_dtype(models: ModelSections, kind: str, gp: GroupPlan) -> tuple[Backend, str]:
    """A model engine's backend row and dtype: the group's train backend as the plan resolved it and the actor's
    dtype; a reward model's own (reward_model.backend, null: the group's; reward_model.dtype)."""
    if kind == "reward":
        row = train_backend(models.reward.backend) if models.reward.backend else gp.train_row
        return row, models.reward.dtype
    return gp.train_row, models.actor.dtype


def group_args(cfg: Config, plan: Plan, gp: GroupPlan) -> dict[str, dict]:
    """Per MFC of the group its implementation's arguments; where the run's backends stand in for the compute
    functions (`registry.stand_in`: simulate), the stand-in's for each MFC without an engine."""
    info = PlanInfo(trained_models=dict(plan.trained), dp=gp.resources.dp, rows_per_step=plan.rows_per_step)
    out = {m.name: mfc_args(cfg, m, info) for m in gp.mfcs}
    sub = stand_in(cfg)
    if sub is not None:
        out.update({m.name: sub.compute_args(cfg, m, out[m.name]) for m in gp.mfcs if not C.check_mfc(m).engine})
    return out


def engine_calls(gp: GroupPlan, model: str, role: str) -> dict[str, str]:
    """The calls the group's MFCs make of `model`'s engine in `role`, each with the MFC making it (`train` for a
    train step, else the compute function's name: generate, log_probs, values, ...)."""
    out: dict[str, str] = {}
    for m in gp.mfcs:
        f = C.check_mfc(m)
        if m.model_name != model or not f.engine or (f.engine == ROLLOUT_ROLE) != (role == ROLLOUT_ROLE):
            continue
        out["train" if f.interface is InterfaceType.TRAIN_STEP else f.name] = m.name
    return out


def engine_decls(cfg: Config, plan: Plan, gp: GroupPlan) -> list[EngineDecl]:
    """The engines a group's workers build, in the order the MFCs need them: a trained model's engine (with
    its optimizer), a rollout engine per generating model, an inference engine per model only read here.
    Where the run's backends stand in for its models (`registry.stand_in`: simulate), the stand-in declares
    each engine's backend, model and options."""
    a, g, models = cfg.actor_config, cfg.generate_config, model_sections(cfg)
    sub = stand_in(cfg)
    out: dict[tuple[str, str], EngineDecl] = {}

    def declared(decl: EngineDecl) -> EngineDecl:
        if sub is None:
            return decl
        return dataclasses.replace(decl, **sub.declare(cfg, decl.role, engine_calls(gp, decl.model, decl.role)))

    def options(backend: Backend) -> dict:
        return dict(gp.train_options) if backend is gp.train_row else {}

    trained_here = {m.model_name for m in gp.mfcs if InterfaceType(m.interface_type) is InterfaceType.TRAIN_STEP}
    for m in gp.mfcs:
        f = C.check_mfc(m)
        if f.interface is not InterfaceType.TRAIN_STEP or (m.model_name, TRAIN_ROLE) in out:
            continue
        section, kind = SECTIONS[f.engine]
        o = getattr(cfg, section)
        optim = {"lr": o.lr, "weight_decay": o.weight_decay, "betas": tuple(a.betas), "grad_clip": o.grad_clip}
        backend, dtype = _backend_dtype(models, kind, gp)
        out[(m.model_name, TRAIN_ROLE)] = declared(EngineDecl(
            model=m.model_name, role=TRAIN_ROLE, backend=backend, model_path=plan.model_paths[m.model_name],
            model_kind=kind, dtype=dtype, options=options(backend), optim=optim, temperature=g.temperature or 1.0,
            features=features_of(models, m.model_name, trained=True)))
    for m in gp.mfcs:
        f = C.check_mfc(m)
        if f.engine == ROLLOUT_ROLE and (m.model_name, ROLLOUT_ROLE) not in out:
            out[(m.model_name, ROLLOUT_ROLE)] = declared(EngineDecl(
                model=m.model_name, role=ROLLOUT_ROLE, backend=gp.rollout_row,
                model_path=plan.model_paths[m.model_name],
                dtype=a.dtype, options=dict(gp.rollout_options),
                max_seq_len=cfg.data.max_prompt_length + max(g.max_new_tokens, g.val.max_new_tokens or 0),
                cuda_graphs=g.cuda_graphs))
        elif (f.interface is InterfaceType.INFERENCE and m.model_name not in trained_here
              and (m.model_name, INFER_ROLE) not in out):
            _, kind = SECTIONS[f.engine]
            backend, dtype = _backend_dtype(models, kind, gp)
            base_of = lora_base_of(models.ref, m.model_name, out)
            decl = EngineDecl(model=m.model_name, role=INFER_ROLE, backend=backend,
                              model_path=plan.model_paths[m.model_name], model_kind=kind, dtype=dtype, options={} if base_of else options(backend),
                              temperature=g.temperature or 1.0, base_of=base_of,
                              features={} if base_of else features_of(models, m.model_name, trained=False))
            out[(m.model_name, INFER_ROLE)] = decl if base_of else declared(decl)
    return list(out.values())


def lora_base_of(ref: RefConfig, model: str, decls: dict) -> str:
    """The trained model whose engine `model` runs as its base with the LoRA adapters off, or "": the
    reference, when it is the initial policy (ref_config.model_path null) and the actor trains LoRA in this
    same worker group (its engine is declared here). A reference in another group loads the base itself."""
    actor = decls.get(("actor", TRAIN_ROLE))
    if (model != "ref" or ref.model_path is not None or actor is None
            or not actor.features.get("lora")):
        return ""
    return "actor"


def worker_specs(cfg: Config, plan: Plan, gp: GroupPlan, docks: list, env_of) -> list[WorkerSpec]:
    """One WorkerSpec per actor of the group's deployment (`env_of(k)`: actor k's environment)."""
    dep = gp.deployment
    args, decls = group_args(cfg, plan, gp), engine_decls(cfg, plan, gp)
    r, t = gp.resources, cfg.trainer
    # a stand-in's engines load no model: nothing to tokenize
    tokenizer = "" if stand_in(cfg) is not None else plan.model_paths[plan.tokenizer_model]
    return [WorkerSpec(group=gp.name, rank=k, dp=r.dp, tp=dep.actor_tp, pp=dep.actor_pp, role=role, mfcs=gp.mfcs,
                       args=args, engines=decls, docks=docks, tokenizer_path=tokenizer,
                       stop_tokens=list(cfg.generate_config.stop_tokens), seed=t.seed,
                       stage_timeout_s=t.stage_timeout_s, weight_sync=dataclasses.replace(cfg.weight_sync),
                       partial_rollout=cfg.rl_config.partial_rollout,
                       same_step_outputs=plan.same_step_outputs, rows_per_step=plan.rows_per_step,
                       plugins=list(t.plugins), torch_threads=r.torch_threads,
                       cpu_affinity=list(r.cpu_affinity) if r.cpu_affinity else None, device=r.device, env=env_of(k))
            for k, role in enumerate(dep.roles())]
