"""The collective MFCs of a worker take turns, in the same order on every rank of its group.

A DP group's train step (DDP's all-reduces; FSDP's gathers, reduce-scatters and grad-norm all-reduce),
a sharded model's inference and every MFC of a split model are collective over the group's ranks. Two
of them at once in two threads could issue their collectives in different orders on different ranks
and wait on each other crosswise (and, on one FSDP module, reshard the parameters the other's forward
is using). Without turns an FSDP group with dp=2 dies every few dozen steps: a rank's actor_train takes
rows its peer's actor_log_prob has just written, and its forward's all-gathers start while its own
actor_log_prob is still in its last forward; gloo aborts on a message of another size, or a forward meets
a resharded parameter (`aten.mm got mixed torch.Tensor and DTensor`).

The trainer starts every collective MFC of a group for each step it runs, in the group's order
(`actor_log_prob` then `actor_train`; a critic's values and training; a split reference's one MFC): so
the turn after (s, last) is (s + 1, first). They all run at their step's turn (train-time MFCs,
`dataflow.train_time_mfcs`), except a split frozen reference: with max_weight_staleness > 0 its MFC of
step s + 1 may be called while step s's still runs; it then waits for it. A trained model's log-probs
are needed by its training anyway, so taking turns costs only the overlap of a rank's first training
forwards with its peers' last log-prob forwards.
"""
from __future__ import annotations

import contextlib
import threading


class CollectiveTurns:
    def __init__(self):
        self._cond = threading.Condition()
        self._next: tuple[int, int] | None = None   # (step, index of the collective MFC) whose turn it is

    @contextlib.contextmanager
    def turn(self, names: list[str], name: str, step: int):
        """Run `name`'s step-`step` call at its turn among `names` (the group's collective MFCs, in order)."""
        mine = (step, names.index(name))
        with self._cond:
            if self._next is None:  # the first step this process runs (0, or a resumed run's)
                self._next = (step, 0)
            while self._next < mine:
                self._cond.wait(1.0)
        try:
            yield
        finally:
            with self._cond:
                if self._next <= mine:
                    s, i = mine
                    self._next = (s, i + 1) if i + 1 < len(names) else (s + 1, 0)
                self._cond.notify_all()
