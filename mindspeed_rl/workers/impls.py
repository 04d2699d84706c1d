"""Each MFC's implementation and its arguments, built by one registry (ReaLHF's `interface_impl`).

An MFC names its compute function (`MFCDef.fn`, or its interface type's default); each implementation
here declares the function it is, above its class (`compute.compute_step`: what it reads, writes and
which engine it calls), which registers it in `compute.FUNCTIONS`. An implementation has two halves:

- `args(cfg, mfc, info)`, run by the driver before any worker starts: the MFC's arguments, taken
  from the config sections it needs (sampling parameters, loss settings, micro-batch sizes), with
  the MFC's own `fn_args` on top. A worker receives these arguments, not the config.
- `build(ctx)`, run in the worker per step: what the stage loop calls. A forward implementation
  maps a micro-batch to outputs; a train implementation gives the loss function and the sizes of
  its optimizer steps. Both name the engine they use (`ctx.engine(...)`), never a backend.

A plugin adds a function the same way, `@compute_step("my_fn", ...)` above its class in a
`trainer.plugins` module; an algorithm then names it in an MFC (`fn="my_fn"`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dataflow.mfc import MFCDef
from ..dataflow.options import off_policy_correction
from . import compute as C

# An implementation's kind (`Impl.kind`): a forward over micro-batches, or optimizer steps.
FORWARD_PASS, OPTIMIZER_STEP = "forward", "train"


@dataclass(frozen=True)
class PlanInfo:
    """What the plan knows that an MFC's arguments depend on."""
    trained_models: dict = field(default_factory=dict)   # model -> its train MFC
    dp: int = 1                                          # the MFC's worker group's DP replicas
    rows_per_step: int = 0


@dataclass
class StageContext:
    """What an implementation may use in the worker: its MFC, step, arguments and the worker's engines."""
    mfc: MFCDef
    step: int
    policy_version: int
    kl_coef: float
    args: dict
    host: Any                      # the worker's EngineSet: engine(...), tokenizer, weights_lock(...)

    def engine(self, kind: str | None = None):
        """The engine this MFC calls: its model's rollout engine for "rollout", else its train engine (or an
        inference copy of a model trained elsewhere)."""
        return self.host.engine_for(self.mfc.model_name, kind or C.FUNCTIONS[C.fn_name(self.mfc)].engine)


class Impl:
    """Base of an implementation; `kind` is FORWARD_PASS (micro-batch -> outputs) or OPTIMIZER_STEP."""
    kind = FORWARD_PASS

    @staticmethod
    def args(cfg, mfc: MFCDef, info: PlanInfo) -> dict:
        return {}

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.args = ctx.args
        self.count = int(ctx.args.get("count", 1))

    def __call__(self, batch: dict, rows: list[int]) -> C.Output:
        raise NotImplementedError

    def session(self):
        """Held around the whole loop of one step (a rollout engine's wake-up)."""
        import contextlib
        return contextlib.nullcontext()

    def run(self, batch: dict, rows: list[int]) -> C.Output:
        """`__call__` with the MFC's key remaps on both sides: dock columns -> the function's names, its
        outputs -> dock columns (outputs the MFC does not list are dropped)."""
        mfc = self.ctx.mfc
        out = self({mfc.arg_name(k): v for k, v in batch.items()}, rows)
        columns = {mfc.column_of(k): v for k, v in out.columns.items()}
        out.columns = {k: v for k, v in columns.items() if k in mfc.output_keys}
        return out


def rows_per_get(mfc: MFCDef, default: int, n: int) -> int:
    """Rows per dock get: the MFC's own micro_batch_size, else `default`; whole prompt groups where it needs
    them (the rounding the plan prints: config/sizes.py)."""
    from ..config.sizes import group_rows
    count = mfc.micro_batch_size or default
    return group_rows(count, n) if mfc.get_n_samples else count


# ------------------------------------------------------------------------------------------------ forward
@C.compute_step("generate", "generate", ("prompts",), ("responses", "response_length", "weight_version",
                "rollout_log_prob", "loss_mask"), engine="rollout",
                doc="sample one response per row with generate_config (and its tokens' log-probs; loss_mask: 0 on "
                    "truncated rows with rl_config.overlong_buffer.drop_truncated)")
