"""What the processes of `test_claims.py` run (a small module: a forkserver preloads it once)."""
from __future__ import annotations

import fcntl
import os
import random
import time

import numpy as np
import torch

from mindspeed_rl.transfer_dock import claims


def x_row(r: int, step: int = 0) -> torch.Tensor:
    """Row r of column 'x' in step `step`: variable length, says which row and step it is."""
    return torch.full((r % 3 + 1,), float(step * 1000 + r))


def y_row(r: int, step: int = 0) -> np.ndarray:
    return np.full(2, step * 1000 + r, dtype=np.int64)


def claiming_process(info, consumer, columns, count, step_now, step_done, reports, seed, steps):
    """One data-parallel rank of `consumer`, in its own process: claims until the parent says the
    step is over, checks every row's data, reports the rows."""
    claimer = claims.ClaimClient(info)
    rng = random.Random(seed)
    for step in range(steps):
        while step_now.value < step:
            time.sleep(0.0005)
        got, bad = [], []
        while True:
            res = claimer.claim(consumer, columns, count, f"proc{seed}", rng.random() < 0.5)
            if res is None:
                if step_done.value >= step:
                    break
                time.sleep(rng.random() * 0.0005)
                continue
            data, rows = res
            for j, r in enumerate(rows):  # type and dtype too: tolist() alone would pass numpy for torch
                x = data["x"][j]
                if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32) or x.tolist() != x_row(r, step).tolist():
                    bad.append(r)
                y = data.get("y", [None] * len(rows))[j]
                if "y" in data and (not (isinstance(y, np.ndarray) and y.dtype == np.int64)
                                    or y.tolist() != y_row(r, step).tolist()):
                    bad.append(r)
            got += rows
        reports.put((consumer, step, got, bad, claimer.claims_made))


def hold_the_lock(path, ready):
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    time.sleep(120)


# Each column's row type and dtype, per step: every column changes kind at every clear, and the
# dtypes differ in size, so a claim that read another column's, another step's or a half-written
# kind would cut the wrong bytes or hand out the wrong type.
KIND_STEPS = (
    {"a": ("torch", "float32"), "b": ("numpy", "int64"), "c": ("torch", "bfloat16")},
    {"a": ("numpy", "float16"), "b": ("torch", "int32"), "c": ("numpy", "uint8")},
    {"a": ("torch", "int64"), "b": ("numpy", "float32"), "c": ("torch", "float16")},
)


def kind_row(column: str, r: int, step: int):
    """Row r of `column` in step `step`, of that step's kind; its values (< 256) are exact in all."""
    lib, dtype = KIND_STEPS[step][column]
    n, value = r % 3 + 1, (r + 37 * step) % 200
    if lib == "torch":
        return torch.full((n,), value, dtype=getattr(torch, dtype))
    return np.full(n, value, dtype=dtype)


def kind_problems(column: str, rows: list[int], values: list, step: int) -> list[str]:
    """What differs, row by row, from what was put: the type (torch or numpy), the dtype, the values."""
    out = []
    for r, v in zip(rows, values):
        want = kind_row(column, r, step)
        if type(v) is not type(want) or v.dtype != want.dtype or v.tolist() != want.tolist():
            out.append(f"step {step}, column '{column}': got {type(v).__name__} {getattr(v, 'dtype', '?')}, "
                       f"put {type(want).__name__} {want.dtype} (row {r})")
    return out


def checking_kinds_process(info, consumer, columns, started, step_now, step_done, reports, seed, steps):
    """A rank of `consumer` that claims as fast as it can while the parent puts, and checks the type,
    dtype and values of every row it gets. A claim that raises is a problem too (a torn kind
    record gave `TypeError: data type '' not understood`); the rows it had picked stay untaken."""
    claimer = claims.ClaimClient(info)
    rng = random.Random(seed)
    with started.get_lock():
        started.value += 1
    for step in range(steps):
        while step_now.value < step:
            time.sleep(0.0005)
        got, problems = [], []
        while True:
            try:
                res = claimer.claim(consumer, columns, rng.randint(1, 3), f"kinds{seed}", rng.random() < 0.5)
            except Exception as e:  # reported, not raised: the parent names it
                problems.append(f"step {step}: the claim raised {e!r}")
                if step_done.value >= step:
                    break
                continue
            if res is None:
                if step_done.value >= step:
                    break
                time.sleep(rng.random() * 0.0002)
                continue
            data, rows = res
            for column in columns:
                problems += kind_problems(column, rows, data[column], step)
            got += rows
        kinds_of_problem = sorted({p.split(" (row")[0] for p in problems})  # one example of each
        reports.put((consumer, step, got, kinds_of_problem[:8], len(problems), claimer.claims_made))
