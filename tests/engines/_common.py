"""Helpers shared by the engine tests and their worker processes (importable by both).

Models are tiny Qwen2s built from the built-in config (mindspeed_rl/models/tiny_qwen2/config.json)
with a fixed seed, so a process can rebuild exactly the model another one holds.
"""
from __future__ import annotations

import json

import torch

from mindspeed_rl.algorithms import masked_mean
from mindspeed_rl.models.checkpoint import _CONFIG_DIR

PAD, BOS, EOS = 0, 1, 2
VOCAB = 16
TINY_CONFIG = json.loads((_CONFIG_DIR / "config.json").read_text())


def tiny_qwen2(seed: int = 0, initializer_range: float = 0.02) -> torch.nn.Module:
    """The built-in tiny Qwen2 architecture with seeded weights (the global RNG is left untouched).

    A larger `initializer_range` makes logits sharp (large top-1/top-2 margins), which greedy tests
    need so float noise between two correct computations can never flip an argmax."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**TINY_CONFIG, "initializer_range": initializer_range})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return model.float().eval()


def random_rows(n: int, lengths, seed: int, low: int = BOS, high: int = VOCAB) -> list[torch.Tensor]:
    """`n` 1-D token rows (ids in [low, high)) of the given lengths (an int or one per row)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    return [torch.randint(low, high, (int(k),), generator=g) for k in lengths]


def token_mean_nll(engine, prompts, responses) -> torch.Tensor:
    """Mean negative log-prob over all real response tokens of one micro-batch (with grad)."""
    b = engine.batch(prompts, responses)
    logp, _ = engine.forward(b)
    return masked_mean(-logp, b.response_mask)


def nll_loss_fn(out, mb):
    """A train engine's loss function: the token-mean negative log-prob of the micro-batch."""
    loss = masked_mean(-out.log_probs, out.response_mask)
    return loss, {"nll": float(loss.detach())}


def flat_grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in module.parameters()])


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def save_tiny4(target, seed: int, **overrides) -> str:
    """The 4-layer tiny Qwen2 (4 heads, 2 KV heads: TP=2 splits whole heads, PP up to 4 whole layers)
    with seeded weights, saved as an HF checkpoint at `target`; `overrides` change its config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**json.loads((_CONFIG_DIR / "config_4layers.json").read_text()), **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(target, safe_serialization=True)
    return str(target)


def spy_update_weights(engine) -> list:
    """Record the names each `update_weights` call of `engine` was given (one list per call)."""
    calls, load = [], engine.update_weights

    def update_weights(named, version):
        named = list(named)
        calls.append([n for n, _ in named])
        load(named, version)

    engine.update_weights = update_weights
    return calls
