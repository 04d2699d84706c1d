"""PPO (with a critic) and ReMax end to end through the same trainer, dock and workers as GRPO.

Nothing in the trainer or workers is algorithm-specific: these runs only change
`rl_config.algorithm`. Each run is 3 steps of 64 rows on the shared Ray instance.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.trainer import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def run(tmp: Path, name: str, algorithm: str, **sections) -> list[dict]:
    base = {"trainer": {"total_steps": 3, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "save_interval": 0, "stage_timeout_s": 60, "dashboard": False,
                        "report": False},
            "rl_config": {"algorithm": algorithm, "n_samples_per_prompt": 1, "prompts_per_step": 64,
                          "guarantee_order": True},
            # mini-batches count prompts: 32 of 64 (x 1 sample) = 2 optimizer steps per RL step
            "actor_config": {"ppo_mini_batch_size": 32}, "critic_config": {"ppo_mini_batch_size": 32}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return Trainer(config_from_dict(base)).run()


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """Each algorithm blocking + colocated and non-blocking + disaggregated, same seed; in the
    disaggregated PPO run critic_values gets a worker of its own, so the critic's weights cross
    processes. The colocated PPO run is made in two parts, 2 steps with a checkpoint, then a resume to 3:
    one worker saves and restores the actor's and the critic's state, so the comparison with the
    uninterrupted disaggregated run checks that resume too."""
    tmp = tmp_path_factory.mktemp("algos")
    out = {}
    for algorithm in ("ppo", "remax"):
        for blocking, mode in ((True, "colocated"), (False, "disaggregated")):
            name = f"{algorithm}-{mode}-{blocking}"
            placement = {"mode": mode}
            if algorithm == "ppo" and mode == "disaggregated":
                placement["groups"] = {"critic_inference": {"mfcs": ["critic_values"]}}
            sections = {"rl_config": {"blocking": blocking}, "placement": placement}
            if algorithm == "ppo" and mode == "colocated":
                run(tmp, name, algorithm, trainer={"total_steps": 2, "save_interval": 2}, **sections)
                run(tmp, name, algorithm, trainer={"save_interval": 2, "resume": True}, **sections)
                history = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
            else:
                history = run(tmp, name, algorithm, **sections)
            out[(algorithm, blocking)] = (history, tmp / name)
    return out


def test_a_colocated_actor_and_critic_resume_from_one_checkpoint(runs):
    history, out_dir = runs[("ppo", True)]
    assert [r["step"] for r in history] == [0, 1, 2]
    manifest = json.loads((out_dir / "checkpoints" / "step_000002" / "manifest.json").read_text())
    files = sorted(r["file"] for records in manifest["parts"].values() for r in records)
    assert files == ["actor/engine.pt", "actor/rng_rank0.pt", "critic/engine.pt", "critic/rng_rank0.pt"]


def test_ppo_trains_actor_and_critic_and_syncs_both(runs):
    history, out_dir = runs[("ppo", False)]
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    for rec in lines:
        for key in ("actor/pg_loss", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                    "critic/values_mean", "critic/returns_mean", "timing/critic_values", "timing/critic_train"):
            assert key in rec, key
        assert rec["critic/updates"] == 2 and rec["actor/updates"] == 2  # 64 rows, mini-batches of 32
    # disaggregated: the critic's inference copy lives in another process and got every update
    assert all(r["weight_sync/critic_readers"] == 1 for r in lines)
    assert len({r["weight_sync/critic_checksum"] for r in lines}) == 3
    # the critic's values at step k+1 come from weights trained at step k: its loss moves
    assert len({round(r["critic/vf_loss"], 8) for r in lines}) == 3


def test_remax_scores_the_greedy_baseline(runs):
    history, _ = runs[("remax", False)]
    for rec in history:
        assert 0.0 <= rec["reward/reward_baselines_mean"] <= 1.0
        assert rec["timing/actor_greedy_rollout"] > 0 and rec["timing/greedy_reward"] > 0
        assert "critic/vf_loss" not in rec


@pytest.mark.parametrize("algorithm, keys", [("ppo", ("actor/pg_loss", "critic/vf_loss", "reward/mean")),
                                             ("remax", ("actor/pg_loss", "reward/reward_baselines_mean"))])
def test_blocking_and_overlap_give_identical_numbers(runs, algorithm, keys):
    blocking, overlap = runs[(algorithm, True)][0], runs[(algorithm, False)][0]
    for key in keys:
        assert [r[key] for r in blocking] == [r[key] for r in overlap], key
    assert ([r["weight_sync/actor_checksum"] for r in blocking] ==
            [r["weight_sync/actor_checksum"] for r in overlap])
