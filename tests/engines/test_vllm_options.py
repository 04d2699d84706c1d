"""The vLLM engine's arguments from its options (`vllm_rollout.llm_kwargs`), without building an engine:
the KV cache is an explicit size on the CPU and what gpu_memory_utilization leaves on an accelerator."""
from __future__ import annotations

import logging
from pathlib import Path

from mindspeed_rl.engines.base import RolloutSpec
from mindspeed_rl.engines.rollout.vllm_rollout import DEFAULT_CPU_KV_CACHE_GB, llm_kwargs


def test_on_the_cpu_the_kv_cache_is_kv_cache_gb_or_the_default():
    spec = RolloutSpec(model_path="/m", seed=3)
    assert llm_kwargs(spec, {"kv_cache_gb": 0.5}, True, 1)["kv_cache_memory_bytes"] == 2**29
    assert llm_kwargs(spec, {}, True, 1)["kv_cache_memory_bytes"] == int(DEFAULT_CPU_KV_CACHE_GB * 2**30)


def test_on_cuda_gpu_memory_utilization_sizes_the_kv_cache_and_kv_cache_gb_is_ignored_with_a_warning(caplog):
    spec = RolloutSpec(model_path="/m", seed=3, device="cuda:0")
    with caplog.at_level(logging.WARNING):
        kw = llm_kwargs(spec, {"kv_cache_gb": 1.0, "gpu_memory_utilization": 0.85}, False, 1)
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85
    assert "kv_cache_gb=1.0 is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert "kv_cache_memory_bytes" not in llm_kwargs(spec, {"gpu_memory_utilization": 0.85}, False, 1)
    assert caplog.text == ""


def test_the_one_gpu_configs_leave_kv_cache_gb_to_the_cpu():
    from pathlib import Path

    import yaml
    configs = Path(__file__).resolve().parents[2] / "configs"
    for name in ("grpo_qwen25_0p5b_1gpu", "grpo_qwen25_7b", "grpo_qwen25_7b_lora_1gpu", "grpo_qwen25_7b_megatron"):
        c = yaml.safe_load((configs / f"{name}.yaml").read_text())
        assert c["generate_config"]["vllm"]["kv_cache_gb"] is None, name


def test_partial_rollout_on_vllm_is_planned_with_serve_only(tmp_path):
    """The offline vLLM engine cannot take weights mid-generation; the serving one can (`takes_partial_rollout`)."""
    import pytest

    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.engines.rollout.vllm_engine import VLLMEngine
    from mindspeed_rl.planning import make_plan
    assert not VLLMEngine.takes_partial_rollout({}) and VLLMEngine.takes_partial_rollout({"serve": True})

    def plan(serve: bool):
        return make_plan(config_from_dict({
            "trainer": {"output_dir": str(tmp_path)}, "placement": {"mode": "disaggregated"},
            "generate_config": {"backend": "vllm", "vllm": {"serve": serve}},
            "rl_config": {"max_weight_staleness": 1, "guarantee_order": False, "partial_rollout": True}}))
    with pytest.raises(ConfigError, match="or generate_config.vllm.serve=true"):
        plan(False)
    assert plan(True).groups["rollout"].rollout_row.name == "vllm"


def test_the_serving_engine_is_refused_with_tensor_parallelism_or_sleep_mode_before_any_worker_starts(tmp_path):
    """What the serving engine does not run stops at the plan (exit 2 from the CLI), naming the key and the fix."""
    import pytest
    import yaml

    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.planning import make_plan

    tp2 = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_tp2.yaml").read_text())
    tp2["trainer"]["output_dir"] = str(tmp_path / "tp2")
    tp2["generate_config"]["vllm"]["serve"] = True
    with pytest.raises(ConfigError, match=r"serve=true with tensor parallelism \(tp=2\) is not built.*serve=false"):
        make_plan(config_from_dict(tp2), check_files=False)
    sleeping = {"trainer": {"output_dir": str(tmp_path / "sleep")}, "placement": {"mode": "disaggregated"},
                "generate_config": {"backend": "vllm", "vllm": {"serve": True, "enable_sleep_mode": True}}}
    with pytest.raises(ConfigError, match="worker group 'rollout'.*enable_sleep_mode=true is not built"):
        make_plan(config_from_dict(sleeping), check_files=False)
    sleeping["generate_config"]["vllm"]["enable_sleep_mode"] = False
    assert make_plan(config_from_dict(sleeping), check_files=False).groups["rollout"].rollout_row.name == "vllm"
