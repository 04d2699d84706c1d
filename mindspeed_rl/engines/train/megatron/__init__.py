"""The megatron-core train backend (`actor_config.backend: megatron`).

`convert` (HF Qwen2 <-> megatron-core names, layouts, TP shards and PP stages) is pure torch and runs
anywhere, as do `tensors` (right-padded rows, vocab-parallel log-probs); `engine.MegatronTrainEngine`
(built by `setup`: options, parallel state, the GPTModel, megatron's DDP and optimizer) needs
megatron-core and a CUDA device (or an Ascend NPU with MindSpeed's megatron adaptor) and imports
megatron only inside `build()`. docs/engines.md says what
was run where.
"""
