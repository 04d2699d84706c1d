"""Train engines: what computes log-probs, values and updates (torch, fsdp, the mesh split, megatron) and
the model features they share (LoRA adapters, offload between stages). Built by name from the registry."""
