"""Weight transport from a train engine to its readers: buckets and their broadcast (`weight_sync.py`),
the same-node IPC path (`ipc_sync.py`) and the clean-up of shared-memory segments it leaves."""
