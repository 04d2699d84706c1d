"""GRPO end to end through Ray, the dock and real workers, on the tiny built-in task.

One Ray instance for the whole session (`ray_session`); each run is a few steps of 128 rows.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.trainer import Trainer, TrainingError

pytestmark = pytest.mark.ray

REQUIRED = ("step", "reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl", "actor/entropy",
            "actor/grad_norm", "timing/step", "throughput/tokens_per_s", "weight_version")
STAGES = ("actor_rollout", "rule_reward", "ref_log_prob", "actor_log_prob", "compute_advantage", "actor_train")


def run(tmp: Path, name: str, **sections) -> list[dict]:
    base = {"trainer": {"total_steps": 3, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "save_interval": 0, "stage_timeout_s": 60}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return Trainer(config_from_dict(base)).run()


@pytest.fixture(scope="module")
def matrix(ray_session, tmp_path_factory):
    """3 steps in each of colocated/disaggregated x blocking/non-blocking, same seed."""
    tmp = tmp_path_factory.mktemp("matrix")
    out = {}
    for mode in ("colocated", "disaggregated"):
        for blocking in (True, False):
            name = f"{mode}-{'blocking' if blocking else 'overlap'}"
            out[(mode, blocking)] = (run(tmp, name, rl_config={"blocking": blocking, "guarantee_order": True},
                                         placement={"mode": mode}), tmp / name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("blocking", [True, False])
def test_run_writes_metrics_per_step(matrix, mode, blocking):
    history, out_dir = matrix[(mode, blocking)]
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    for rec in lines:
        for key in REQUIRED:
            assert key in rec, key
        for stage in STAGES:
            assert rec[f"timing/{stage}"] > 0
        assert 0.0 <= rec["reward/mean"] <= 1.0
        assert rec["response_length/mean"] > 0
    # the published weight version counts trained steps: the rollout of step k used version k (on-policy)
    assert [r["weight_version"] for r in lines] == [1, 2, 3]
    # rollout at step k served the weights of step k-1's last update (strictly on-policy)
    assert lines[-1]["weight_sync/actor_readers"] >= 1


@pytest.mark.slow
def test_blocking_and_overlap_give_identical_losses(matrix):
    """guarantee_order + fixed seed: every mode and placement computes the same numbers."""
    losses = {k: [r["actor/pg_loss"] for r in h] for k, (h, _) in matrix.items()}
    rewards = {k: [r["reward/mean"] for r in h] for k, (h, _) in matrix.items()}
    first = losses[("colocated", True)]
    assert all(v == first for v in losses.values()), losses
    assert all(v == rewards[("colocated", True)] for v in rewards.values()), rewards
    checks = {k: [r["weight_sync/actor_checksum"] for r in h] for k, (h, _) in matrix.items()}
    assert all(v == checks[("colocated", True)] for v in checks.values())


@pytest.mark.slow
def test_each_groups_actors_were_reserved_as_one_placement_group_and_given_back(matrix):
    """Outside mode mesh each worker group's actors sit on one PACK placement group, bundle k for actor k with
    what the actor asks for, removed at the end of its run."""
    import ray
    groups = [v for v in ray.util.placement_group_table().values() if v["name"].startswith("mindspeed_rl-")]
    by_group: dict[str, list] = {}
    for v in groups:
        by_group.setdefault(v["name"].split("-")[1], []).append(v)
    assert set(by_group) >= {"integrated", "rollout", "actor", "rule"}, sorted(by_group)
    assert all(v["state"] == "REMOVED" and v["strategy"] == "PACK" for v in groups)
    assert all(v["bundles"] and all(b.get("CPU", 0) > 0 for b in v["bundles"].values()) for v in groups)


@pytest.mark.slow
def test_disaggregated_syncs_weights_across_processes(matrix):
    history, _ = matrix[("disaggregated", False)]
    # rollout lives in another process: the trainer broadcast to it and both checksums matched
    assert all(r["weight_sync/actor_readers"] == 1 for r in history)
    assert len({r["weight_sync/actor_checksum"] for r in history}) == 3  # the weights changed every step


@pytest.mark.slow
def test_resume_continues_exactly(matrix, tmp_path):
    """The full run is the matrix's colocated non-blocking one, the default config (never saved): a run
    of the same config stopped after step 1 and resumed for two more steps gives its numbers exactly."""
    full, _ = matrix[("colocated", False)]
    run(tmp_path, "split", trainer={"total_steps": 1, "save_interval": 1})
    # a part of the same size at the same path, written by another run: refused by name, before any worker starts
    import shutil
    shutil.copytree(tmp_path / "split", tmp_path / "stale")
    step_dir = tmp_path / "stale" / "checkpoints" / "step_000001"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert "actor/rng_rank0.pt" in [r["file"] for records in manifest["parts"].values() for r in records]
    rng = step_dir / "actor" / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes())    # the same bytes, written later
    with pytest.raises(ConfigError, match=r"stale/checkpoints/step_000001/actor/rng_rank0.pt was written after rank "
                                          r"\S+/0 of run " + manifest["run_id"]):
        run(tmp_path, "stale", trainer={"total_steps": 3, "save_interval": 1, "resume": True})
    resumed = run(tmp_path, "split", trainer={"total_steps": 3, "save_interval": 1, "resume": True})
    assert [r["step"] for r in resumed] == [0, 1, 2]
    keys = ("actor/pg_loss", "reward/mean", "actor/grad_norm", "weight_version", "weight_sync/actor_checksum")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]


@pytest.mark.slow
def test_data_parallel_training_with_ddp(ray_session, tmp_path):
    history = run(tmp_path, "dp2", trainer={"total_steps": 2},
                  placement={"mode": "disaggregated", "groups": {"actor": {"dp": 2, "num_cpus": 0.25}}})
    assert [r["weight_version"] for r in history] == [1, 2]
    assert all(r["weight_sync/actor_readers"] == 1 for r in history)


@pytest.mark.slow
def test_worker_crash_stops_the_run_and_keeps_the_checkpoint(ray_session, tmp_path):
    t0 = time.time()
    with pytest.raises(TrainingError, match="rule_reward") as err:
        run(tmp_path, "crash", trainer={"total_steps": 4, "save_interval": 1},
            rl_config={"reward_fn": "tests.trainer.faulty_rewards:crash_in_second_step"})
    assert "died" in str(err.value)
    assert time.time() - t0 < 60
    latest = json.loads((tmp_path / "crash" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 1
    assert (tmp_path / "crash" / "checkpoints" / latest["path"] / "actor" / "engine.pt").is_file()
    # the run report is written on a crash too, showing where the failed step stood
    snapshot = json.loads((tmp_path / "crash" / "dashboard.json").read_text())
    assert snapshot["status"] == "failed" and "rule_reward" in snapshot["error"] and snapshot["step"] == 1
    assert snapshot["consumers"]["actor_train"]["taken"] == 0 and snapshot["consumers"]["actor_rollout"]["taken"] == 128
    assert (tmp_path / "crash" / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_stuck_stage_times_out_with_the_stage_named(ray_session, tmp_path):
    t0 = time.time()
    with pytest.raises(TrainingError) as err:
        run(tmp_path, "hang", trainer={"total_steps": 3, "stage_timeout_s": 3},
            rl_config={"reward_fn": "tests.trainer.faulty_rewards:hang_in_second_step", "blocking": False})
    msg = str(err.value)
    # the late stage and its missing column are named, whichever of its downstream stages (compute_advantage
    # or actor_train: both wait stage_timeout_s) noticed first
    assert "stage 'rule_reward'" in msg and "late" in msg and "rm_scores" in msg, msg
    assert time.time() - t0 < 60


def test_dry_run_starts_nothing(capsys, monkeypatch):
    """A dry run prints the graph and the plan and never calls ray.init itself. Ray is made to look
    not started (other tests of the session may have started it) and ray.init to fail loudly, so any
    start, the trainer's own or Ray's automatic one at a first remote call, would be seen here."""
    import ray
    calls = []

    def no_init(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError("a dry run called ray.init")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_init)
    cfg = config_from_dict({"trainer": {"dry_run": True}})
    assert Trainer(cfg).run() == []
    out = capsys.readouterr().out
    assert "placement plan" in out and "actor_train" in out
    assert calls == [], "a dry run called ray.init"


CLI = Path(__file__).resolve().parents[2] / "cli" / "train_grpo.py"


@pytest.mark.slow
@pytest.mark.parametrize("n,blocking", [(3, False), (5, True)])
def test_cli_runs_the_tiny_default_with_only_n_changed(ray_session, tmp_path, n, blocking):
    """`python cli/train_grpo.py rl_config.n_samples_per_prompt=N` needs no other key: the mini-batch
    counts prompts, the rounded row sizes are printed once. Joins the session's Ray (ray_address)."""
    import os
    import subprocess
    import sys
    out = tmp_path / "run"
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, str(CLI), f"rl_config.n_samples_per_prompt={n}", "trainer.total_steps=3",
                           f"rl_config.blocking={str(blocking).lower()}", f"trainer.output_dir={out}",
                           "trainer.progress=false", "trainer.dashboard=false", "trainer.report=false",
                           "trainer.plot=false", "trainer.save_interval=0", f"placement.ray_address={address}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(CLI.parents[1])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("batch size:")]
    assert f"batch size: actor_config.ppo_micro_batch_size_per_device=32 -> {4 * n} rows" in notes[0]
    assert len(notes) == len(set(notes)) == 3  # micro, generate and advantage rounding, each said once
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert [r["weight_version"] for r in lines] == [1, 2, 3]  # one published version per trained step
    assert all(r["actor/updates"] == 4 for r in lines)
    # the tiny default has no KL term: no reference stage ran, no KL was computed
    assert not any(k.startswith(("timing/ref_log_prob", "actor/kl")) and k != "actor/kl_coef" for k in lines[0])

