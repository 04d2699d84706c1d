"""The real pretrained model through the whole loop: configs/grpo_smollm2_arith.yaml (SmolLM2-135M-Instruct,
its chat template and stop token, builtin:arith) trains 2 steps with validation before training, and that
first validation equals the base model's accuracy computed with transformers alone."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

MODEL = "builtin:smollm2-135m-instruct"
VAL_SIZE = 24


def transformers_accuracy(config) -> float:
    """Greedy answers of the base model by transformers' generate, one prompt at a time (no padding), scored
    with the config's reward: what the run's first validation must give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindspeed_rl.models import resolve_model_path
    from mindspeed_rl.rewards.gsm8k import gsm8k_flexible
    from mindspeed_rl.trainer.validation import load_val_dataset
    path = str(resolve_model_path(MODEL))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    right = 0
    records = load_val_dataset(config)
    for r in records:
        text = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=config.generate_config.max_new_tokens, do_sample=False,
                                 eos_token_id=stop, pad_token_id=stop)
        response = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        right += gsm8k_flexible(response, r["answer"]) >= 1.0
    return right / len(records)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.slow_budget(160, reason="SmolLM2-135M: its conversion, 2 GRPO steps of 16 rows and 24 prompts "
                                     "validated by the run and again by transformers")
def test_the_real_model_validates_as_transformers_and_trains(ray_session, tmp_path):
    from hydra import compose, initialize_config_dir

    from mindspeed_rl.config import config_from_dict
    from mindspeed_rl.trainer import Trainer
    from tests.config.helpers import REPO
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_interval=0",
                 "trainer.dashboard=false", "trainer.progress=false", "trainer.report=false", "trainer.plot=false",
                 "trainer.save_interval=0", "trainer.logger=[jsonl]", "rl_config.prompts_per_step=2",
                 "actor_config.ppo_mini_batch_size=2", f"data.val_size={VAL_SIZE}", "actor_config.dtype=float32"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = config_from_dict(compose("grpo_smollm2_arith", overrides=overrides))
    assert cfg.actor_config.recompute_log_prob is None and cfg.data.chat_template
    trainer = Trainer(cfg)
    records = trainer.run()
    first = trainer.validation.results[0]
    assert first["val/weight_version"] == 0.0 and first["val/prompts"] == VAL_SIZE
    assert first["val/pass@1"] == pytest.approx(transformers_accuracy(cfg), abs=1e-9)
    assert [r["step"] for r in records] == [0, 1] and all("actor/grad_norm" in r for r in records)
    assert "actor_log_prob" not in {m.name for m in trainer.plan.order}   # on-policy: no old log-prob pass
    assert all(0 < r["response_length/mean"] <= 24 for r in records)
    samples = [json.loads(x) for x in (tmp_path / "samples" / "val_v00000.jsonl").read_text().splitlines()]
    assert len(samples) == VAL_SIZE and all(s["answer"].startswith("#### ") for s in samples)
    assert sum(s["reward"] for s in samples) / VAL_SIZE == pytest.approx(first["val/pass@1"])
    train = (tmp_path / "samples" / "train.jsonl").read_text().splitlines()
    assert len(train) == 2 * cfg.trainer.log_samples
    assert (tmp_path / "hf" / "final" / "config.json").is_file()
