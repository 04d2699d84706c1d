"""Batch sizes in the units the stages use, worked out from the config (pure functions).

The convention is verl's: a size that must hold whole prompt groups is counted in prompts and
multiplied by `rl_config.n_samples_per_prompt` here (`ppo_mini_batch_size`), so changing n keeps
it valid; a per-device micro-batch (`*_micro_batch_size_per_device`) counts rows and is rounded
to what it must divide, so any n runs. The plan prints each rounding once (`size_notes`), and the
workers call the same functions, so what is printed is what runs.
"""
from __future__ import annotations

from dataclasses import dataclass


def group_rows(rows: int, n: int) -> int:
    """`rows` rounded down to whole groups of n rows (at least one group)."""
    return max(n, rows - rows % n)


def largest_divisor_at_most(total: int, cap: int) -> int:
    """The largest divisor of `total` that is <= `cap` (1 at worst): micro-batches that tile it exactly."""
    for d in range(min(cap, total), 0, -1):
        if total % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class TrainSizes:
    rows_per_device: int        # rows of a step one DP rank trains on
    mini_rows_per_device: int   # rows of one optimizer step on one rank
    micro_rows: int             # rows per forward/backward (gradient accumulation unit), after rounding


def train_sizes(mini_prompts: int | None, micro_rows: int, prompts_per_step: int, n: int, dp: int) -> TrainSizes:
    """Rows per device of a train MFC: the mini-batch (prompts x n, or the whole step when None) split
    over dp ranks, and the micro-batch rounded down to divide it. Checks of divisibility are the plan's."""
    rows = prompts_per_step * n
    mini_rows = mini_prompts * n if mini_prompts else rows
    per_device_mini = max(1, mini_rows // dp)
    return TrainSizes(rows_per_device=rows // dp, mini_rows_per_device=per_device_mini,
                      micro_rows=largest_divisor_at_most(per_device_mini, micro_rows))


def train_size_note(section: str, mini_prompts: int | None, micro_rows: int, prompts_per_step: int, n: int,
                    dp: int) -> str | None:
    """The line that says a train section's micro-batch was rounded, or None when it was not."""
    s = train_sizes(mini_prompts, micro_rows, prompts_per_step, n, dp)
    if s.micro_rows == micro_rows:
        return None
    mini = (f"{section}.ppo_mini_batch_size={mini_prompts} prompts x n_samples_per_prompt={n}" if mini_prompts
            else f"the whole step ({prompts_per_step} prompts x n_samples_per_prompt={n})")
    return (f"{section}.ppo_micro_batch_size_per_device={micro_rows} -> {s.micro_rows} rows: the largest that divides "
            f"the {s.mini_rows_per_device} rows of an optimizer step per device ({mini}"
            f"{f' / dp={dp}' if dp > 1 else ''})")


def group_size_note(key: str, rows: int, n: int, why: str) -> str | None:
    """The line that says a row count was rounded down to whole prompt groups, or None."""
    got = group_rows(rows, n)
    if got == rows:
        return None
    return f"{key}={rows} -> {got} rows: whole groups of n_samples_per_prompt={n} ({why})"
