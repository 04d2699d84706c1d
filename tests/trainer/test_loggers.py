"""trainer.logger's experiment trackers (trainer/run_log.py): wandb offline and MLflow's local store get every
record under metrics.jsonl's names, the run filed under trainer.project_name / experiment_name / tags with
its config; a tracker whose package is missing is one line and exit 2 before Ray starts.

The trackers run for real where their packages are installed (wandb and mlflow-skinny install in seconds
and pull no torch: this suite's CI has them, see requirements-dev.txt) and skip elsewhere; the
missing-package errors hide the module, so they run everywhere. A whole run with both is in
test_outputs_e2e.py.
"""
from __future__ import annotations

import json
import math
import sys

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.trainer.run_log import RunInfo, RunLog, mlflow_name

RECORDS = [{"step": s, "reward/mean": 0.25 * s, "actor/pg_loss": -0.1 * s, "timing/step": 1.5,
            "actor/updates": 4, "val/pass@1": 0.5, "weight_sync/actor_checksum": f"abc{s}"} for s in range(3)]
INFO = RunInfo(project="proj", name="run-a", tags=["grpo", "tiny"],
               config={"trainer": {"total_steps": 3, "logger": ["jsonl"]}, "actor_config": {"lr": 0.0004}})


def jsonl(directory) -> list[dict]:
    return [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]


def log_all(tmp_path, loggers: list[str]) -> list[dict]:
    log = RunLog(str(tmp_path), loggers, info=INFO)
    for r in RECORDS:
        log.log(dict(r))
    log.close()
    return jsonl(tmp_path)


@pytest.mark.slow   # wandb's import and its service process: about 4 s
def test_wandb_offline_run_has_the_metrics_jsonl_keys(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from .wandb_files import offline_run
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lines = log_all(tmp_path, ["jsonl", "wandb"])
    run = offline_run(tmp_path / "wandb")
    assert (run["project"], run["name"], run["tags"]) == ("proj", "run-a", ["grpo", "tiny"])
    assert run["config"]["trainer"] == {"total_steps": 3, "logger": ["jsonl"]}
    assert run["config"]["actor_config"] == {"lr": 0.0004}
    assert len(run["history"]) == len(lines) == 3
    for row, line in zip(run["history"], lines):
        ours = {k: v for k, v in row.items() if not k.startswith("_")}   # wandb's own: _step, _runtime, ...
        assert ours.keys() == line.keys() - {"step"}
        assert row["_step"] == line["step"]
        assert all(ours[k] == line[k] for k in ours)


def test_mlflow_local_store_has_the_metrics_jsonl_keys(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lines = log_all(tmp_path, ["jsonl", "mlflow"])
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")} == {"grpo": "true", "tiny": "true"}
    assert run.data.params["trainer.total_steps"] == "3" and run.data.params["actor_config.lr"] == "0.0004"
    numbers = {k for k, v in lines[0].items() if k != "step" and isinstance(v, (int, float))}
    assert set(run.data.metrics) == {mlflow_name(k) for k in numbers}
    assert mlflow_name("val/pass@1") == "val/pass_at_1" and mlflow_name("timing/step") == "timing/step"
    for key in numbers:
        history = client.get_metric_history(run.info.run_id, mlflow_name(key))
        assert [(m.step, m.value) for m in history] == [(x["step"], float(x[key])) for x in lines]


def test_run_info_comes_from_the_trainer_keys(tmp_path):
    cfg = config_from_dict({"trainer": {"output_dir": str(tmp_path / "my_run"), "tags": ["a"]}})
    info = RunInfo.of(cfg)
    assert (info.project, info.name, info.tags) == ("mindspeed_rl", "my_run", ["a"])
    assert info.config["trainer"]["output_dir"] == str(tmp_path / "my_run")
    cfg = config_from_dict({"trainer": {"project_name": "p", "experiment_name": "e"}})
    assert (RunInfo.of(cfg).project, RunInfo.of(cfg).name) == ("p", "e")


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_one_line_and_exit_2_before_ray(tmp_path, monkeypatch, capsys, tracker):
    import ray

    from mindspeed_rl.cli_main import train_main
    monkeypatch.setitem(sys.modules, tracker, None)   # `import <tracker>` fails as it does without the package
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as e:
        train_main({"trainer": {"logger": ["console", tracker], "output_dir": str(tmp_path / "run")}})
    assert e.value.code == 2 and started == []
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "config error: invalid config:" and len(lines) == 2   # the one problem, on one line
    assert lines[1].startswith(f"  - trainer.logger=[..., {tracker}]: the {tracker} package is not installed; "
                               f"`pip install -e .[{tracker}]`")


@pytest.mark.parametrize("overrides, words", [
    ({"save_hf": "always"}, ["trainer.save_hf='always'", "must be one of ['final', 'every_save', 'never']"]),
    ({"tags": ["ok", 3]}, ["trainer.tags=['ok', 3]", "[3] are not non-empty strings"]),
    ({"project_name": ""}, ["trainer.project_name=''", "non-empty string"]),
    ({"experiment_name": ""}, ["trainer.experiment_name=''", "or null for output_dir's last part"]),
])
def test_bad_tracker_and_export_keys_are_refused_by_name(overrides, words):
    from mindspeed_rl.config.checks import check_config
    with pytest.raises(ConfigError) as e:
        check_config(config_from_dict({"trainer": overrides}))
    for w in words:
        assert w in str(e.value)


def test_numbers_only_reach_the_trackers_that_take_numbers():
    from mindspeed_rl.trainer.run_log import _numbers
    rec = {"step": 1, "a": 1.0, "b": 2, "c": "x", "d": math.nan, "e": True}
    assert _numbers(rec) == {"a": 1.0, "b": 2}
