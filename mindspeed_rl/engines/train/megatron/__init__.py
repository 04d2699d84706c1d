"""The megatron-core train backend (`actor_config.backend: megatron`).

`convert` (HF Qwen2 <-> megatron-core names, layouts, TP shards and PP stages) is pure torch and runs
anywhere; `engine.MegatronTrainEngine` needs megatron-core and a CUDA device (or an Ascend NPU with
MindSpeed's megatron adaptor) and imports megatron only inside `build()`. docs/engines.md says what
was run where.
"""
