"""Rollout engines: what generates responses (hf, vllm, the mesh split of hf) and the sampling they share.
Each is built by name from the registry (`engines/registry.py`); a worker imports none of them directly."""
