"""What the model answers (trainer/samples.py): the rule reward hands back the rows it decoded, and the run
writes a few per training step and every validation row where a person reads them."""
from __future__ import annotations

import json

import torch

from mindspeed_rl.dashboard import DashboardState
from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.trainer.samples import SampleLog, report_samples
from mindspeed_rl.workers.steps.rule_reward import rule_reward


def test_the_rule_reward_returns_the_text_it_scored():
    tok = build_char_tokenizer()
    enc = lambda s: torch.tensor(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    batch = {"prompts": [enc("12="), enc("34=")], "responses": [enc("12"), enc("99")], "labels": ["12", "34"]}
    out = rule_reward(batch, [6, 7], reward_fn=lambda r, a, p: float(r == a), tokenizer=tok,
                      decode_label=lambda x: x)
    assert out.samples == [{"row": 6, "prompt": "12=", "response": "12", "answer": "12", "reward": 1.0},
                           {"row": 7, "prompt": "34=", "response": "99", "answer": "34", "reward": 0.0}]


def _reports(rows):
    return [{"stage": "rule_reward", "samples": [{"row": r, "prompt": f"p{r}", "response": f"r{r}", "answer": "a",
                                                  "reward": 0.5} for r in rs]} for rs in rows]


class Tracker:
    def __init__(self):
        self.got = []

    def log_samples(self, kind, step, rows):
        self.got.append((kind, step, len(rows)))


def test_training_and_validation_samples_go_to_files_the_dashboard_and_trackers(tmp_path):
    state, tracker = DashboardState({"title": "t"}), Tracker()
    log = SampleLog(str(tmp_path), per_step=2, dashboard=state, trackers=[tracker])
    assert [s["row"] for s in report_samples(_reports([[5, 3], [1]]))] == [1, 3, 5]
    log.training(0, _reports([[5, 3], [1]]))
    log.training(1, _reports([[0, 2]]))
    log.validation(2, 2, _reports([[1, 0], [2]]))
    train = [json.loads(x) for x in (tmp_path / "samples" / "train.jsonl").read_text().splitlines()]
    assert [(r["step"], r["row"]) for r in train] == [(0, 1), (0, 3), (1, 0), (1, 2)]
    val = [json.loads(x) for x in (tmp_path / "samples" / "val_v00002.jsonl").read_text().splitlines()]
    assert [r["row"] for r in val] == [0, 1, 2] and val[0]["weight_version"] == 2 and val[0]["response"] == "r0"
    snap = state.snapshot()["samples"]
    assert [r["step"] for r in snap["train"]] == [0, 0, 1, 1] and len(snap["val"]) == 3
    assert tracker.got == [("train", 0, 2), ("train", 1, 2), ("val", 2, 3)]
    # a resumed run keeps the steps before its checkpoint; a fresh one starts anew
    SampleLog(str(tmp_path), per_step=2, resume_step=1)
    assert [json.loads(x)["step"] for x in (tmp_path / "samples" / "train.jsonl").read_text().splitlines()] == [0, 0]
    SampleLog(str(tmp_path), per_step=2)
    assert (tmp_path / "samples" / "train.jsonl").read_text() == ""
    off = SampleLog(str(tmp_path / "off"), per_step=0)
    assert off.training(0, _reports([[1]])) == [] and not (tmp_path / "off" / "samples").exists()
