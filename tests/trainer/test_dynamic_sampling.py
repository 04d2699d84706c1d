"""Dynamic sampling (trainer/dynamic_sampling.py): the driver's filter keeps groups with varying rewards,
retires all-equal ones and draws replacements until the step holds prompts_per_step useful groups; and the
plan's refusal of models stepped by several ranks. A real run of the tiny job with
rl_config.dynamic_sampling=true, learning, is tests/learning/test_dynamic_sampling_learns.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mindspeed_rl.dataflow.rollout_options import FILTER, GATE
from mindspeed_rl.trainer.dynamic_sampling import GroupFilter, dock_groups
from mindspeed_rl.transfer_dock import TransferDock

N = 4


def flat(prompt: int) -> bool:
    """Prompts whose group gets all-equal rewards: every third."""
    return prompt % 3 == 0


def run_step(prompts_per_step: int, max_groups: int, start: int = 0):
    dock = TransferDock(["prompts", "rm_scores", GATE], ["reward", FILTER, "train"], max_groups, N,
                        guarantee_order=True, default_timeout=20.0)
    source = iter(range(start + prompts_per_step, 10**6))

    def draw(k):
        return {"prompts": [torch.tensor([next(source)]) for _ in range(k)]}

    dock.set_extent(prompts_per_step * N)
    dock.put_experience({"prompts": [torch.tensor([start + r // N]) for r in range(prompts_per_step * N)]},
                        list(range(prompts_per_step * N)))
    f = GroupFilter(dock, prompts_per_step=prompts_per_step, max_groups=max_groups, n=N, draw=draw, timeout_s=20.0,
                    group_count=2).start()
    seen = {"reward": [], "train": []}

    def reward():
        while True:
            data, rows = dock.get_experience("reward", ["prompts"], 6, blocking=True, timeout=20.0)
            if not rows:
                return
            seen["reward"] += rows
            scores = [torch.tensor([0.5 if flat(int(p[0])) else float(r % 2)]) for p, r in zip(data["prompts"], rows)]
            dock.put_experience({"rm_scores": scores}, rows)

    def train():
        while True:
            data, rows = dock.get_experience("train", ["prompts", GATE], 8, blocking=True, timeout=20.0)
            if not rows:
                return
            seen["train"] += [(r, int(p[0])) for r, p in zip(rows, data["prompts"])]

    threads = [threading.Thread(target=reward), threading.Thread(target=train)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    metrics = f.finish()
    return dock, f, metrics, seen


def test_all_equal_groups_are_replaced_until_the_step_holds_enough():
    dock, f, m, seen = run_step(prompts_per_step=6, max_groups=18)
    assert len(f.kept) == 6 and all(dock.all_consumed(c) for c in ("reward", FILTER, "train"))
    trained = sorted(seen["train"])
    assert len(trained) == 6 * N and len({r for r, _ in trained}) == 6 * N, "every kept row once"
    assert not any(flat(p) for _, p in trained), "no all-equal group reached training"
    assert {r // N for r, _ in trained} == set(f.kept)
    assert m["dynamic_sampling/kept_groups"] == 6 and m["dynamic_sampling/prompts_drawn"] == 6 + len(f.dropped)
    assert m["dynamic_sampling/dropped_fraction"] == pytest.approx(len(f.dropped) / (6 + len(f.dropped)))
    assert m["dynamic_sampling/short"] == 0.0 and len(f.dropped) >= 2  # prompts 0 and 3 at least
    assert sorted(seen["reward"]) == list(range((6 + len(f.dropped)) * N)), "the reward saw every drawn row"


def test_the_cap_ends_the_step_short_and_says_so():
    dock, f, m, seen = run_step(prompts_per_step=6, max_groups=7)  # prompts 0 and 3 flat; the one replacement (6) too
    assert f.drawn == 7 and f.dropped == [0, 3, 6] and len(f.kept) == 4 and m["dynamic_sampling/short"] == 1.0
    assert len(seen["train"]) == 4 * N and all(dock.all_consumed(c) for c in ("reward", FILTER, "train"))


def test_dock_groups():
    assert dock_groups(16, 3.0) == 48 and dock_groups(16, 1.0) == 16 and dock_groups(10, 1.25) == 13


@pytest.mark.parametrize("placement", [
    {"groups": {"integrated": {"dp": 2}}},
    {"mode": "mesh", "n_devices_per_node": 2, "mfcs": {"actor_rollout": {"mesh": "0"}, "ref_log_prob": {"mesh": "1"}, "actor_log_prob": {"mesh": "0-1", "tp": 2},
                                                       "actor_train": {"mesh": "0-1", "tp": 2}}},
])
def test_a_model_stepped_by_several_ranks_is_refused_by_the_plan(placement):
    """A short step would hand the ranks unequal rows, and their collectives would wait on each other:
    refused before any worker starts, naming the group and the fix."""
    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.planning import make_plan
    cfg = config_from_dict({"rl_config": {"dynamic_sampling": True}, "placement": placement})
    with pytest.raises(ConfigError, match=r"rl_config.dynamic_sampling=true with worker group '[^']+' \(\[.*'actor_train'"
                                          r".*\]\) at dp=\d tp=\d pp=\d: .* run that group on one rank"):
        make_plan(cfg, check_files=False)
    make_plan(config_from_dict({"rl_config": {"dynamic_sampling": True}}), check_files=False)  # one rank: planned
