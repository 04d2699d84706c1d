"""A learned reward end to end (issue 27): reward modeling through the trainer (one train_step MFC over the
preference pairs, held-out evaluation, <output_dir>/final), then RL runs scored by that model: the stage like any
other, blocking == non-blocking under guarantee_order, no weight sync and no checkpoint of the reward model, a
resume. And the plan's refusals, before any worker starts, naming reward_model.model_path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, config_from_dict
from mindspeed_rl.trainer import Trainer
from mindspeed_rl.planning import make_plan

KEY = "reward_model.model_path"
QUIET = {"progress": False, "logger": ["jsonl"], "plot": False, "stage_timeout_s": 60, "dashboard": False}


def rm_config(out: Path, steps: int = 20) -> dict:
    return {"trainer": {**QUIET, "total_steps": steps, "output_dir": str(out), "eval_interval": 10, "save_interval": 0,
                        "report": False},
            "rl_config": {"algorithm": "reward_modeling", "n_samples_per_prompt": 1, "prompts_per_step": 32},
            "reward_model": {"model_path": "builtin:tiny-qwen2", "lr": 1e-3},
            "data": {"dataset": "builtin:copy_pairs", "size": 400, "eval_size": 40}}


def rl_config(out: Path, rm: str, algorithm: str = "grpo", **extra) -> dict:
    cfg = {"trainer": {**QUIET, "total_steps": 3, "output_dir": str(out), "save_interval": 0, "report": True},
           "rl_config": {"algorithm": algorithm, "n_samples_per_prompt": 4, "prompts_per_step": 8,
                         "guarantee_order": True, "reward_weights": {"model": 1.0, "rule": 0.0}},
           "actor_config": {"kl_loss_coef": 0.0, "ppo_mini_batch_size": 4},
           "generate_config": {"max_new_tokens": 3},
           "reward_model": {"enable": True, "model_path": rm, "micro_batch_size_per_device": 8}}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ refusals before any worker starts
def test_a_bad_model_path_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=rf"{KEY}='{tmp_path}/nope': no HF checkpoint there"):
        make_plan(config_from_dict(rl_config(tmp_path / "o", str(tmp_path / "nope"))), check_files=True)
    with pytest.raises(ConfigError, match=rf"{KEY}='builtin:tiny-qwen2': a built-in model is a causal LM"):
        make_plan(config_from_dict(rl_config(tmp_path / "o", "builtin:tiny-qwen2")), check_files=True)
    from mindspeed_rl.models import resolve_model_path
    lm = str(resolve_model_path("builtin:tiny-qwen2"))
    with pytest.raises(ConfigError, match=r"\['Qwen2ForCausalLM'\] is not a sequence classifier"):
        make_plan(config_from_dict(rl_config(tmp_path / "o", lm)), check_files=True)
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "num_labels": 2, "model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=rf"{KEY}='{two}': Qwen2ForSequenceClassification with 2 labels"):
        make_plan(config_from_dict(rl_config(tmp_path / "o", str(two))), check_files=True)
    # the plan has the stage, its model path, and a worker group for it like any model's
    plan = make_plan(config_from_dict(rl_config(tmp_path / "o", str(two), placement={"mode": "disaggregated"})),
                     check_files=False)
    assert plan.model_paths["reward"] == str(two) and plan.group_of("reward_model") == "reward"
    assert "reward" not in plan.trained and "reward" not in plan.sync_targets


def test_a_mesh_split_reward_model_is_refused(tmp_path):
    cfg = rl_config(tmp_path / "o", "/x", placement={"mode": "disaggregated",
                                                     "groups": {"reward": {"dp": 1}}},
                    reward_model={"backend": "megatron"})
    with pytest.raises(ConfigError, match=r"reward_model.backend='megatron': the megatron train backend cannot run a "
                                          r"reward model"):
        make_plan(config_from_dict(cfg), check_files=False)


def test_reward_modeling_dataset_errors_name_the_file(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b"}\n')
    cfg = rm_config(tmp_path / "o")
    cfg["data"] = {"dataset": str(bad)}
    with pytest.raises(ConfigError, match=rf"{bad}:1: missing key 'rejected' \(data.rejected_key\)"):
        make_plan(config_from_dict(cfg), check_files=True)


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def trained_rm(tiny_reward_model):
    """configs/rm_tiny.yaml shortened (tests/conftest.py): the run the reward model's learning check reads too."""
    return tiny_reward_model


