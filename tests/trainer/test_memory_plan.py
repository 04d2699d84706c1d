"""The memory plan (planning/memory.py): each term against a hand computation, the device rule, the 7B configs
fitting 80 GB devices and refused when they cannot, bad input. No model is built: dimensions come from the
config files the repository ships."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.planning import memory_terms as M
from mindspeed_rl.planning import make_plan, plan_dict
from mindspeed_rl.trainer.validation import validation_on

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def dims(name: str) -> M.ModelDims:
    return M.ModelDims.from_config(json.loads((M.CONFIG_DIR / M.SHIPPED[name]).read_text()))


def config(name: str, **overrides) -> dict:
    raw = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    raw = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return raw


def plan_of(name: str, **overrides):
    return make_plan(config_from_dict(config(name, **overrides)), check_files=False)


# ---------------------------------------------------------------------------- terms by hand
def test_parameter_counts_are_the_published_ones():
    # Qwen2.5's model cards: 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 32.5B (32.8B with the head), 72.7B
    assert dims("qwen2.5-0.5b").params() == 494_032_768
    assert dims("qwen2.5-7b").params() == 7_615_616_512
    d = dims("qwen2.5-7b")
    # by hand: embeddings and an untied head 152064 x 3584 each; a layer: q, o 3584^2, k, v 3584 x 512,
    # 3 x 3584 x 18944 MLP, q/k/v biases 3584 + 2 x 512, two norms
    layer = 2 * 3584 ** 2 + 2 * 3584 * 512 + 3 * 3584 * 18944 + 3584 + 1024 + 2 * 3584
    assert d.layer_params() == layer
    assert d.params() == 2 * 152064 * 3584 + 28 * layer + 3584
    assert d.params("value") == 152064 * 3584 + 28 * layer + 3584 + 3584


def test_shipped_architecture_by_name():
    assert M.shipped_name("/models/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert M.shipped_name("/models/Qwen2.5-0.5B-Instruct/") == "qwen2.5-0.5b"
    assert M.shipped_name("Qwen/Qwen2.5-72B") == "qwen2.5-72b"
    assert M.shipped_name("/models/Llama-3-8B") is None
    assert M.shipped_name("/models/Qwen2.5-9B") is None          # no such architecture shipped
    d, src = M.load_dims("/nowhere/Qwen2.5-14B-Instruct")
    assert d == dims("qwen2.5-14b") and "shipped qwen2.5-14b" in src
    d, src = M.load_dims("/nowhere/model", "qwen2.5-3b")
    assert d == dims("qwen2.5-3b") and "model_config" in src
    assert M.load_dims("/nowhere/model") == (None, "unknown")
    with pytest.raises(ValueError, match="neither a readable config.json"):
        M.load_dims("/nowhere/model", "/nowhere/config.json")


def test_state_and_lora_terms():
    assert M.state_bytes(1000, 16, 4) == 4000
    d = dims("qwen2.5-7b")
    # rank 64 on every linear: 64 x (in + out) per layer: q, o 2 x 7168, k, v 2 x 4096, MLP 3 x 22528
    assert M.lora_params(d, 64, ["all-linear"]) == 28 * 64 * (2 * 7168 + 2 * 4096 + 3 * 22528) == 161_480_704
    assert M.lora_params(d, 8, ["q_proj", "v_proj"]) == 28 * 8 * (7168 + 4096)
    assert M.lora_params(d, 0, ["all-linear"]) == 0


def test_activation_terms_by_hand():
    d = M.ModelDims(hidden=64, intermediate=256, layers=4, heads=4, kv_heads=2, vocab=100)
    # fp32: norms 2 x 8h, inputs 4h x 2, q/k/v/out 4h x (2 + 2 x 1/2), o_proj 4h, rope 8 x 16, MLP 16 I
    fp32 = 2 * 8 * 64 + 4 * 64 * 2 + 4 * 64 * 3 + 4 * 64 + 8 * 16 + 16 * 256
    assert M.activation_bytes_per_token_layer(d, 4, False) == fp32
    # bf16 under autocast: fp32 residual (norms 2 x 8h), one input copy per linear (5 x 2h)
    amp = 2 * 8 * 64 + 2 * 64 * 5 + 2 * 64 * 3 + 2 * 64 + 8 * 16 + 8 * 256
    assert M.activation_bytes_per_token_layer(d, 2, True) == amp
    # bf16 throughout (FSDP2's MixedPrecisionPolicy): norms 2 x 6h, one input copy each
    native = 2 * 6 * 64 + 2 * 64 * 2 + 2 * 64 * 3 + 2 * 64 + 8 * 16 + 8 * 256
    assert M.activation_bytes_per_token_layer(d, 2, False) == native
    tokens = 10
    final = tokens * (4 * 64 + 4 * 64)
    assert M.train_activation_bytes(d, tokens, 4, False, False) == tokens * 4 * fp32 + final
    # checkpointing: each layer keeps its input (4h); one layer is recomputed whole in the backward
    assert M.train_activation_bytes(d, tokens, 4, False, True) == tokens * 4 * 4 * 64 + final
    assert M.recompute_bytes(d, tokens, 4, False) == tokens * fp32
    # LoRA: a frozen norm weight keeps no normalized input (2 x 4h less), each adapter its A output
    assert M.activation_bytes_per_token_layer(d, 4, False, lora_rank=8) == fp32 - 2 * 4 * 64 + 7 * 4 * 8
    assert M.inference_activation_bytes(d, tokens, 2, lora=True) == tokens * 2 * (4 * 64 + 4 * 256)
    assert M.inference_activation_bytes(d, tokens, 2) == tokens * 2 * (4 * 64 + 3 * 256)


def test_logits_kv_and_token_terms():
    d = dims("qwen2.5-7b")
    # several chunks with grad: 4 chunks, and the head's weight gradient of a chunk (fp32 152064 x 3584) once more
    assert M.chunked_logits_bytes(d, 10_000, train=True) == 4 * M.LOGITS_CHUNK_BYTES + 4 * 152064 * 3584
    assert M.chunked_logits_bytes(d, 100, train=True) == 4 * 4 * 152064 * 100     # one chunk: no second gradient
    assert M.chunked_logits_bytes(d, 10_000, True, head_trained=False) == 4 * M.LOGITS_CHUNK_BYTES  # LoRA
    assert M.chunked_logits_bytes(d, 10, train=False) == 2 * 4 * 152064 * 10      # fewer tokens than a chunk
    assert M.chunked_logits_bytes(d, 10, False, 2) == 2.5 * 4 * 152064 * 10       # and the 16-bit logits
    # a log-prob pass: the larger of the layers' and the head's working sets, over the hidden states
    assert M.log_prob_pass_bytes(5.0, 7.0, 10, d, 2) == 7.0 + 10 * 3584 * 2
    assert M.full_logits_bytes(d, 2, 9, 2, train=True) == 2 * 10 * 152064 * 2 * 2 + 2 * M.LOGITS_CHUNK_BYTES
    # keys and values: 2 x 28 layers x 4 kv heads x 128 x 2 B per token, one layer's keys twice while appending
    assert M.kv_cache_bytes(d, 3, 100, 2) == pytest.approx(2 * 28 * 512 * 2 * 300 * (1 + 1 / 56))
    assert M.vllm_bytes(0.5, 80 * GB) == 40 * GB
    assert M.tokens_per_forward(4, 3072, None) == 4 * 3072
    assert M.tokens_per_forward(4, 3072, 8192) == 8192
    assert M.tokens_per_forward(4, 3072, 1000) == 3072                 # a row longer than the budget goes alone
    assert M.tokens_per_forward(2, 100, 10_000) == 200


def test_engines_source_the_short_attention_length():
    from mindspeed_rl.models.cpu_attention import SHORT_KV
    assert M.SHORT_KV == SHORT_KV


def test_engines_source_the_static_decoders_kept():
    from mindspeed_rl.engines.rollout.static_decode import StaticDecoders
    assert M.STATIC_DECODERS_KEPT == StaticDecoders.KEEP


def test_engines_source_the_chunk_size():
    from mindspeed_rl.engines.train.log_probs import logits_chunk_bytes
    assert M.logits_chunk_bytes("cpu") == logits_chunk_bytes("cpu") == M.LOGITS_CHUNK_BYTES
    assert M.logits_chunk_bytes("gpu") == logits_chunk_bytes("cuda") == M.ACCELERATOR_LOGITS_CHUNK_BYTES


# ---------------------------------------------------------------------------- the plan
def test_7b_fits_80gb_with_checkpointing():
    plan = plan_of("grpo_qwen25_7b")
    devs = {tuple(d.ids): d for d in plan.memory.devices}
    assert set(devs) == {(0, 1, 2, 3), (4, 5, 6, 7)}          # rollout first (config order), then the actor
    for d in plan.memory.devices:
        assert d.capacity == 80 * GB and d.peak()[1] <= 80 * GB, d.summary()
    actor = devs[(4, 5, 6, 7)]
    mfc, total, terms = actor.peak()
    named = {t.name: t.bytes for t in terms}
    assert mfc == "actor_train"
    assert named["actor optimizer"] == pytest.approx(7_615_616_512 * 8 / 4)
    assert named["actor weights"] == pytest.approx(7_615_616_512 * 4 / 4)
    assert named["ref weights"] == pytest.approx(7_615_616_512 * 2 / 4)
    assert devs[(0, 1, 2, 3)].peak()[1] == pytest.approx(0.85 * 80 * GB)
    assert "shipped qwen2.5-7b" in plan.memory.sources["actor"]
    assert plan_dict(plan)["memory"]["devices"][1]["peak_at"] == "actor_train"


def test_7b_without_checkpointing_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        plan_of("grpo_qwen25_7b", **{"actor_config.gradient_checkpointing": False,
                                    "actor_config.ppo_micro_batch_size_per_device": 8})
    msg = str(e.value)
    assert "\n" not in msg
    assert "gpu 4-7 (actor)" in msg and "actor activations" in msg and "over its 80 GB" in msg
    assert "actor_config.gradient_checkpointing=true" in msg and "placement.check_memory=false" in msg


def test_check_memory_false_warns_instead():
    plan = plan_of("grpo_qwen25_7b", **{"actor_config.gradient_checkpointing": False,
                                       "actor_config.ppo_micro_batch_size_per_device": 8,
                                       "placement.check_memory": False})
    assert any(n.startswith("WARNING (placement.check_memory=false)") for n in plan.memory.notes)
    assert any("OVER" in line for line in plan.memory.lines())


def test_device_memory_gb_overrides_the_kind_default():
    plan = plan_of("grpo_qwen25_7b", **{"placement.device_memory_gb": 141})
    assert all(d.capacity == 141 * GB for d in plan.memory.devices)
    with pytest.raises(ConfigError, match="over its 40 GB"):
        plan_of("grpo_qwen25_7b", **{"placement.device_memory_gb": 40})


@pytest.mark.parametrize("value", [0, -1, 0.0])
def test_a_memory_figure_at_or_below_zero_is_refused(value):
    with pytest.raises(ConfigError, match="placement.device_memory_gb"):
        plan_of("grpo_qwen25_7b", **{"placement.device_memory_gb": value})


def test_colocated_fractions_share_one_device():
    plan = plan_of("grpo_qwen25_0p5b_1gpu")
    [dev] = plan.memory.devices
    assert dev.ids == [0] and set(dev.groups) == {"rollout", "integrated"}
    # vLLM asleep while the trainer works: its share is on the device at the rollout only
    train = {t.name: t.bytes for t in dev.phases["actor_train"]}
    assert train["vLLM (asleep)"] == 0.0
    assert {t.name: t.bytes for t in dev.phases["actor_rollout"]}["vLLM"] == pytest.approx(0.3 * 80 * GB)
    awake = plan_of("grpo_qwen25_0p5b_1gpu", **{"generate_config.vllm.enable_sleep_mode": False})
    assert {t.name: t.bytes for t in awake.memory.devices[0].phases["actor_train"]}["vLLM"] > 0


def test_hf_rollout_weights_and_kv_cache():
    plan = plan_of("grpo_qwen25_0p5b_1gpu", **{"generate_config.backend": "hf"})
    [dev] = plan.memory.devices
    d = dims("qwen2.5-0.5b")
    terms = {t.name: t.bytes for t in dev.phases["actor_rollout"]}
    assert terms["rollout weights"] == d.params() * 2
    rows = 64                                       # generate_config.micro_batch_size_per_device, whole groups
    # on a GPU the static decode keeps its fixed buffers for two shapes (training's and validation's sampling)
    assert terms["rollout KV cache"] == M.STATIC_DECODERS_KEPT * M.static_kv_bytes(d, rows, 1024 + 2048, 2)
    eager = plan_of("grpo_qwen25_0p5b_1gpu", **{"generate_config.backend": "hf", "generate_config.cuda_graphs": False})
    eager_terms = {t.name: t.bytes for t in eager.memory.devices[0].phases["actor_rollout"]}
    assert eager_terms["rollout KV cache"] == M.kv_cache_bytes(d, rows, 1024 + 2048, 2)


def test_lora_reference_is_the_base_and_only_adapters_train():
    plan = plan_of("grpo_qwen25_7b", **{"actor_config.lora.rank": 64})
    actor = next(d for d in plan.memory.devices if "actor" in d.groups)
    train = {t.name: t.bytes for t in actor.phases["actor_train"]}
    lora = M.lora_params(dims("qwen2.5-7b"), 64, ["all-linear"])
    assert train["ref weights"] == 0.0
    assert train["actor optimizer"] == pytest.approx(lora * 8 / 4)
    assert train["actor weights"] == pytest.approx((7_615_616_512 * 2 + lora * 4) / 4)


def test_offload_takes_state_off_the_device_between_stages():
    plan = plan_of("grpo_qwen25_0p5b_1gpu", **{"actor_config.offload.params": True,
                                              "actor_config.offload.optimizer": True})
    [dev] = plan.memory.devices
    rollout = {t.name: t.bytes for t in dev.phases["actor_rollout"]}
    assert rollout["actor weights"] == 0.0 and rollout["actor optimizer"] == 0.0
    logp = {t.name: t.bytes for t in dev.phases["actor_log_prob"]}
    assert logp["actor weights"] > 0 and logp["actor optimizer"] == 0.0


def test_model_config_key():
    plan = plan_of("grpo_qwen25_7b", **{"actor_config.model_config": "qwen2.5-0.5b"})
    assert "shipped qwen2.5-0.5b (model_config)" in plan.memory.sources["actor"]
    with pytest.raises(ConfigError, match="actor_config.model_config='qwen9'"):
        plan_of("grpo_qwen25_7b", **{"actor_config.model_config": "qwen9"})


def test_cpu_configs_are_estimated_not_checked():
    plan = plan_of("grpo_tiny")
    assert [d.label for d in plan.memory.devices] == ["cpu (host)"]
    assert plan.memory.devices[0].capacity is None and not plan.memory.over()
    assert "(not checked)" in plan.memory.lines()[1]


def test_mesh_devices_hold_each_group_rank():
    plan = plan_of("grpo_qwen25_7b_megatron")
    [dev] = plan.memory.devices                      # every group spans devices 0-7
    assert dev.ids == list(range(8)) and dev.peak()[1] <= 80 * GB


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_7b_lora_fits_one_gpu(backend):
    plan = plan_of("grpo_qwen25_7b_lora_1gpu", **{"generate_config.backend": backend})
    [dev] = plan.memory.devices
    assert dev.ids == [0] and dev.capacity == 80 * GB and dev.peak()[1] <= 80 * GB, dev.summary()
    with pytest.raises(ConfigError, match="gpu 0 .* over its 80 GB"):   # the whole model does not
        plan_of("grpo_qwen25_7b_lora_1gpu", **{"generate_config.backend": backend, "actor_config.lora.rank": 0})


def test_the_host_counts_bf16_compute_every_worker_process_the_driver_docks_and_ray():
    """On the CPU the engines compute in the configured dtype (autocast over fp32 masters), and the host also
    holds every worker process (the rule reward's too, which has no model), the driver, the dock's actor (and the
    validation's with validation on) and Ray's own processes when the trainer starts Ray (measured constants)."""
    plan = plan_of("grpo_tiny", **{"actor_config.dtype": "bfloat16", "rl_config.blocking": True})
    [host] = plan.memory.devices
    assert host.kind == "cpu" and host.groups == ["integrated", "rule"]
    train: dict[str, float] = {}
    for t in host.phases["actor_train"]:
        train[t.name] = train.get(t.name, 0.0) + t.bytes
    assert train["worker process"] == 2 * M.HOST_PROCESS_BYTES and train["driver"] == M.DRIVER_BYTES
    assert train["Ray processes"] == M.RAY_PROCESSES_BYTES
    assert train["docks"] == (2 if validation_on(config_from_dict(config("grpo_tiny"))) else 1) * M.DOCK_BYTES
    no_val = plan_of("grpo_tiny", **{"trainer.val_interval": 0, "trainer.val_before_train": False}).memory.devices[0]
    assert {t.name: t.bytes for t in no_val.phases["actor_train"]}["docks"] == M.DOCK_BYTES
    on_cluster = plan_of("grpo_tiny", **{"placement.ray_address": "auto"}).memory.devices[0]
    assert "Ray processes" not in {t.name for t in on_cluster.phases["actor_train"]}
    d = M.ModelDims.from_config(json.loads((REPO / "mindspeed_rl/models/tiny_qwen2/config.json").read_text()))
    assert train["rollout weights"] == d.params() * 2
    fp32 = {t.name: t.bytes for t in plan_of("grpo_tiny", **{"rl_config.blocking": True}).memory.devices[0]
            .phases["actor_train"]}
    assert fp32["rollout weights"] == d.params() * 4 and fp32["actor activations"] > train["actor activations"]


def test_the_host_overlaps_a_workers_stages_when_the_step_does():
    """With rl_config.blocking false a worker's rollout generates beside its update: while actor_train runs,
    the rollout engine holds its KV cache and forward too; blocking, only its weights. Each rank of a CPU group
    is a process on the host: dp 2 counts two."""
    def terms(**o):
        return [t for t in plan_of("grpo_tiny", **o).memory.devices[0].phases["actor_train"]]
    blocking = {t.name for t in terms(**{"rl_config.blocking": True})}
    overlapped = {t.name for t in terms(**{"rl_config.blocking": False})}
    assert "rollout KV cache" not in blocking and "rollout KV cache" in overlapped
    procs = lambda ts: sum(t.bytes for t in ts if t.name == "worker process")
    assert procs(terms(**{"placement.groups.integrated.dp": 2})) == 3 * M.HOST_PROCESS_BYTES


def test_an_fsdp_root_counts_its_16_bit_gradients_in_the_backward():
    """The 7B actor's root (embeddings and an untied head) computes bf16 gradients whole before their
    reduce-scatter; LoRA freezes the root: none."""
    d = dims("qwen2.5-7b")
    root = d.params("lm") - d.layers * d.layer_params()
    train = {t.name: t.bytes for t in next(x for x in plan_of("grpo_qwen25_7b").memory.devices
                                           if "actor" in x.groups).phases["actor_train"]}
    assert train["actor root grads"] == root * 2 and root == 2 * 152064 * 3584 + 3584
    lora = next(x for x in plan_of("grpo_qwen25_7b", **{"actor_config.lora.rank": 64}).memory.devices
                if "actor" in x.groups)
    assert "actor root grads" not in {t.name for t in lora.phases["actor_train"]}
