"""ReaLHF's PPO allocation end to end (configs/ppo_realhf_8dev.yaml, issue 18 part 3): on a (1, 8) CPU
mesh, actor generation dp 4 x pp 2 on all 8 devices, critic inference on [0, 1], the rule reward on
[2, 3], reference inference pp 4 on [4..7], critic training dp 2 x pp 2 on [4..7] and actor training
dp 2 x pp 2 on [0..3]: 25 Ray actors on the shared test Ray instance. The dry run names every MFC's
groups and rank mapping; the real run trains 3 steps with every consumer taking each row once and
the trained weights reaching all 8 generation ranks and the critic's inference copy every step."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.planning import format_plan, make_plan

from .test_mesh_e2e import Recording

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ppo_realhf_8dev.yaml"
STEPS = 3
# group -> (dp, tp, pp, devices)
GROUPS = {"actor@all/4/1/2": (4, 1, 2, list(range(8))), "critic@node0:0-1": (2, 1, 1, [0, 1]),
          "reward@node0:2-3": (2, 1, 1, [2, 3]), "ref@node0:4-7/1/1/4": (1, 1, 4, [4, 5, 6, 7]),
          "critic@node0:4-7/2/1/2": (2, 1, 2, [4, 5, 6, 7]), "actor@node0:0-3/2/1/2": (2, 1, 2, [0, 1, 2, 3]),
          "rule": (1, 1, 1, [])}


def config(out: Path, **trainer) -> dict:
    d = yaml.safe_load(CONFIG.read_text())
    d["trainer"].update({"total_steps": STEPS, "output_dir": str(out), "progress": False, "logger": ["jsonl"],
                         "plot": False, "save_interval": 0, "stage_timeout_s": 120, "dashboard": False,
                         "report": False, **trainer})
    return d


def test_dry_run_names_each_mfcs_groups_and_rank_mapping(tmp_path):
    plan = make_plan(config_from_dict(config(tmp_path)), check_files=True)  # a real run's checks pass
    assert {g: (p.resources.dp, p.tp, p.pp, p.devices) for g, p in plan.groups.items()} == GROUPS
    rows = [line.split() for line in format_plan(plan).splitlines()]
    # MFC, group, DP/TP/PP, rank:device..., TP groups..., PP groups..., DP groups..., readers, writers
    assert ["actor_rollout", "actor@all/4/1/2", "4/1/2", "0:0", "1:1", "2:2", "3:3", "4:4", "5:5", "6:6", "7:7",
            "[0]", "[1]", "[2]", "[3]", "[4]", "[5]", "[6]", "[7]", "[0,4]", "[1,5]", "[2,6]", "[3,7]",
            "[0,1,2,3]", "[4,5,6,7]", "0,1,2,3", "4,5,6,7"] in rows
    assert ["ref_log_prob", "ref@node0:4-7/1/1/4", "1/1/4", "0:4", "1:5", "2:6", "3:7", "[0]", "[1]", "[2]", "[3]",
            "[0,1,2,3]", "[0]", "[1]", "[2]", "[3]", "0", "3"] in rows
    assert ["critic_train", "critic@node0:4-7/2/1/2", "2/1/2", "0:4", "1:5", "2:6", "3:7", "[0]", "[1]", "[2]", "[3]",
            "[0,2]", "[1,3]", "[0,1]", "[2,3]", "0,1", "2,3"] in rows
    assert plan.groups["actor@all/4/1/2"].rollout_backend == "mesh"  # generation on the mesh backend, one actor per rank
    assert plan.resource_totals()["CPU"] <= 2.0   # fits this 2-core machine's Ray


@pytest.mark.slow
@pytest.mark.ray
# 25 Ray actors, each importing torch on 2 cores, before 3 steps: the start-up is most of it
@pytest.mark.slow_budget(90, reason="ReaLHF's allocation needs its 25 actors (one per rank of 6 groups)")
def test_realhf_ppo_allocation_trains_three_steps(ray_session, tmp_path):
    trainer = Recording(config_from_dict(config(tmp_path / "run")))
    history = trainer.run()
    assert [r["step"] for r in history] == list(range(STEPS))
    for group, (dp, tp, pp, _) in GROUPS.items():
        assert len(trainer.worker_nodes[group]) == dp * tp * pp, group   # one Ray actor per rank
    rows = 128
    for step, rec in enumerate(history):
        for key in ("actor/pg_loss", "actor/kl", "critic/vf_loss", "reward/mean"):
            assert math.isfinite(rec[key]), (step, key, rec[key])
        # 128 rows in 32-prompt mini-batches: 4 optimizer steps, reported by each of the 2 replicas
        assert rec["actor/updates"] == rec["critic/updates"] == 8
        # the log-probs the 8 generation ranks sampled with equal the trainer's: the synced weights arrived
        assert rec["rollout/logprob_diff_max"] < 1e-5, (step, rec["rollout/logprob_diff_max"])
        assert rec["weight_sync/actor_readers"] == 8 and rec["weight_sync/critic_readers"] == 2
        # exactly once: every consumer took the step's rows; the readers' reports count them
        assert all(s["taken"] == s["total"] == rows for s in trainer.consumed[step].values()), trainer.consumed[step]
        taken: dict[str, int] = {}
        for r in trainer.reports[step]:
            taken[r["stage"]] = taken.get(r["stage"], 0) + r["rows"]
        assert set(taken.values()) == {rows}, taken
