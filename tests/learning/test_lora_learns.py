"""The default GRPO with LoRA (`python cli/train_grpo.py actor_config.lora.rank=8`: rank-8 adapters on every
linear layer at lora.lr 1e-3, the RMSNorms trained whole at modules_to_save_lr 1e-2; seed 1) learns to copy
digits: shortened to STEPS steps, its 10-step mean reward ends above THRESHOLD, while the tied embedding
(the frozen base's, and so its head) leaves the run unchanged and the rollout's log-probs stay the
trainer's at the float level.

The 5-seed spread at 120 and 300 steps is in docs/fitting.md with its command. Its lr-0 check: the adapters
and the norms have learning rates of their own, so
`MINDSPEED_RL_LEARNS_OVERRIDES="actor_config.lora.lr=1.0e-12 actor_config.lora.modules_to_save_lr=1.0e-12"`."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_rl.models import resolve_model_path

from .helpers import last10, train

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 120
# seeds 1-5 at 120 steps: 0.854-0.931 (seed 1: 0.931; docs/benchmarks/seed_spread_grpo_tiny_lora8_120.json,
# docs/fitting.md); untrained about 0.07
THRESHOLD = 0.7


def test_grpo_tiny_lora_learns(ray_session, tmp_path):
    out = tmp_path / "run"
    records = train("grpo_tiny", out, STEPS, **{"actor_config.lora.rank": 8, "trainer.seed": 1, "trainer.save_hf": "final"})
    assert last10(records[:10]) < 0.15, "the untrained policy"
    assert last10(records) >= THRESHOLD, [round(r["reward/mean"], 3) for r in records[-10:]]
    assert max(r["rollout/logprob_diff_max"] for r in records) < 1e-3
    base = load_file(str(resolve_model_path("builtin:tiny-qwen2") / "model.safetensors"))
    trained = load_file(str(out / "hf" / "final" / "model.safetensors"))
    assert torch.equal(trained["model.embed_tokens.weight"], base["model.embed_tokens.weight"])   # frozen head
    assert not torch.equal(trained["model.norm.weight"], base["model.norm.weight"])               # a trained copy
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])                        # merged adapters
