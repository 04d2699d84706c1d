"""configs/grpo_tiny_tool.yaml for real, a few steps: the agent rollout in the trainer on the HF engine, the
model calling the lookup tool when it decides to and writing the answer, blocking and non-blocking giving the
same losses under guarantee_order."""
from __future__ import annotations

import pytest

from mindspeed_rl.trainer import Trainer

from .test_tool_config import _cfg

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(tmp_path, name, blocking):
    cfg = _cfg(**{"trainer.total_steps": 3, "trainer.output_dir": str(tmp_path / name), "trainer.progress": False,
                  "trainer.logger": ["jsonl"], "trainer.plot": False, "trainer.save_interval": 0,
                  "trainer.dashboard": False, "trainer.report": False, "rl_config.blocking": blocking})
    return Trainer(cfg).run()


def test_the_tool_task_runs_and_repeats_in_both_modes(ray_session, tmp_path):
    blocking, overlap = _run(tmp_path, "blocking", True), _run(tmp_path, "overlap", False)
    assert [r["actor/pg_loss"] for r in blocking] == [r["actor/pg_loss"] for r in overlap]
    assert [r["reward/mean"] for r in blocking] == [r["reward/mean"] for r in overlap]
    for r in blocking + overlap:
        assert r["agent/calls_per_row"] > 0, "the random model closes a call in some rows, unforced"
        assert r["agent/tool_tokens_mean"] > 0 and "reward/form_mean" in r and "reward/answer_mean" in r
        assert r["rollout/logprob_diff_max"] < 1e-5, "the tool's tokens are masked out of the check"
