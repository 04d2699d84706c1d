"""Weight transport from a train engine to its readers: buckets and their broadcast (`weight_sync.py`,
how a bucket lies on the wire in `bucket_layout.py`),
the same-node IPC path (`ipc_sync.py`) and the clean-up of shared-memory segments it leaves."""
