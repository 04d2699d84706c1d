"""The base every compute step's class builds on, and the one lookup from an MFC to its class (ReaLHF's
`interface_impl`).

An MFC names its compute function (`MFCDef.fn`, or its interface type's default); each step declares the
function it is above its class (`compute.compute_step`), one module per built-in step in `workers/steps/`,
and the lookup here finds the class by that declaration. A step's class has two halves, both on `Impl`:

- `args(cfg, mfc, info)`, run by the driver before any worker starts: the MFC's arguments, taken
  from the config sections it needs (sampling parameters, loss settings, micro-batch sizes), with
  the MFC's own `fn_args` on top (`mfc_args`). A worker receives these arguments, not the config.
- its construction from a `StageContext` and its call, run in the worker per step (`build_impl`): a
  forward step maps a micro-batch to outputs; a train step gives the loss function and the sizes of
  its optimizer steps. Both name the engine they use (`ctx.engine(...)`), never a backend.

A plugin adds a step the same way, `@compute_step("my_fn", ...)` above its class in a `trainer.plugins`
module; an algorithm then names it in an MFC (`fn="my_fn"`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dataflow.mfc import MFCDef
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


# ------------------------------------------------------------------------------------------------ bases
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


def compute_count(cfg, mfc) -> int:
    """Rows per dock get of a step that calls no engine: the MFC's own micro_batch_size, else
    rl_config.dock_micro_batch_size (whole prompt groups where it needs them)."""
    return rows_per_get(mfc, cfg.rl_config.dock_micro_batch_size, cfg.rl_config.n_samples_per_prompt)


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

