"""How a run that cannot go on says why: the stage that is late (not only the one that waited for
it), and a dead worker by name with every stage it hosted."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.planning import make_plan
from mindspeed_rl.trainer import Trainer, TrainingError
from mindspeed_rl.trainer.stage_watch import describe_stall


def sim_config(tmp: Path, name: str, costs: dict, **trainer) -> dict:
    """A simulated GRPO run (no models): the real driver, dock and stage loops, sleeping stages."""
    return {"trainer": {"total_steps": 2, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "dashboard": False, "report": False, "save_interval": 0,
                        "simulate_cost_s_per_row": costs, **trainer}}


def grpo_order():
    return make_plan(config_from_dict({}), check_files=False).order


# ---------------------------------------------------------------------------------------- the pure part
def test_the_late_stage_is_found_through_the_graph():
    """actor_train waits for advantages, compute_advantage for rm_scores: rule_reward is late."""
    columns = {c: {"written": 128, "total": 128} for c in ("prompts", "prompt_length", "labels", "responses",
                                                           "response_length", "weight_version", "ref_log_prob",
                                                           "old_log_prob")}
    columns["rm_scores"] = {"written": 64, "total": 128}
    columns["advantages"] = {"written": 0, "total": 128}
    consumers = {"rule_reward": {"taken": 96, "total": 128}, "compute_advantage": {"taken": 64, "total": 128}}
    lanes = {"rule_reward": "rule/0", "compute_advantage": "rule/0", "actor_train": "integrated/0"}
    msg = describe_stall(grpo_order(), ["actor_train"], columns, consumers, lanes, 3.0)
    assert msg.startswith("stage 'rule_reward' (worker rule/0) took 96/128 rows, wrote rm_scores for 64/128"), msg
    assert "['actor_train'] waited 3 s (trainer.stage_timeout_s)" in msg
    assert "compute_advantage" not in msg.split(":")[0]


def test_a_stage_with_all_its_inputs_is_late_itself():
    columns = {c: {"written": 128, "total": 128} for c in ("prompts", "labels", "responses")}
    columns["rm_scores"] = {"written": 0, "total": 128}
    msg = describe_stall(grpo_order(), ["rule_reward"], columns, {"rule_reward": {"taken": 32, "total": 128}},
                         {"rule_reward": "rule/0"}, 3.0)
    assert msg == ("stage 'rule_reward' (worker rule/0) took 32/128 rows, wrote rm_scores for 0/128 and is late "
                   "itself: its inputs are all written")


# ---------------------------------------------------------------------------------------- through Ray
@pytest.mark.slow
@pytest.mark.ray
def test_slow_stage_is_named_with_its_progress_not_only_the_waiting_one(ray_session, tmp_path):
    """Non-blocking: rule_reward takes 3.2 s per micro-batch of 32 rows, its readers wait 1.5 s. The stage
    loop is a real reward's, with sleeps for the work; a late stage with the real models:
    test_grpo_e2e.py::test_stuck_stage_times_out_with_the_stage_named."""
    cfg = sim_config(tmp_path, "slow", {"rule_reward": 0.1}, stage_timeout_s=1.5)
    t0 = time.time()
    with pytest.raises(TrainingError) as err:
        Trainer(config_from_dict(cfg)).run()
    msg = str(err.value)
    assert re.search(r"^step 0: stage 'rule_reward' \(worker rule/0\) took \d+/128 rows, wrote rm_scores for "
                     r"\d+/128: late, so \['(compute_advantage|actor_train)'\] waited 2 s", msg), msg
    assert time.time() - t0 < 60


@pytest.mark.slow
@pytest.mark.ray
def test_blocking_stall_names_the_running_stage_as_late(ray_session, tmp_path):
    """Blocking: rule_reward runs alone with its inputs all written; one micro-batch takes 8 s, longer
    than the driver's no-progress limit (stage_timeout_s + 5 s)."""
    cfg = sim_config(tmp_path, "stall", {"rule_reward": 0.25}, stage_timeout_s=1)
    cfg["rl_config"] = {"blocking": True}
    with pytest.raises(TrainingError) as err:
        Trainer(config_from_dict(cfg)).run()
    msg = str(err.value)
    assert msg.startswith("step 0: stage 'rule_reward' (worker rule/0) took "), msg
    assert "is late itself: its inputs are all written; stages ['rule_reward'] made no progress" in msg


def run_real(tmp: Path, name: str, reward_fn: str, **trainer) -> list[dict]:
    base = {"trainer": {"total_steps": 3, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "dashboard": False, "report": False, "save_interval": 0,
                        "stage_timeout_s": 60, **trainer},
            "rl_config": {"reward_fn": reward_fn, "blocking": False}}
    return Trainer(config_from_dict(base)).run()


@pytest.mark.slow
@pytest.mark.ray
def test_dead_worker_is_named_with_every_stage_it_hosted(ray_session, tmp_path):
    """Colocated: worker rule/0 hosts rule_reward and compute_advantage; its reward kills the process."""
    with pytest.raises(TrainingError) as err:
        run_real(tmp_path, "crash", "tests.trainer.faulty_rewards:crash_in_second_step")
    msg = str(err.value)
    assert re.search(r"^step 1: worker rule/0 \(Ray actor [0-9a-f]+, pid \d+ on [\d.]+\) died while running "
                     r"stage '(rule_reward|compute_advantage)'; it hosted stages \['rule_reward', "
                     r"'compute_advantage'\]", msg), msg
