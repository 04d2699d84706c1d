"""How a backend holds a model in device memory: the one thing the memory plan (planning/memory.py) asks of
a backend (`Backend.memory`), so the plan's arithmetic never names a backend. A plugin backend declares the
model of the built-in it resembles."""

# train backends
REPLICATED = "replicated"          # each dp rank a whole fp32 model, gradients and AdamW state, plus DDP's
                                   # gradient buckets when dp > 1 (torch)
SHARDED = "sharded"                # fp32 states, gradients and an inference copy's weights sharded over the dp
                                   # ranks, the whole logits in the forward (FSDP2)
SPLIT = "split"                    # a whole copy per rank of its own tp / pp slice, no DDP buckets (mesh)
MODEL_PARALLEL = "model_parallel"  # 16-bit parameters / (tp pp), fp32 masters, main gradients and the
                                   # distributed optimizer's state over dp (megatron)
# rollout backends
KV_ROWS = "kv_rows"                # weights plus a KV cache for the rows of one generate call (hf, mesh)
DEVICE_SHARE = "device_share"      # a share of the device it reserves itself (vLLM's gpu_memory_utilization)
# both
NO_MODEL = "no_model"              # holds no model (simulate)

TRAIN_MODELS = (REPLICATED, SHARDED, SPLIT, MODEL_PARALLEL, NO_MODEL)
ROLLOUT_MODELS = (KV_ROWS, DEVICE_SHARE, NO_MODEL)
