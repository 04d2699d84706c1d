"""What each MFC computes on a micro-batch of rows: the compute steps by name, and what every step shares.

The worker's loop (`stage.py`) is the same for every MFC; only the step differs. An MFC names its
function (`MFCDef.fn`, or its interface type's default); `FUNCTIONS` says what each one reads, what it
can write and which engine it needs (each declared by `compute_step` above its implementation class,
one module per built-in step in `workers/steps/`), so the plan checks an algorithm's MFCs before any
worker starts. A step gets the micro-batch as `{name: [row tensors]}` (dock columns renamed by the
MFC's `input_key_remap`) plus the row indexes, and returns an `Output`: its outputs as `{name: [row
tensors]}` (renamed by `output_key_remap`; outputs the MFC does not list are dropped) and a dict of
metric sums. The row helpers here (`as_scalars`, `scalar_rows`, `rows_to_matrix`, `rollout_seed`) are
the ones several steps use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..dataflow.mfc import InterfaceType, MFCDef


@dataclass(frozen=True)
class ComputeFn:
    """What a compute function reads and writes, for the plan's checks and the docs."""
    name: str
    impl: Any                         # its implementation (workers/steps/, a plugin's): an Impl class or "module:Class"
    interface: InterfaceType
    inputs: tuple[str, ...]           # names it must get
    outputs: tuple[str, ...]          # names it can write (an MFC writes a subset)
    optional: tuple[str, ...] = ()    # names it uses when present
    engine: str = ""                  # "rollout", "policy", "value", "reward" or "" (none)
    doc: str = ""


FUNCTIONS: dict[str, ComputeFn] = {}   # name -> its declaration; the built-ins declare themselves on their
                                       # implementation classes, one module each (workers/steps/)


def register_function(fn: ComputeFn) -> ComputeFn:
    """Add (or replace) a compute function: an algorithm's MFC may then name it (`fn=...`). A plugin module
    (`trainer.plugins`) calls it, so the driver and every worker know the function."""
    if not isinstance(fn, ComputeFn):
        raise TypeError(f"register_function: {fn!r} is not a ComputeFn")
    FUNCTIONS[fn.name] = fn
    return fn


def compute_step(name: str, interface: InterfaceType | str, inputs: Sequence[str], outputs: Sequence[str] = (), *,
                 optional: Sequence[str] = (), engine: str = "", doc: str = "") -> Callable[[type], type]:
    """Declare the decorated implementation (a `workers.impls.Impl` subclass: its `args` from the config, its
    call on a micro-batch) as the compute function `name`, beside it, and register it: a new compute step is
    one class in one module (a `trainer.plugins` module for a user's) under this one line.

        @compute_step("neg_reward", "compute", inputs=("rm_scores",), outputs=("neg_scores",))
        class NegReward(Impl):
            def __call__(self, batch, rows):
                return Output({"neg_scores": [-s for s in batch["rm_scores"]]}, {})
    """
    def register(impl: type) -> type:
        text = doc or next(iter((impl.__doc__ or "").strip().splitlines()), "")
        register_function(ComputeFn(name, impl, InterfaceType(interface), tuple(inputs), tuple(outputs),
                                    tuple(optional), engine, text))
        return impl
    return register


DEFAULT_FN = {InterfaceType.GENERATE: "generate", InterfaceType.INFERENCE: "log_probs",
              InterfaceType.TRAIN_STEP: "policy_train"}


def fn_name(mfc: MFCDef) -> str | None:
    """The compute function an MFC runs: its own `fn`, else its interface type's default."""
    return mfc.fn or DEFAULT_FN.get(InterfaceType(mfc.interface_type))


def check_mfc(mfc: MFCDef) -> ComputeFn:
    """The MFC's function, after checking it exists, fits the interface and gets its inputs.

    Raises ValueError naming the MFC, the function and the names that do not match.
    """
    name = fn_name(mfc)
    kind = InterfaceType(mfc.interface_type)
    if name is None:
        raise ValueError(f"MFC {mfc.name!r} is a compute MFC without fn=...; name its function, one of "
                         f"{sorted(n for n, f in FUNCTIONS.items() if f.interface is kind)}")
    f = FUNCTIONS.get(name)
    if f is None:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} is not a known compute function; known: {sorted(FUNCTIONS)}")
    if f.interface is not kind:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} is a {f.interface.value} function but the MFC is "
                         f"{kind.value}; use one of {sorted(n for n, g in FUNCTIONS.items() if g.interface is kind)}")
    got = {mfc.arg_name(k) for k in mfc.input_keys}
    missing = [k for k in f.inputs if k not in got]
    if missing:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} needs {list(f.inputs)} but the MFC's input_keys "
                         f"{list(mfc.input_keys)} (after input_key_remap) lack {missing}; add them or remap a column "
                         f"onto them with input_key_remap")
    inverse = {v: k for k, v in mfc.output_key_remap.items()}
    unknown = [k for k in mfc.output_keys if inverse.get(k, k) not in f.outputs]
    if unknown:
        raise ValueError(f"MFC {mfc.name!r}: fn={name!r} writes {list(f.outputs) or 'nothing'}, not "
                         f"{unknown}; map one of its outputs onto the column with output_key_remap")
    return f


@dataclass
class Output:
    columns: dict[str, list]
    metrics: dict[str, float]  # sums over rows/micro-batches; the driver turns them into means
    samples: list = field(default_factory=list)  # rows as text for people to read (trainer/samples.py)


def as_scalars(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(r).reshape(-1)[0].float() for r in rows])


def scalar_rows(values: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    return [v.reshape(1).to(dtype) for v in values]


def rollout_seed(seed: int, step: int, row: int) -> int:
    """Sampling seed of one row: the same row at the same step samples the same tokens, whichever
    micro-batch, mode, process or backend generates it."""
    return int(np.random.SeedSequence([seed, step, row]).generate_state(1, dtype=np.uint64)[0] >> 1)


def rows_to_matrix(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Rows of per-token values -> a [B, width] float32 matrix, each row cut to `width` and zero-padded to it."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = min(int(r.numel()), width)
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.float32)
    return out

