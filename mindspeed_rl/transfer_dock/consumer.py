"""One consumer's progress through a step: which rows it took, which its sampler holds back,
and the ready lists of the column sets it asks for.

The dock keeps one per consumer and updates it under its lock; a row is taken once per consumer
per step, so this is all the dock needs to hand a consumer only rows it has not had.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .samplers import ReadyRows, Sampler


@dataclass
class ConsumerState:
    """One consumer's progress in the current step."""

    sampler: Sampler
    capacity: int
    taken: np.ndarray = field(init=False)
    blocked: np.ndarray = field(init=False)  # taken, or reserved by the sampler
    n_samples_per_prompt: int = 1
    taken_count: int = 0
    untouched_groups: int = 0  # prompt groups none of whose rows this consumer has taken
    group_taken: np.ndarray = field(init=False)
    reserved: set[int] = field(default_factory=set)
    cursor: int = 0  # every row below it is taken
    views: dict[frozenset, ReadyRows] = field(default_factory=dict)
    retired: np.ndarray = field(init=False)  # rows retired before this consumer took them (counted in taken)
    retired_count: int = 0

    def __post_init__(self) -> None:
        self.taken = np.zeros(self.capacity, dtype=bool)
        self.blocked = np.zeros(self.capacity, dtype=bool)
        self.retired = np.zeros(self.capacity, dtype=bool)
        self.group_taken = np.zeros(self.capacity // self.n_samples_per_prompt, dtype=np.int32)
        self.untouched_groups = len(self.group_taken)

    def reset(self, n_samples_per_prompt: int) -> None:
        self.taken[:] = False
        self.blocked[:] = False
        self.retired[:] = False
        self.taken_count = 0
        self.retired_count = 0
        self.group_taken[:] = 0
        self.untouched_groups = len(self.group_taken)
        self.reserved.clear()
        self.cursor = 0
        self.views = {k: ReadyRows(k, self.capacity, n_samples_per_prompt) for k in self.views}
        self.sampler.reset()