@C.compute_step("generate_greedy", "generate", ("prompts",), ("responses", "response_length", "weight_version",
                "rollout_log_prob"), engine="rollout", doc="the greedy (argmax) response per row: ReMax's baseline")
class Generate(Impl):
    """Sample one response per row (greedy for `generate_greedy`, or at temperature 0)."""

    @staticmethod
    def args(cfg, mfc, info):
        from ..config.sizes import group_rows
        g, rl = cfg.generate_config, cfg.rl_config
        n = rl.n_samples_per_prompt
        return {"count": mfc.micro_batch_size and rows_per_get(mfc, 0, n) or group_rows(g.micro_batch_size_per_device, n),
                "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                "greedy": C.fn_name(mfc) == "generate_greedy" or g.temperature == 0,
                "seed": cfg.trainer.seed, "max_weight_staleness": rl.max_weight_staleness,
                "trained": mfc.model_name in info.trained_models,
                "drop_truncated": rl.overlong_buffer.drop_truncated and mfc.model_name in info.trained_models}

    def __init__(self, ctx):
        super().__init__(ctx)
        from ..engines import SamplingParams
        a = self.args
        self.engine = ctx.engine("rollout")
        self.lock = ctx.host.weights_lock(ctx.mfc.model_name)
        lag = ctx.step - self.engine.weight_version  # rows of step s may come from weights of version >= s - k
        if a["trained"] and lag > a["max_weight_staleness"]:
            from .stage import StageError
            raise StageError(f"stage '{ctx.mfc.name}': step {ctx.step} would be generated with weights of version "
                             f"{self.engine.weight_version}, {lag} versions old; rl_config.max_weight_staleness="
                             f"{a['max_weight_staleness']} forbids it")
        self.params = SamplingParams(max_new_tokens=a["max_new_tokens"], temperature=a["temperature"], top_p=a["top_p"],
                                     top_k=a["top_k"], stop_token_ids=ctx.host.stop_ids, greedy=a["greedy"])

    def session(self):
        return self.ctx.host.awake(self.ctx.mfc.model_name)

    def __call__(self, batch, rows):
        with self.lock.reading() if self.engine.concurrent_generate else self.lock.writing():
            return C.generate(batch, rows, engine=self.engine, params=self.params, seed=self.args["seed"],
                              step=self.ctx.step, drop_truncated=self.args.get("drop_truncated", False))


class Forward(Impl):
    """An inference call of a model; on a split model only the replica's writer computes outputs from rows,
    every other rank (and a rank out of rows in a collective forward) makes the engine's call for its replica:
    the reader with what it has ([]: nothing), the others with None (they get the reader's rows)."""
    method = ""

    def __call__(self, batch, rows):
        engine = self.ctx.engine()
        if rows and engine.is_dock_writer:
            return self.compute(batch, rows, engine)
        none = [] if engine.is_dock_reader else None
        getattr(engine, self.method)(batch.get("prompts", none), batch.get("responses", none), self.count)
        return C.Output({}, {})


@C.compute_step("log_probs", "inference", ("prompts", "responses"), ("log_prob",), engine="policy",
                optional=("rollout_log_prob", "loss_mask"),
                doc="per-token log-probs of the responses (and their distance to the rollout's, when given)")
class LogProbs(Forward):
    """Per-token log-probs of the responses (the actor's old log-probs, the reference's)."""
    method = "log_probs"

    @staticmethod
    def args(cfg, mfc, info):
        mbs = (cfg.actor_config.log_prob_micro_batch_size_per_device if mfc.model_name in info.trained_models
               else cfg.ref_config.log_prob_micro_batch_size_per_device)
        return {"count": rows_per_get(mfc, mbs, cfg.rl_config.n_samples_per_prompt)}

    def compute(self, batch, rows, engine):
        return C.log_probs(batch, rows, engine=engine, micro_batch_size=self.count)