@pytest.mark.ray
@pytest.mark.slow
def test_reward_modeling_trains_evaluates_and_saves_a_plain_hf_classifier(trained_rm):
    out, recs = trained_rm
    steps = len(recs)
    assert [r["step"] for r in recs] == list(range(steps))
    from mindspeed_rl.data.preferences import copy_pairs, split_held_out
    held = split_held_out(copy_pairs(3, 10000, seed=1), 500, seed=1)[1]   # rm_tiny's data and seed
    evals = [r for r in recs if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == list(range(99, steps, 100))   # eval_interval 100, and the last step
    assert all(r["eval/pairs"] == len(held.records) for r in evals)
    assert recs[-1]["reward/loss"] < recs[0]["reward/loss"]
    from mindspeed_rl.models.reward import describe_model
    assert describe_model(out / "final") == (["Qwen2ForSequenceClassification"], 1)
    # the saved model is the evaluated one: its held-out accuracy and margin, recomputed here from the plain
    # HF checkpoint on the same split (seed 1), are the last eval's
    import torch
    from transformers import AutoModelForSequenceClassification

    from mindspeed_rl.algorithms import preference_accuracy, preference_margin
    from mindspeed_rl.data.preferences import encode_pairs
    from mindspeed_rl.models import load_tokenizer
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "final")).eval()
    tok = load_tokenizer(str(out / "final"))
    cols, _ = encode_pairs(tok, held.records, max_prompt_length=64)
    with torch.no_grad():
        # the head at the last token (HF's own pooling would skip a <pad> that a noisy rejected answer holds)
        score = lambda p, r: float(model.score(model.model(torch.tensor([list(p) + list(r)])).last_hidden_state)[0, -1, 0])  # noqa: E731,E501
        chosen = torch.tensor([score(p, c) for p, c in zip(cols["prompts"], cols["chosen"])])
        rejected = torch.tensor([score(p, r) for p, r in zip(cols["prompts"], cols["rejected"])])
    assert preference_accuracy(chosen, rejected) == pytest.approx(evals[-1]["eval/accuracy"])
    assert preference_margin(chosen, rejected) == pytest.approx(evals[-1]["eval/margin"], abs=1e-4)


@pytest.mark.ray
@pytest.mark.slow
def test_rl_with_the_reward_model_blocking_equals_non_blocking_and_resumes(trained_rm, tmp_path):
    """3 steps blocking straight through against 3 steps non-blocking made in two parts (2 steps with a
    checkpoint, then a resume to 3): equal numbers every step show both that the non-blocking pipeline
    computes the blocking one's and that the resume continues exactly (one run serves both checks)."""
    rm = str(trained_rm[0] / "final")
    Trainer(config_from_dict(rl_config(tmp_path / "bTrue", rm, rl_config={"blocking": True}))).run()
    out = tmp_path / "bFalse"
    Trainer(config_from_dict(rl_config(out, rm, rl_config={"blocking": False},
                                       trainer={"total_steps": 2, "save_interval": 2}))).run()
    # checkpoints hold the actor only
    step_dir = out / "checkpoints" / "step_000002"
    assert sorted(p.name for p in step_dir.iterdir() if p.is_dir()) == ["actor"]
    Trainer(config_from_dict(rl_config(out, rm, rl_config={"blocking": False},
                                       trainer={"total_steps": 3, "save_interval": 2, "resume": True}))).run()
    runs = {True: records(tmp_path / "bTrue"), False: records(out)}
    assert [r["step"] for r in runs[True]] == [r["step"] for r in runs[False]] == [0, 1, 2]
    for a, b in zip(runs[True], runs[False]):
        for key in ("reward/mean", "reward/model_mean", "reward/rule_mean", "actor/pg_loss"):
            assert a[key] == b[key], (key, a["step"])
        assert a["reward/mean"] == a["reward/model_mean"]   # rule weight 0: the model's score alone trains
        assert "timing/reward_model" in a and "weight_sync/reward_readers" not in a
    assert not any("reward/rule_scores_mean" in r for r in runs[True])
    # the dashboard and the report show its stage like any other
    dash = json.loads((out / "dashboard.json").read_text())
    assert "reward_model" in json.dumps(dash)
