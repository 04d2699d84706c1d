"""Ray actors: one pull-compute-push loop per MFC against the dock (see `stage.py`, `worker.py`)."""