@C.compute_step("values", "inference", ("prompts", "responses"), ("values",), engine="value",
                doc="a critic's per-token values of the responses")
class Values(Forward):
    """A critic's per-token values."""
    method = "values"

    @staticmethod
    def args(cfg, mfc, info):
        return {"count": rows_per_get(mfc, cfg.critic_config.forward_micro_batch_size_per_device,
                                cfg.rl_config.n_samples_per_prompt)}

    def compute(self, batch, rows, engine):
        return C.values(batch, rows, engine=engine, micro_batch_size=self.count)


def compute_count(cfg, mfc) -> int:
    return rows_per_get(mfc, cfg.rl_config.dock_micro_batch_size, cfg.rl_config.n_samples_per_prompt)


@C.compute_step("rule_reward", "compute", ("prompts", "responses", "labels"), ("rm_scores",),
                doc="rl_config.reward_fn on the decoded response and answer")
class RuleReward(Impl):
    """rl_config.reward_fn on the decoded responses and answers."""

    @staticmethod
    def args(cfg, mfc, info):
        ob = cfg.rl_config.overlong_buffer  # DAPO's soft overlong penalty (length 0: off)
        return {"count": compute_count(cfg, mfc), "reward_fn": cfg.rl_config.reward_fn,
                "overlong": [cfg.generate_config.max_new_tokens, ob.length, ob.penalty_factor] if ob.length else None}

    def __init__(self, ctx):
        super().__init__(ctx)
        self.reward_fn = ctx.host.reward_fn(self.args["reward_fn"])

    def __call__(self, batch, rows):
        from ..data.loader import decode_label
        return C.rule_reward(batch, rows, reward_fn=self.reward_fn, tokenizer=self.ctx.host.tokenizer,
                             decode_label=decode_label, overlong=self.args.get("overlong"))


@C.compute_step("grpo_advantage", "compute", ("rm_scores",), ("advantages",),
                doc="reward normalized within each prompt's group (needs get_n_samples)")
class GRPOAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        rl = cfg.rl_config
        return {"count": compute_count(cfg, mfc), "n_samples_per_prompt": rl.n_samples_per_prompt, "eps": rl.adv_eps,
                "norm_by_std": rl.norm_adv_by_std}

    def __call__(self, batch, rows):
        a = self.args
        return C.grpo_advantage(batch, rows, n_samples_per_prompt=a["n_samples_per_prompt"], eps=a["eps"],
                                norm_by_std=a["norm_by_std"])


@C.compute_step("gae_advantage", "compute", ("rm_scores", "values"), ("advantages", "returns"),
                doc="GAE over the outcome reward on the last token, whitened over the micro-batch")
class GAEAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc), "gamma": cfg.rl_config.gamma, "lam": cfg.rl_config.lam}

    def __call__(self, batch, rows):
        return C.gae_advantage(batch, rows, gamma=self.args["gamma"], lam=self.args["lam"])


@C.compute_step("remax_advantage", "compute", ("rm_scores", "reward_baselines", "response_length"),
                ("advantages", "returns"), doc="reward-to-go minus the greedy response's reward")
class ReMaxAdvantage(Impl):
    @staticmethod
    def args(cfg, mfc, info):
        return {"count": compute_count(cfg, mfc)}

    def __call__(self, batch, rows):
        return C.remax_advantage(batch, rows)


# ------------------------------------------------------------------------------------------------ train
@C.compute_step("policy_train", "train_step", ("prompts", "responses", "advantages"),
                optional=("old_log_prob", "ref_log_prob", "rollout_log_prob", "loss_mask"), engine="policy",
                doc="clipped policy loss (+ KL to the reference when the KL coefficient is > 0, + the off-policy "
                    "correction from rollout_log_prob)")
