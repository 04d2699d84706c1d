"""How a run ends badly: the errors the driver raises and the one-line causes it names.

`TrainingError` carries a message that names the stage and the cause; `Interrupted` is the one a
SIGINT or SIGTERM raises, with the line a user needs to resume. `cause_of` and `first_line` take the
original error out of Ray's wrapping, so a message says what failed, not how Ray reported it.
"""
from __future__ import annotations

import re
import shlex
import signal
from typing import Sequence


class TrainingError(RuntimeError):
    """The run stopped; the message names the stage and the cause."""


class Interrupted(TrainingError):
    """SIGINT or SIGTERM stopped the run (after the same clean-up as a crash).

    `summary(argv)` is the one line a user needs: where the run got to, the checkpoint a resume
    starts from, and the command that resumes it. `exit_code` is the shell's 128 + signal number.
    """

    def __init__(self, signum: int, step: int, steps_done: int, total_steps: int, checkpoint: dict | None,
                 save_interval: int):
        self.signum, self.step, self.steps_done, self.total_steps = signum, step, steps_done, total_steps
        self.checkpoint, self.save_interval = checkpoint, save_interval
        super().__init__(f"stopped by {signal.Signals(signum).name} during step {step} "
                         f"({steps_done} of {total_steps} steps done)")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def summary(self, argv: Sequence[str]) -> str:
        if self.checkpoint is None:
            where = (f"no checkpoint yet (trainer.save_interval={self.save_interval}), a resume starts at step 0")
        else:
            where = f"last checkpoint: step {self.checkpoint['step']} in {self.checkpoint['path']}"
        return f"{self}; {where}; resume with: {resume_command(argv)}"


def resume_command(argv: Sequence[str]) -> str:
    """The command line that ran (`python` + argv), with any trainer.resume override replaced by
    `trainer.resume=true`; each word quoted for a POSIX shell."""
    words = [a for a in argv[1:] if not re.match(r"^\+{0,2}trainer\.resume=", a)]
    return shlex.join(["python", argv[0] if argv else "cli/train_grpo.py", *words, "trainer.resume=true"])


def cause_of(e: Exception) -> str:
    """The original error of a failed Ray task, without Ray's wrapping."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{cause}" if "stage '" in str(cause) else f"{type(cause).__name__}: {cause}"
    return first_line(e)


def first_line(e: Exception) -> str:
    """The last line of an error's text (Ray puts the cause there), or its type when it has none."""
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
