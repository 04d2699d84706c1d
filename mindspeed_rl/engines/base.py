"""The two engine interfaces workers talk to; backends live behind them.

`hf` (transformers, default) and `torch` (plain torch AdamW/DDP) run everywhere, CPU included.
vLLM and Megatron backends are to come behind these same interfaces (see docs/engines.md); they
are not implemented yet, and a config that names them fails validation with that message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one rollout call samples with (MindSpeed-RL's `generate_config` sampling keys)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    greedy: bool = False


class RolloutEngine(Protocol):
    """Generates responses; holds its own copy of the policy weights, refreshed by weight sync."""
    weight_version: int

    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seed: int) -> list[torch.Tensor]:
        """One response (1-D token ids, ending with a stop token unless cut by max_new_tokens) per prompt."""

    def named_parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors weight sync writes into, in the trainer's parameter order."""


class TrainEngine(Protocol):
    """Forward/backward and optimizer of one trainable model (the policy, a critic, ...)."""
    version: int

    def log_probs(self, prompts, responses, micro_batch_size: int, with_entropy: bool = False):
        """Per-token log-probs of each response (1-D per row)."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero grads; bumps `version`."""
