"""Validation during training and cli/evaluate.py: the pieces by hand, the refusals before Ray starts, and
one pair of real runs (with and without validation) that must train alike."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.dataflow import algorithm_graph, topological_order
from mindspeed_rl.dataflow.validation import validation_graph
from mindspeed_rl.planning import make_plan
from mindspeed_rl.trainer.validation import format_val_line, val_config, val_metrics

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "remax"])
def test_validation_runs_the_rollout_and_the_reward_only(algorithm):
    g = validation_graph(algorithm_graph(algorithm))
    assert [m.name for m in topological_order(g)] == ["actor_rollout", "rule_reward"]


def test_reward_modeling_has_nothing_to_validate():
    with pytest.raises(ValueError, match="no MFC that writes 'rm_scores'"):
        validation_graph(algorithm_graph("reward_modeling"))


def test_val_overrides_replace_only_what_they_name():
    cfg = config_from_dict({"generate_config": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5,
                                                "val": {"temperature": 0.0, "n": 3}},
                            "rl_config": {"n_samples_per_prompt": 8}})
    v = val_config(cfg)
    g = v.generate_config
    assert (g.temperature, g.top_p, g.top_k, g.max_new_tokens) == (0.0, 0.9, 0, 5)
    assert v.rl_config.n_samples_per_prompt == 3
    assert cfg.generate_config.temperature == 0.7 and cfg.rl_config.n_samples_per_prompt == 8  # not changed


def test_val_metrics_by_hand():
    record = {"reward/mean": 0.5, "reward/max_fraction": 0.25, "reward/format_mean": 0.75,
              "response_length/mean": 2.5, "response_length/max": 3.0, "response/truncated_fraction": 0.5}
    scores = [[1.0, 0.0], [0.5, 0.5]]   # 2 prompts x n = 2: c = 1 and c = 0
    out = val_metrics(record, scores, n=2)
    assert out == {"val/reward_mean": 0.5, "val/format_mean": 0.75, "val/response_length_mean": 2.5,
                   "val/truncated_fraction": 0.5, "val/pass@1": 0.25, "val/pass@2": 0.5}
    assert "val/pass@2" not in val_metrics(record, [[1.0], [0.0]], n=1)


# ------------------------------------------------------------------------------ refusals before Ray starts
def _plan_error(tmp_path, **data) -> str:
    cfg = config_from_dict({"trainer": {"val_interval": 5, "output_dir": str(tmp_path / "out")}, "data": data})
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, check_files=True)
    return str(e.value)


def test_the_validation_line_names_each_metric_once():
    m = {"val/reward_mean": 0.5, "val/pass@1": 0.25, "val/weight_version": 3.0, "timing/val": 1.0}
    assert format_val_line(m, 8, 1).endswith("s): val/reward_mean 0.500 | val/pass@1 0.250")
    assert format_val_line({**m, "val/pass@4": 0.75}, 8, 4).endswith("val/pass@1 0.250 | val/pass@4 0.750")


def test_a_bad_validation_set_is_refused_by_the_plan(tmp_path):
    empty, wrong = tmp_path / "empty.jsonl", tmp_path / "wrong.jsonl"
    empty.write_text("")
    wrong.write_text('{"question": "12=", "answer": "12"}\n')
    assert "no such file" in _plan_error(tmp_path, val_dataset=str(tmp_path / "missing.jsonl"))
    assert "no records" in _plan_error(tmp_path, val_dataset=str(empty))
    msg = _plan_error(tmp_path, val_dataset=str(wrong))
    assert "data.val_dataset=" in msg and "missing key 'prompt'" in msg and "data.prompt_key" in msg
    assert "unknown built-in dataset 'builtin:nope'" in _plan_error(tmp_path, val_dataset="builtin:nope")
    assert "validation needs data.val_dataset" in _plan_error(tmp_path, val_dataset=None)
    with pytest.raises(ConfigError, match=r"generate_config\.val\.temprature: unknown key \(did you mean 'temperature'"):
        config_from_dict({"generate_config": {"val": {"temprature": 0.0}}})
    with pytest.raises(ConfigError, match=r"generate_config\.val\.n=0: must be > 0"):
        make_plan(config_from_dict({"generate_config": {"val": {"n": 0}}}), check_files=False)


def _prompts_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": p[:-1]}) + "\n" for p in prompts))
    return path


def test_val_fraction_splits_a_file_by_a_hash_of_each_prompt(tmp_path, capsys):
    """data.val_fraction holds out a share of a user's file by prompt, the same whatever the order; the training
    loader never sees a held-out prompt, and a repeated prompt is on one side only."""
    from mindspeed_rl.trainer.validation import load_train_dataset, load_val_dataset
    prompts = [f"{i:03d}=" for i in range(400)]
    data = _prompts_file(tmp_path / "d.jsonl", prompts + prompts[:50])
    shuffled = _prompts_file(tmp_path / "s.jsonl", list(reversed(prompts)))
    cfg = config_from_dict({"trainer": {"val_interval": 5}, "data": {"dataset": str(data), "val_fraction": 0.1}})
    held = {r["prompt"] for r in load_val_dataset(cfg)}
    train = [r["prompt"] for r in load_train_dataset(cfg)]
    assert 20 <= len(held) <= 60 and not held & set(train) and len(set(train)) + len(held) == 400
    other = config_from_dict({"trainer": {"val_interval": 5}, "data": {"dataset": str(shuffled), "val_fraction": 0.1}})
    assert {r["prompt"] for r in load_val_dataset(other)} == held
    make_plan(cfg, check_files=True)          # accepted: validation on the held-out share
    assert "warning" not in capsys.readouterr().err


def test_val_fraction_refusals():
    for data, expected in [({"val_fraction": 1.0}, "data.val_fraction=1.0: must be in [0, 1)"),
                           ({"val_fraction": 0.1}, "data.dataset='builtin:copy' is a built-in task"),
                           ({"val_fraction": 0.1, "dataset": "x.jsonl", "val_dataset": "y.jsonl"},
                            "two validation sets")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            make_plan(config_from_dict({"data": data}), check_files=False)


def test_a_validation_set_sharing_training_prompts_is_warned_with_the_count(tmp_path, capsys):
    data = _prompts_file(tmp_path / "d.jsonl", [f"{i:03d}=" for i in range(100)])
    val = _prompts_file(tmp_path / "v.jsonl", [f"{i:03d}=" for i in range(90, 120)])
    make_plan(config_from_dict({"trainer": {"val_interval": 5, "output_dir": str(tmp_path / "o")},
                                "data": {"dataset": str(data), "val_dataset": str(val)}}), check_files=True)
    assert "data.val_dataset=" in (err := capsys.readouterr().err) and "10 of its 30 distinct prompts" in err
    make_plan(config_from_dict({"trainer": {"val_interval": 5, "output_dir": str(tmp_path / "o")},
                                "data": {"dataset": str(data), "val_dataset": str(data)}}), check_files=True)
    assert "100 of its 100 distinct prompts are also training prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_the_commands_exit_2_without_a_traceback(tmp_path):
    """cli/evaluate.py and cli/train_grpo.py: one line and exit 2, before Ray starts (3-6 s: Python, Hydra)."""
    cases = [(["cli/evaluate.py", f"data.val_dataset={tmp_path / 'missing.jsonl'}", f"out={tmp_path / 'e'}"],
              "data.val_dataset="),
             (["cli/evaluate.py", "generate_config.val.temprature=0"], "did you mean 'temperature'"),
             (["cli/train_grpo.py", "trainer.val_interval=5", "data.val_dataset=null"],
              "validation needs data.val_dataset")]
    for argv, expected in cases:
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 2, (argv, out.stderr[-1500:])
        assert expected in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr[-1500:])


# ------------------------------------------------------------------------------ real runs
TRAIN_KEYS_SKIPPED = ("val/", "timing/", "busy/", "throughput/", "memory/")


def _run(tmp: Path, name: str, steps: int, **sections) -> tuple[list[dict], object]:
    from mindspeed_rl.trainer import Trainer
    base = {"trainer": {"total_steps": steps, "output_dir": str(tmp / name), "progress": False, "logger": ["jsonl"],
                        "plot": False, "save_interval": 0, "stage_timeout_s": 60, "dashboard": False,
                        "report": False},
            "rl_config": {"guarantee_order": True, "max_weight_staleness": 1, "prompts_per_step": 8},
            "data": {"val_dataset": "builtin:copy", "val_size": 24},
            "generate_config": {"val": {"n": 3}}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    trainer = Trainer(config_from_dict(base))
    return trainer.run(), trainer


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.slow_budget(45, reason="three Trainer runs of 4, 4 and 0 steps on the shared Ray instance (about 12 s "
                                    "each, most of it starting the workers and loading the model), with 3 validations")
def test_validation_is_logged_at_pinned_versions_and_changes_no_training_number(ray_session, tmp_path):
    """Rollout runs one version ahead (max_weight_staleness 1): each validation still samples exactly the weights
    of the step just trained. The same run without validation has every training number equal, weight checksums
    included; evaluating the starting weights with no training step gives the validation before training."""
    steps = 4
    with_val, _ = _run(tmp_path, "val", steps, trainer={"val_interval": 2, "val_before_train": True})
    without, _ = _run(tmp_path, "plain", steps)
    assert [{k: v for k, v in r.items() if not k.startswith(TRAIN_KEYS_SKIPPED)} for r in with_val] == \
           [{k: v for k, v in r.items() if not k.startswith(TRAIN_KEYS_SKIPPED)} for r in without]
    assert all("weight_sync/actor_checksum" in r for r in with_val)
    versions = {r["step"]: r.get("val/weight_version") for r in with_val}
    assert versions == {0: 0.0, 1: 2.0, 2: None, 3: 4.0}   # before training, after steps 1 and 3 (the last)
    for r in with_val:
        if r["step"] != 2:
            assert r["val/prompts"] == 24 and 0.0 <= r["val/pass@1"] <= r["val/pass@3"] <= 1.0
            assert 0.0 <= r["val/reward_mean"] <= 1.0 and 0 < r["val/response_length_mean"] <= 4
            assert r["timing/val"] > 0
    assert not any(k.startswith("val/") for r in without for k in r)
    lines = [json.loads(line) for line in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["val/weight_version"] == 2.0                # in metrics.jsonl as in the records

    _, evaluation = _run(tmp_path, "eval", 0, trainer={"val_before_train": True})  # cli/evaluate.py's path
    first = {k: v for k, v in with_val[0].items() if k.startswith("val/")}
    assert {k: v for k, v in evaluation.validation.results[-1].items() if k.startswith("val/")} == first


def test_pass_at_k_needs_a_stated_threshold_with_a_reward_model():
    """A rule reward passes at its full score 1.0; a reward model's raw scores have none, so pass@k is not
    reported unless generate_config.val.pass_threshold states one."""
    from mindspeed_rl.trainer.validation import pass_threshold
    rule = config_from_dict({})
    learned = config_from_dict({"reward_model": {"enable": True, "model_path": "x"}})
    stated = config_from_dict({"reward_model": {"enable": True, "model_path": "x"},
                               "generate_config": {"val": {"pass_threshold": 0.5}}})
    assert (pass_threshold(rule), pass_threshold(learned), pass_threshold(stated)) == (1.0, None, 0.5)
    record = {"reward/mean": 0.5, "response_length/mean": 2.0}
    assert "val/pass@1" not in val_metrics(record, [[3.0, -1.0]], n=2, threshold=None)
    assert val_metrics(record, [[3.0, -1.0]], n=2, threshold=0.5)["val/pass@1"] == 0.5