class PolicyTrain(Impl):
    """Optimizer steps of the clipped policy loss (+ KL, entropy, off-policy correction)."""
    kind = OPTIMIZER_STEP
    section = "actor_config"

    @classmethod
    def sizes(cls, cfg, info: PlanInfo) -> dict:
        from ..config.sizes import train_sizes
        o, rl = getattr(cfg, cls.section), cfg.rl_config
        s = train_sizes(o.ppo_mini_batch_size, o.ppo_micro_batch_size_per_device, rl.prompts_per_step,
                        rl.n_samples_per_prompt, info.dp)   # dp replicas: tp/pp ranks share their rows
        return {"rows_per_device": s.rows_per_device, "mini_rows_per_device": s.mini_rows_per_device,
                "count": s.micro_rows}

    @classmethod
    def args(cls, cfg, mfc, info):
        o = cfg.actor_config
        return {**cls.sizes(cfg, info), "loss": {
            "clip_low": o.clip_ratio_low, "clip_high": o.clip_ratio_high, "clip_c": o.clip_ratio_c,
            "agg": o.loss_agg_mode, "use_kl_loss": o.use_kl_loss, "kl_type": o.kl_loss_type,
            "entropy_coeff": o.entropy_coeff, "off_policy_correction": off_policy_correction(cfg), "tis_cap": o.tis_cap}}

    def loss_fn(self):
        return C.policy_loss_fn(C.PolicyLossConfig(**self.args["loss"]), self.ctx.kl_coef)

    def run(self, unit, rows):
        """One optimizer step over a mini-batch's micro-batches (None on a rank whose engine gets them from its
        replica's reader); the MFC's input remaps applied as they stream from the dock."""
        from ..engines import MicroBatch
        mfc = self.ctx.mfc
        if unit is not None:
            unit = (MicroBatch({mfc.arg_name(k): v for k, v in mb.data.items()}, mb.loss_scale, mb.last)
                    for mb in unit)
        metrics = self.ctx.engine().train_step(unit, self.loss_fn())
        return C.Output({}, {**metrics, "updates": 1.0})


@C.compute_step("value_train", "train_step", ("prompts", "responses", "values", "returns"), engine="value",
                doc="clipped value loss")
class ValueTrain(PolicyTrain):
    """Optimizer steps of the clipped value loss."""
    section = "critic_config"

    @classmethod
    def args(cls, cfg, mfc, info):
        o = cfg.critic_config
        return {**cls.sizes(cfg, info), "loss": {"clip_value": o.cliprange_value, "agg": o.loss_agg_mode}}

    def loss_fn(self):
        return C.value_loss_fn(C.ValueLossConfig(**self.args["loss"]))


class StandIn(Impl):
    """A compute MFC whose function the run's backend stands in for (`Backend.stand_in`: the simulate backend
    sleeps per row and pushes placeholders): its arguments name the function (`stand_in`, "module:factory") and
    the factory's arguments; the factory, given the MFC, returns what maps a micro-batch to outputs."""

    def __init__(self, ctx):
        super().__init__(ctx)
        import importlib
        module, name = self.args["stand_in"].split(":")
        self.fn = getattr(importlib.import_module(module), name)(ctx.mfc, **self.args.get("stand_in_args", {}))

    def __call__(self, batch, rows):
        out = self.fn(batch, rows)
        return C.Output(dict(out.columns), dict(out.metrics))


# ------------------------------------------------------------------------------------------------ lookup
def impl_class(mfc: MFCDef) -> type[Impl]:
    f = C.check_mfc(mfc)
    impl = f.impl
    if isinstance(impl, str):
        import importlib
        module, name = impl.split(":")
        impl = getattr(importlib.import_module(module), name)
    return impl


def mfc_args(cfg, mfc: MFCDef, info: PlanInfo) -> dict:
    """The arguments the driver hands the worker for `mfc`: its implementation's, from the config, then the
    MFC's own `fn_args` over them."""
    out = dict(impl_class(mfc).args(cfg, mfc, info))
    out.update(mfc.fn_args)
    return out


def build_impl(ctx: StageContext) -> Impl:
    """What the stage loop calls for this MFC and step: its implementation, or the function its arguments name
    in its place (`StandIn`)."""
    if "stand_in" in ctx.args:
        return StandIn(ctx)
    return impl_class(ctx.mfc)(ctx)

