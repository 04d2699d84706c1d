"""Prompts longer than data.max_prompt_length are cut, and said so: one warning at start with the count,
the limit and the longest prompt, and the metric data/prompts_truncated in every step's record."""
from __future__ import annotations

import json

import pytest

from mindspeed_rl.config import config_from_dict
from mindspeed_rl.data import PromptDataset, PromptLoader, truncation_warning
from mindspeed_rl.models import build_char_tokenizer
from mindspeed_rl.trainer import Trainer

from .test_loader import TEMPLATE


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def records(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "answer": "1"} for p in prompts]


def test_warning_counts_the_whole_dataset_before_any_batch(tok):
    ds = PromptDataset(records(["12=", "1234567=", "123456=", "1=", "12345="]), source="d.jsonl")
    loader = PromptLoader(ds, tok, prompts_per_step=2, seed=0, max_prompt_length=5)
    assert loader.truncation_warning() == (
        "warning: 3 of 5 prompts of d.jsonl are longer than data.max_prompt_length=5 tokens (the longest has 8); "
        "they lose their first tokens. Raise data.max_prompt_length to keep them whole (the count per step is "
        "the metric data/prompts_truncated)")
    assert loader.epoch == 0 and loader.offset == 0 and loader.truncated == 0  # the scan draws no batch


def test_no_warning_when_nothing_is_cut(tok):
    ds = PromptDataset(records(["12=", "12345="]))
    assert PromptLoader(ds, tok, 1, seed=0, max_prompt_length=6).truncation_warning() is None
    assert PromptLoader(ds, tok, 1, seed=0, max_prompt_length=None).truncation_warning() is None
    assert truncation_warning(0, 10, 3, 5, "x") is None


def test_lengths_are_measured_as_batches_encode_them():
    """Chat-templated prompts (longer after the template) and preprocessed ids count as the loader feeds them."""
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE  # "1+" before, "=" after a user message
    ds = PromptDataset(records(["12", "3456"]) + [{"prompt": "x", "answer": "1", "prompt_ids": [5] * 9}])
    loader = PromptLoader(ds, tok, 3, seed=0, shuffle=False, apply_chat_template=True, max_prompt_length=5)
    assert list(loader.prompt_lengths(chunk=2)) == [5, 7, 9]
    warning = loader.truncation_warning()
    assert "2 of 3 prompts" in warning and "(the longest has 9)" in warning
    batch = loader.next_batch()
    assert loader.last_truncated == 2 and [len(x) for x in batch["prompts"]] == [5, 5, 5]


def test_last_truncated_is_per_batch(tok):
    ds = PromptDataset(records(["1234567=", "12=", "12=", "12="]))
    loader = PromptLoader(ds, tok, 2, seed=0, shuffle=False, max_prompt_length=4)
    loader.next_batch()
    assert loader.last_truncated == 1
    loader.next_batch()
    assert loader.last_truncated == 0 and loader.truncated == 1


@pytest.mark.slow
@pytest.mark.ray
def test_trainer_warns_once_and_logs_the_count_every_step(ray_session, tmp_path, capsys):
    """The real driver and dock with simulated stages (no models): 3 long prompts in step 0's batch, 5 in
    step 1's (no shuffle), limit 6 tokens."""
    prompts = ["12345678=" if i in (0, 4, 9) else "1=" for i in range(16)]
    prompts += ["1234567=" if i < 5 else "12=" for i in range(16)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(prompts)))
    cfg = config_from_dict({
        "trainer": {"total_steps": 2, "output_dir": str(tmp_path / "out"), "progress": False, "logger": ["jsonl"],
                    "plot": False, "dashboard": False, "report": False, "save_interval": 0, "stage_timeout_s": 60,
                    "simulate_cost_s_per_row": {"actor_rollout": 0.0001}},
        "data": {"dataset": str(path), "max_prompt_length": 6, "shuffle": False},
    })
    history = Trainer(cfg).run()
    assert [r["data/prompts_truncated"] for r in history] == [3, 5]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["data/prompts_truncated"] for r in logged] == [3, 5]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: 8 of 32 prompts of {path} are longer than data.max_prompt_length=6 tokens "
                        "(the longest has 9); they lose their first tokens. Raise data.max_prompt_length to keep "
                        "them whole (the count per step is the metric data/prompts_truncated)"]
