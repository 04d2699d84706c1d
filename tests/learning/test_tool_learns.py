"""The tool task (configs/grpo_tiny_tool.yaml, seed 1) learns: shortened to STEPS steps, the model calls the
lookup tool unforced, reads its result and writes the answer itself, and its 10-step mean reward ends above
THRESHOLD. The tool never answers for it: the config forces no call and returns no result as the answer, and the
answer's own digits (`reward/answer_mean`, the text the model wrote after the result) must be right. The same
run's first steps equal a blocking run's (guarantee_order), so the agent rollout repeats in both modes.

The 5-seed spread, and the same task without the tool, are in docs/agent.md with their commands."""
from __future__ import annotations

import pytest

from .helpers import config_dict, last10, train

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 350
# 10-step means at step 349 of seeds 1-5 (docs/agent.md, docs/benchmarks/seed_spread_grpo_tiny_tool_held_out.json):
# the reward 0.495-0.956, the answer's digits (reward/answer_mean) 0.443-0.953, reads of the prompt's own key
# (reward/read_mean) 0.603-0.963; on the 12 held-out keys after step 349 (8 responses each) val/reward_mean
# 0.362-0.959 and val/read_mean 0.406-0.969, the training reward minus the held-out one -0.030 to 0.134 (the
# seeds that have learned the call read the tool on unseen keys as on seen ones; the two still learning it,
# 1 and 3, call it on fewer unseen keys). The margins are for other CPUs' rounding. An untrained policy scores
# about 0.01; the format shaping alone is at most 0.2, and without the tool the answer's digits stay below 0.4
THRESHOLD = 0.35
ANSWER_THRESHOLD = 0.3
READ_THRESHOLD = 0.4
VAL_N = 8
VAL_THRESHOLD = 0.25     # held-out keys' val/reward_mean
VAL_READ_THRESHOLD = 0.3  # held-out keys' val/read_mean: it calls the tool with a key it never trained on
HELD_OUT_GAP = 0.2       # training's last-10 reward minus the held-out keys' val/reward_mean


@pytest.mark.slow_budget(90, reason="350 RL steps of two-turn rollouts (the call is learned by step 300-400), "
                                     "then 3 blocking steps")
def test_grpo_tiny_tool_learns(ray_session, tmp_path):
    agent = config_dict("grpo_tiny_tool", {})["generate_config"]["agent"]
    assert agent["tool_choice"] is None and agent["return_direct"] == [], "the model calls and answers itself"
    # validated once, after the last step, on the 12 keys training never draws (8 responses each)
    records = train("grpo_tiny_tool", tmp_path / "run", STEPS,
                    **{"trainer.val_interval": STEPS, "generate_config.val.n": VAL_N})
    assert [r["step"] for r in records] == list(range(STEPS))
    # a run's first steps are those of any longer run of the seed: blocking mode, stage after stage, computes
    # what the overlapped run did
    blocking = train("grpo_tiny_tool", tmp_path / "blocking", 3, **{"rl_config.blocking": True})
    for a, b in zip(blocking, records[:3]):
        assert (a["actor/pg_loss"], a["reward/mean"]) == (b["actor/pg_loss"], b["reward/mean"]), a["step"]
        assert a["agent/calls_per_row"] > 0, "the random model closes a call in some rows, unforced"
        assert a["agent/tool_tokens_mean"] > 0
        assert a["rollout/logprob_diff_max"] < 1e-5, "the tool's tokens are masked out of the check"
    assert last10(records[:10]) < 0.05, "the untrained policy"
    assert last10(records) >= THRESHOLD, [round(r["reward/mean"], 3) for r in records[-10:]]
    assert last10(records, "reward/answer_mean") >= ANSWER_THRESHOLD, "the answer the model wrote itself"
    assert last10(records, "reward/read_mean") >= READ_THRESHOLD, "read from its own key's lookup"
    held_out = records[-1]
    assert held_out["val/weight_version"] == STEPS and held_out["val/prompts"] == 12
    # on keys it never trained on it reads the tool and scores near the training keys: not a memorized table
    seen = (held_out["val/reward_mean"], held_out["val/read_mean"], last10(records))
    assert held_out["val/reward_mean"] >= VAL_THRESHOLD and held_out["val/read_mean"] >= VAL_READ_THRESHOLD, seen
    assert last10(records) - held_out["val/reward_mean"] <= HELD_OUT_GAP, seen
