"""Ray actors: one pull-compute-push loop per MFC against the dock (see `stage.py`, `worker.py`)."""

from . import steps  # noqa: F401  the built-in compute steps, registered by their one list
