"""DAPO's dynamic sampling, run by the driver beside a step's stages (rl_config.dynamic_sampling).

A group whose rewards are all equal has advantage 0 on every row: it costs a full forward and
backward and moves nothing. The step's dock holds room for `max_oversample x prompts_per_step`
groups but starts with `prompts_per_step` of them in it (`set_extent`). One thread of the driver,
`GroupFilter`, takes each group's rewards as soon as they are written (dock consumer
`dynamic_sampling`, whole groups, in index order under `guarantee_order`) and

* keeps it: writes the gate column `kept` on its rows, which every stage after the reward waits
  for (`dataflow/rollout_options.py`), or
* drops it: retires its rows from the dock (no later stage ever takes them) and, while the cap
  allows, draws one new prompt into the next group's rows (the step grows: `set_extent`), which the
  rollout and reward stages, still running, take like any other.

Replacing each dropped group by one new prompt keeps `kept + undecided = prompts_per_step`, so the
step ends with exactly `prompts_per_step` kept groups, or fewer when `max_oversample` ran out (then
it trains on what it has and says so). When every drawn group is decided the rows never drawn are
retired, every consumer's tail comes and the stages finish. Decisions depend only on each group's
rewards and the groups are taken in index order (`guarantee_order`), so which prompt lands in which
rows, and what is kept, do not depend on timing.
"""
from __future__ import annotations

import math
import threading
from typing import Callable

import numpy as np
import torch

from ..algorithms import constant_groups
from ..dataflow.rollout_options import FILTER, GATE, REWARD


def dock_groups(prompts_per_step: int, max_oversample: float) -> int:
    """Prompt groups a step's dock holds under dynamic sampling: the most prompts a step may draw."""
    return max(prompts_per_step, math.ceil(prompts_per_step * max_oversample - 1e-9))


