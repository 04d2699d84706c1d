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
            for j, r in enumerate(rows):
                if data["x"][j].tolist() != x_row(r, step).tolist():
                    bad.append(r)
                if "y" in data and data["y"][j].tolist() != y_row(r, step).tolist():
                    bad.append(r)
            got += rows
        reports.put((consumer, step, got, bad, claimer.claims_made))


def hold_the_lock(path, ready):
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    time.sleep(120)