class GroupFilter:
    """One step's dynamic sampling: `start()` it once the step's first prompts are in, `finish()` after
    the stages are done (returns the step's metrics, or raises what went wrong in the thread).

    Args:
        dock: the step's dock (a client, or a plain TransferDock).
        prompts_per_step: groups to keep.
        max_groups: groups the step may draw at most (the dock's prompts_num).
        n: rows per group (n_samples_per_prompt).
        draw: `draw(k)` -> {column: [k values]}: k new prompts' dataset columns (one value per prompt).
        timeout_s: how long one wait for rewards may take (trainer.stage_timeout_s).
        group_count: groups taken per get (whole groups; fewer at the tail).
    """

    def __init__(self, dock, *, prompts_per_step: int, max_groups: int, n: int, draw: Callable[[int], dict],
                 timeout_s: float, group_count: int = 1, step: int = 0):
        self.dock, self.needed, self.max_groups, self.n = dock, prompts_per_step, max_groups, n
        self.draw, self.timeout_s, self.group_count, self.step = draw, timeout_s, max(1, group_count), step
        self.drawn = prompts_per_step
        self.kept: list[int] = []
        self.dropped: list[int] = []
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "GroupFilter":
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dynamic-sampling-{self.step}")
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                data, rows = self.dock.get_experience(FILTER, [REWARD], self.group_count * self.n, get_n_samples=True,
                                                      blocking=True, timeout=self.timeout_s)
                if not rows:
                    return
                self._decide(data[REWARD], rows)
        except BaseException as e:  # noqa: BLE001 - finish() and failed() hand it to the driver
            self.error = e

    def _decide(self, scores, rows: list[int]) -> None:
        n = self.n
        rewards = torch.stack([torch.as_tensor(s).reshape(-1)[0].float() for s in scores])
        groups = [r // n for r in rows]
        flat = set(constant_groups(rewards, groups))
        for g in sorted(set(groups)):
            group = list(range(g * n, g * n + n))
            if g not in flat:
                self.kept.append(g)
                self.dock.put_experience({GATE: [np.ones(1, dtype=np.int8)] * n}, group, producer=FILTER)
                continue
            self.dropped.append(g)
            self.dock.retire(group)
            if self.drawn < self.max_groups:  # one new prompt in its place, in the next group's rows
                new = self.drawn
                self.drawn += 1
                columns = self.draw(1)
                self.dock.set_extent(self.drawn * n)
                rows_new = list(range(new * n, new * n + n))
                self.dock.put_experience({c: [torch.as_tensor(v[0]) for _ in range(n)] for c, v in columns.items()},
                                         rows_new, producer="dataset")
        if len(self.kept) + len(self.dropped) == self.drawn and self.drawn < self.max_groups:
            # every drawn group is decided and none will replace another: the rows never drawn leave the step
            self.dock.retire(list(range(self.drawn * n, self.max_groups * n)))

    def failed(self) -> BaseException | None:
        return self.error

    def finish(self, timeout_s: float = 30.0) -> dict[str, float]:
        """The step's dynamic-sampling metrics, once the thread is done."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"step {self.step}: dynamic sampling did not finish within {timeout_s:.0f} s "
                                   f"after the stages did ({len(self.kept)} groups kept, {len(self.dropped)} dropped, "
                                   f"{self.drawn} drawn)")
        if self.error is not None:
            raise self.error
        decided = len(self.kept) + len(self.dropped)
        return {"dynamic_sampling/dropped_fraction": len(self.dropped) / max(decided, 1),
                "dynamic_sampling/prompts_drawn": float(self.drawn),
                "dynamic_sampling/kept_groups": float(len(self.kept)),
                "dynamic_sampling/short": float(len(self.kept) < self.needed)}


class DynamicSampling:
    """The driver's side of dynamic sampling, a no-op when `rl_config.dynamic_sampling` is off: the dock's
    size and consumers, the step's first extent, one `GroupFilter` per step, its metrics."""

    def __init__(self, cfg):
        rl = cfg.rl_config
        self.enabled = bool(rl.dynamic_sampling)
        self.n, self.prompts = rl.n_samples_per_prompt, rl.prompts_per_step
        self.groups = dock_groups(rl.prompts_per_step, rl.max_oversample) if self.enabled else rl.prompts_per_step
        self.timeout_s = cfg.trainer.stage_timeout_s
        self.group_count = max(1, rl.dock_micro_batch_size // rl.n_samples_per_prompt)
        self.filters: dict[int, GroupFilter] = {}

    def prompts_num(self) -> int:
        """Prompt groups the step's dock holds."""
        return self.groups

    def consumers(self, consumers) -> list[str]:
        return [*consumers, FILTER] if self.enabled else list(consumers)

    def dataset_keys(self, keys) -> list[str]:
        """The columns the loader's batch fills (the gate is the filter's)."""
        return [k for k in keys if k != GATE]

    def open(self, step: int, dock, rows: int, call) -> None:
        """Before the step's first put: only its first `rows` rows are in it (`call`: the driver's dock call)."""
        if self.enabled:
            call("set_extent()", dock.set_extent, rows, context=f"step {step}")

    def start(self, step: int, dock, loader, keys, truncated: dict) -> None:
        """After the first put: the step's filter starts; it draws from `loader` (counted in `truncated[step]`)."""
        if not self.enabled:
            return

        def draw(k: int) -> dict:
            batch = loader.next_batch(k)
            truncated[step] = truncated.get(step, 0) + loader.last_truncated
            return {key: [torch.from_numpy(v) for v in batch[key]] for key in keys}

        self.filters[step] = GroupFilter(dock, prompts_per_step=self.prompts, max_groups=self.groups, n=self.n,
                                         draw=draw, timeout_s=self.timeout_s, group_count=self.group_count,
                                         step=step).start()

    def check(self, step: int) -> None:
        """Raise, while the stages run, what went wrong in the step's filter (stages would wait for the gate)."""
        f = self.filters.get(step)
        if f is not None and f.failed() is not None:
            self.filters.pop(step)
            raise RuntimeError(f"step {step}: dynamic sampling failed: {type(f.error).__name__}: {f.error}")

    def finish(self, step: int) -> dict[str, float]:
        """The step's metrics (none when off); a step that kept fewer than prompts_per_step groups says so."""
        f = self.filters.pop(step, None)
        if f is None:
            return {}
        out = f.finish(self.timeout_s)
        if out["dynamic_sampling/short"]:
            import sys
            print(f"step {step}: dynamic sampling kept {len(f.kept)} of {self.prompts} groups after drawing "
                  f"{f.drawn} prompts (rl_config.max_oversample); training on what it has", file=sys.stderr,
                  flush=True)
        return out
